package jobs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
	"unicode/utf8"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"
	"github.com/idem-dev/idem/internal/storex"
)

// Kind is a kind of job: its name and its ordered steps. Workers register
// the kinds they run (NewWorker); a job names its kind when it is submitted.
type Kind struct {
	// Name names the kind: 1 to 64 characters of [A-Za-z0-9._-].
	Name string
	// Steps run in order. A step that finished (its checkpoint landed) is
	// never run again for the job, whoever resumes it; steps are matched
	// by name, so a new version of a kind may add steps.
	Steps []Step
	// MaxAttempts is how many attempts a job gets before it is parked
	// (default 5). Every attempt counts, one that crashed its worker too.
	MaxAttempts int
	// Backoff is the delay before the second attempt after a failed one
	// (default 1 s); it doubles with each attempt, up to MaxBackoff
	// (default 5 min), with up to a fifth of random jitter.
	Backoff, MaxBackoff time.Duration
	// Deadline, when set, bounds one attempt: a worker that is alive but
	// has not finished the job by then has its claim taken over, as if it
	// had died (its context ends with etcdstore.ErrDeadline). Without it,
	// only a worker's death ends its attempt.
	Deadline time.Duration
	// Limits bound how many of the kind's jobs that share a key run an
	// attempt at once, or start one per second, across every worker (see
	// Limit). A job must hold a slot of each to run a step.
	Limits []Limit
}

// Defaults of a Kind.
const (
	DefaultMaxAttempts = 5
	DefaultBackoff     = time.Second
	DefaultMaxBackoff  = 5 * time.Minute
)

// Step is one step of a kind: a unit of work whose end is saved as a
// recovery point (Brandur Leach's atomic phases).
type Step struct {
	// Name names the step within its kind: 1 to 64 characters of
	// [A-Za-z0-9_-].
	Name string
	// Run does the step. Its output is saved with the step's checkpoint,
	// and later steps read it with Run.Output. An error is handled as
	// OnError says. Run may be called again for the same job after an
	// attempt that did not finish it (its worker crashed, or the checkpoint
	// could not be saved), so its effects must be idempotent downstream
	// (send Run.StepKey) or fenced (send Run.Token), or live in etcd
	// (Run.Commit): then they happen once.
	Run func(ctx context.Context, r *Run) ([]byte, error)
	// OnError says what a failure of Run means for the job (default
	// Retry).
	OnError OnError
	// Compensate undoes a finished step, when a later step fails with
	// OnError Compensate. Optional: a step without it is left as it is.
	// It is resumed like a step, so it must be idempotent.
	Compensate func(ctx context.Context, r *Run) error

	// waits is how long the step waits, when it says so when it is made
	// (SleepStep, AwaitStep): checked against the retention when its kind
	// is registered.
	waits time.Duration
}

// OnError says what a step's failure does to its job.
type OnError int

const (
	// Retry ends the attempt: the job is retried after a backoff, resuming
	// at the failed step, until it has had Kind.MaxAttempts attempts; then
	// it is parked for an operator. For transient failures (a timeout, a
	// 503), and for steps that are safe to run again.
	Retry OnError = iota
	// Fail ends the job as failed, with the error saved: later steps never
	// run, earlier ones stay done. For failures a retry cannot mend (a
	// refused card) when the effects so far may stand.
	Fail
	// Compensate ends the job as failed after undoing every finished step,
	// last first, with its Compensate (a saga): for failures that must not
	// leave earlier effects standing. Compensations are retried like steps
	// until they all finish, or the job is parked.
	Compensate
)

func (o OnError) String() string {
	switch o {
	case Retry:
		return "retry"
	case Fail:
		return "fail"
	case Compensate:
		return "compensate"
	}
	return fmt.Sprintf("OnError(%d)", int(o))
}

