package jobs

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
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
		return fmt.Errorf("character %q at offset %d", c, i)
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