// validate checks k and fills its defaults. A job is forgotten a retention
// after its last write, so nothing may hold it back for half of one.
func (k *Kind) validate(retention time.Duration) error {
	if err := validName(k.Name, 64, true); err != nil {
		return fmt.Errorf("%w: kind name %q: %v", ErrInvalid, k.Name, err)
	}
	if len(k.Steps) == 0 {
		return fmt.Errorf("%w: kind %s has no steps", ErrInvalid, k.Name)
	}
	seen := map[string]bool{}
	for i, s := range k.Steps {
		if err := validName(s.Name, 64, false); err != nil {
			return fmt.Errorf("%w: kind %s, step %d name %q: %v", ErrInvalid, k.Name, i, s.Name, err)
		}
		if seen[s.Name] {
			return fmt.Errorf("%w: kind %s has two steps named %s", ErrInvalid, k.Name, s.Name)
		}
		seen[s.Name] = true
		if s.Run == nil {
			return fmt.Errorf("%w: kind %s, step %s has no Run", ErrInvalid, k.Name, s.Name)
		}
		if s.OnError < Retry || s.OnError > Compensate {
			return fmt.Errorf("%w: kind %s, step %s: unknown OnError %d", ErrInvalid, k.Name, s.Name, s.OnError)
		}
		if s.waits >= retention/2 {
			// Refused now, not when each of its jobs reaches the step.
			return fmt.Errorf("%w: kind %s, step %s waits %v, past half the store's retention (%v): its jobs could be forgotten while they wait",
				ErrInvalid, k.Name, s.Name, s.waits, retention)
		}
	}
	k.Limits = slices.Clone(k.Limits)
	names := map[string]bool{}
	for i := range k.Limits {
		if err := k.Limits[i].validate(k.Name); err != nil {
			return err
		}
		if l := &k.Limits[i]; l.Rate > 0 && l.period()+kernel.RateSlack(l.period()) > retention {
			// A rate slot is kept for the retention: a longer period would
			// be forgotten before its end (found by review).
			return fmt.Errorf("%w: kind %s: limit %s: a period of %v (Burst/Rate, and its slack %v) is longer than the store's retention (%v): raise Rate or the retention",
				ErrInvalid, k.Name, l.Name, l.period(), kernel.RateSlack(l.period()), retention)
		}
		if names[k.Limits[i].Name] {
			return fmt.Errorf("%w: kind %s has two limits named %s", ErrInvalid, k.Name, k.Limits[i].Name)
		}
		names[k.Limits[i].Name] = true
	}
	switch {
	case k.MaxAttempts < 0:
		return fmt.Errorf("%w: kind %s: MaxAttempts %d is negative", ErrInvalid, k.Name, k.MaxAttempts)
	case k.Backoff < 0 || k.MaxBackoff < 0 || k.Deadline < 0:
		return fmt.Errorf("%w: kind %s: negative durations", ErrInvalid, k.Name)
	}
	if k.MaxAttempts == 0 {
		k.MaxAttempts = DefaultMaxAttempts
	}
	if k.Backoff == 0 {
		k.Backoff = DefaultBackoff
	}
	if k.MaxBackoff == 0 {
		k.MaxBackoff = max(DefaultMaxBackoff, k.Backoff)
	}
	if k.MaxBackoff*6/5 >= retention/2 || k.Deadline >= retention/2 {
		return fmt.Errorf("%w: kind %s: MaxBackoff %v and Deadline %v must be under half the store's retention (%v): a job waiting longer would be forgotten",
			ErrInvalid, k.Name, k.MaxBackoff, k.Deadline, retention)
	}
	return nil
}

// validName checks a name of 1 to n characters of [A-Za-z0-9_-], and '.'
// too when dots is set.
func validName(s string, n int, dots bool) error {
	if s == "" || len(s) > n {
		return fmt.Errorf("must be 1 to %d characters", n)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || dots && c == '.' {
			continue
		}
		// The character as sent (a byte of a multi-byte one, quoted as
		// a rune, would name a character that was not sent).
		if r, size := utf8.DecodeRuneInString(s[i:]); r != utf8.RuneError || size > 1 {
			return fmt.Errorf("character %q at offset %d", r, i)
		}
		return fmt.Errorf("byte %#02x at offset %d, which is not UTF-8", c, i)
	}
	return nil
}

// backoff returns the delay before attempt n+1 after attempt n failed.
func (k *Kind) backoff(n int, jitter float64) time.Duration {
	d := k.Backoff
	for i := 1; i < n && d < k.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, k.MaxBackoff)
	return d + time.Duration(jitter*float64(d)/5)
}

// Run is what a step sees of its job's attempt.
type Run struct {
	claim        *etcdstore.Claim
	tenant       string
	st           *state
	step         string
	attempt      int
	compensating bool
	ops          []clientv3.Op

	q       *Queue
	ctx     context.Context // the attempt's, for the checkpoints of waits
	calls   int             // waits reached in this run of the step
	suspend *wait           // set when a wait gives the job back
	retry   time.Time       // when to look again, after the store failed a wait
}

// Key returns the job's key.
func (r *Run) Key() etcdstore.Key { return r.claim.Key() }

// Kind returns the job's kind.
func (r *Run) Kind() string { return r.st.Kind }

// Params returns the parameters the job was submitted with.
func (r *Run) Params() []byte { return r.st.Params }

// Step returns the name of the step running.
func (r *Run) Step() string { return r.step }

// Attempt returns the attempt's number, from 1.
func (r *Run) Attempt() int { return r.attempt }

// Token returns the fencing token of this attempt's claim: send it with
// every downstream write (fencing.SetHeader) so that a downstream that
// keeps the highest token seen refuses this worker once another has taken
// the job over. It is also in the step's context (fencing.FromContext).
func (r *Run) Token() fencing.Token { return r.claim.Token() }

// StepKey returns an idempotency key for the step's downstream call,
// "<tenant>:<job id>.<step>": the same on every attempt, so a downstream
// that deduplicates by it applies the step's effect once however often the
// step runs. A compensation's is "<tenant>:<job id>.<step>!undo": a refund
// must not be answered with the charge it undoes. Tenants have no ':' and
// steps neither '.' nor '!', so no two steps of two jobs share one.
func (r *Run) StepKey() string {
	k := r.tenant + ":" + r.claim.Key().ID + "." + r.step
	if r.compensating {
		k += "!undo"
	}
	return k
}

// Compensating reports whether the run is a compensation of its step.
func (r *Run) Compensating() bool { return r.compensating }

// Output returns the output of a finished step of this job, or nil.
func (r *Run) Output(step string) []byte {
	if d := r.st.finished(step); d != nil {
		return d.Output
	}
	return nil
}

// Commit adds etcd ops that commit in the same Txn as the checkpoint that
// finishes this step (or, for the last step, that ends the job): a step
// whose effect lives in etcd then applies it exactly once, atomically with
// its recovery point. The ops must not touch the store's prefix (127 at
// most per step). In a compensation, they commit with the checkpoint that
// records it.
func (r *Run) Commit(ops ...clientv3.Op) { r.ops = append(r.ops, ops...) }

// Claim returns the attempt's claim: its IsOwner comparison fences the
// caller's own etcd Txns.
func (r *Run) Claim() *etcdstore.Claim { return r.claim }

// ErrSuspended is returned by Run.Sleep and Run.Await when the job must
// wait: the step returns it (or any error: the worker knows), and the worker
// saves the wait with the job and gives the job back. No attempt is counted
// for it. When the wait is over (the time came, the event was signalled,
// or it timed out) a worker resumes the job by running the step again from
// its start: the waits it passed return at once what they returned before,
// and the one that suspended it returns.
var ErrSuspended = errors.New("jobs: the job waits (return this error from the step)")

// ErrTimeout is returned by Run.Await when its event did not come within
// its timeout. Every later run of the step sees the same.
var ErrTimeout = errors.New("jobs: the event did not come in time")

// ErrNondeterministic is returned by Run.Sleep and Run.Await when a step's
// run reaches its waits in another order than its first run did (an Await
// where a Sleep was, another event's name): the step's waits must come in
// the same order on every run.
var ErrNondeterministic = errors.New("jobs: the step's waits changed between runs")

// Sleep makes the job wait for d, durably: the first time a run of the
// step reaches this call, the wake-up time (now + d, on the worker's clock)
// is saved with the job, and Sleep returns ErrSuspended, which the step
// returns. The worker gives the job back; no worker holds it while it
// sleeps. From the wake-up time on, a worker resumes the job: the step runs
// again from its start, and this call returns nil. A job resumed after a
// crash sleeps only what was left: the wake-up time was saved once.
//
// A step's code before a Sleep runs again after it: put what must not run
// twice in an earlier step, or give the sleep a step of its own
// (SleepStep). d is at most half the store's retention.
func (r *Run) Sleep(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("sleep: %w: negative duration %v", ErrInvalid, d)
	}
	return r.sleep(r.now().Add(d), d)
}

// SleepUntil is Sleep until t, which the first run to reach the call saves:
// later runs wait for that t, whatever they pass.
func (r *Run) SleepUntil(t time.Time) error { return r.sleep(t, t.Sub(r.now())) }

func (r *Run) sleep(until time.Time, d time.Duration) error {
	w, err := r.reach("")
	if err != nil {
		return err
	}
	if w == nil {
		if d >= r.q.retention()/2 {
			return fmt.Errorf("sleep: %w: %v is past half the store's retention (%v): the job could be forgotten while it sleeps",
				ErrInvalid, d, r.q.retention())
		}
		w = r.add(wait{Until: ceilMilli(until)})
	}
	if r.now().UnixMilli() >= w.Until {
		return nil
	}
	r.suspend = w
	return ErrSuspended
}

// Await waits, durably, for the event name of this job (Queue.Signal), for
// at most timeout (0: as long as the job is kept, half the store's
// retention). It returns the event's payload; an event signalled before the
// job waits is there already. The first time a run of the step reaches the
// call without the event, the wait is saved with the job and Await returns
// ErrSuspended, which the step returns: the worker gives the job back, and
// a worker resumes it when the event is signalled or the timeout passes;
// the step runs again from its start, and this call returns the payload,
// or ErrTimeout. What it returned is saved with the job before it returns,
// so every later run of the step sees the same payload, or the same
// timeout, once and for all.
func (r *Run) Await(name string, timeout time.Duration) ([]byte, error) {
	if err := validName(name, 64, true); err != nil {
		return nil, fmt.Errorf("await: %w: event name %q: %v", ErrInvalid, name, err)
	}
	if timeout < 0 || timeout >= r.q.retention()/2 {
		return nil, fmt.Errorf("await %s: %w: timeout %v must be 0 or under half the store's retention (%v)", name, ErrInvalid, timeout, r.q.retention())
	}
	w, err := r.reach(name)
	if err != nil {
		return nil, err
	}
	if w == nil {
		if timeout == 0 {
			timeout = r.q.retention()/2 - time.Second
		}
		w = r.add(wait{Event: name, Until: ceilMilli(r.now().Add(timeout))})
	}
	switch {
	case w.Got:
		return w.Payload, nil
	case w.TimedOut:
		return nil, fmt.Errorf("await %s: %w", name, ErrTimeout)
	}
	v, err := storex.GetValue(storex.StoreOf(r.claim), r.ctx, eventName(r.tenant, r.Key().ID, r.claim.Created(), name))
	if err != nil {
		// Not known: neither the payload nor a timeout. The job is given
		// back, and looked at again in a second.
		return nil, r.suspendAfter(w)
	}
	switch {
	case v.Revision != 0:
		w.Got, w.Payload = true, v.Value
	case r.now().UnixMilli() >= w.Until:
		w.TimedOut = true
	default:
		r.suspend = w
		return nil, ErrSuspended
	}
	// Decided: saved before the step sees it, so that no later run of
	// the step decides otherwise.
	awaiting, notBefore := r.st.Awaiting, r.st.NotBefore
	r.st.Awaiting, r.st.NotBefore = "", 0
	if err := checkpoint(r.ctx, r.q.clock, r.claim, r.st.encode(), nil); err != nil {
		w.Got, w.Payload, w.TimedOut = false, nil, false
		r.st.Awaiting, r.st.NotBefore = awaiting, notBefore
		if refused(err) {
			return nil, fmt.Errorf("await %s: saving what it received: %w", name, err) // a payload too large for the job
		}
		// Not saved, or not known to be: the step did not see it, and a
		// later run decides again.
		return nil, r.suspendAfter(w)
	}
	if w.TimedOut {
		return nil, fmt.Errorf("await %s: %w", name, ErrTimeout)
	}
	return w.Payload, nil
}

// suspendAfter gives the job back with wait w pending, to be looked at
// again in a second (the store failed it).
func (r *Run) suspendAfter(w *wait) error {
	r.suspend, r.retry = w, r.now().Add(time.Second)
	return ErrSuspended
}

// reach finds the wait this call is in the step's run (event "" for a
// sleep), or nil when no run reached it before.
func (r *Run) reach(event string) (*wait, error) {
	if r.compensating {
		return nil, fmt.Errorf("%w: a compensation cannot wait", ErrInvalid)
	}
	if r.suspend != nil {
		return nil, fmt.Errorf("%w: the step went on after a wait returned ErrSuspended", ErrNondeterministic)
	}
	r.calls++
	for i := range r.st.Waits {
		w := &r.st.Waits[i]
		if w.Step == r.step && w.N == r.calls {
			if w.Event != event {
				return nil, fmt.Errorf("%w: wait %d of step %s was for event %q, now %q", ErrNondeterministic, w.N, r.step, w.Event, event)
			}
			return w, nil
		}
	}
	return nil, nil
}

func (r *Run) add(w wait) *wait {
	w.Step, w.N = r.step, r.calls
	r.st.Waits = append(r.st.Waits, w)
	return &r.st.Waits[len(r.st.Waits)-1]
}

func (r *Run) now() time.Time { return r.q.clock.Now() }

// ceilMilli is t in unix milliseconds, rounded up: a wait saved in
// milliseconds must not end before its time.
func ceilMilli(t time.Time) int64 {
	ms := t.UnixMilli()
	if !time.UnixMilli(ms).Equal(t) {
		ms++
	}
	return ms
}

// SleepStep is a step that sleeps for d, durably (Run.Sleep), and does
// nothing else: a timer between two steps that nothing runs twice around.
func SleepStep(name string, d time.Duration) Step {
	return Step{Name: name, waits: d, Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, r.Sleep(d) }}
}

// AwaitStep is a step that waits for event (Run.Await) for at most
// timeout, and whose output is the event's payload: later steps read it with
// Run.Output(name). A timeout fails the step as onError says.
func AwaitStep(name, event string, timeout time.Duration, onError OnError) Step {
	return Step{Name: name, OnError: onError, waits: timeout, Run: func(ctx context.Context, r *Run) ([]byte, error) { return r.Await(event, timeout) }}
}
