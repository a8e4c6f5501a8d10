package jobs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Worker runs jobs of the kinds it registered: the ones it is asked to run
// (Run) and, with a Concurrency above zero, the ones its completer finds
// waiting (queued, due, or abandoned by a worker that died), without any
// client asking.
//
// NewWorker starts the completer's work, on the store's clock (one piece
// follows the queue's records and the live sessions, one starts due jobs,
// and one runs each job); Close stops it.
type Worker struct {
	q        *Queue
	kinds    map[string]*Kind
	conc     int
	drain    time.Duration
	fallback time.Duration
	name     string // WorkerName
	log      *slog.Logger

	stopping context.Context // ends when Close starts: no job starts after
	stop     context.CancelFunc
	wg       clock.Group

	mu      sync.Mutex
	running map[string]context.CancelCauseFunc // jobs running here, by id: Close's drain cancels them
	closed  bool

	comp  *completer   // the first of comps; nil without a completer
	comps []*completer // one per store: on a shard set, per shard

	// gate, when set, says whether the completer may start a job of a
	// kind now (a Hub's: a remote worker of it waits), keeping its place;
	// ungate gives the place back when the attempt ends.
	gate   func(kind, job string) bool
	ungate func(kind, job string)
}

// withGate makes the completer start a job only when gate says so (Hub).
func withGate(gate func(string, string) bool, ungate func(string, string)) WorkerOption {
	return func(w *Worker) error { w.gate, w.ungate = gate, ungate; return nil }
}

// wake makes the completers look for due jobs again (a Hub's worker came).
func (w *Worker) wake() {
	for _, c := range w.comps {
		c.wake()
	}
}

// errClosing is the cause of a running step's context when its worker
// closes: the attempt is given back, and not counted.
var errClosing = errors.New("jobs: worker closing")

// WorkerOption configures a Worker.
type WorkerOption func(*Worker) error

// Concurrency sets how many jobs the worker's completer runs at once
// (default 4). 0 runs no completer: the worker runs only what Run asks.
func Concurrency(n int) WorkerOption {
	return func(w *Worker) error {
		if n < 0 {
			return fmt.Errorf("%w: concurrency %d is negative", ErrInvalid, n)
		}
		w.conc = n
		return nil
	}
}

// DrainTimeout sets how long Close lets running jobs go on before it
// cancels them (default 30 s). A cancelled job is given back unfinished and
// resumed by another worker; the attempt does not count.
func DrainTimeout(d time.Duration) WorkerOption {
	return func(w *Worker) error {
		if d < 0 {
			return fmt.Errorf("%w: drain timeout %v is negative", ErrInvalid, d)
		}
		w.drain = d
		return nil
	}
}

// DefaultConcurrency is how many jobs a Worker's completer runs at once.
const DefaultConcurrency = 4

// NewWorker returns a worker of q for kinds, and starts its completer. A
// job whose kind the worker does not know is left to the workers that do.
func NewWorker(q *Queue, kinds []Kind, opts ...WorkerOption) (*Worker, error) {
	if q == nil {
		return nil, fmt.Errorf("new worker: %w: nil queue", ErrInvalid)
	}
	w := &Worker{q: q, kinds: map[string]*Kind{}, conc: DefaultConcurrency, drain: 30 * time.Second, fallback: DefaultFallbackAfter, log: q.log,
		running: map[string]context.CancelCauseFunc{}}
	w.stopping, w.stop = context.WithCancel(context.Background())
	for i := range kinds {
		k := kinds[i]
		if err := k.validate(q.retention()); err != nil {
			return nil, fmt.Errorf("new worker: %w", err)
		}
		if w.kinds[k.Name] != nil {
			return nil, fmt.Errorf("new worker: %w: kind %s registered twice", ErrInvalid, k.Name)
		}
		w.kinds[k.Name] = &k
	}
	for _, o := range opts {
		if err := o(w); err != nil {
			return nil, fmt.Errorf("new worker: %w", err)
		}
	}
	if q.set != nil {
		for _, k := range w.kinds {
			if len(k.Limits) > 0 {
				return nil, fmt.Errorf("new worker: %w: kind %s has per-key limits, which need one etcd cluster, not a shard set", ErrInvalid, k.Name)
			}
		}
	}
	if w.conc > 0 {
		if q.set == nil {
			w.comps = []*completer{newCompleter(w, q.store, "")}
		} else {
			for _, n := range q.set.Shards() {
				w.comps = append(w.comps, newCompleter(w, q.set.Shard(n), n))
			}
		}
		w.comp = w.comps[0]
		for _, c := range w.comps {
			c.start()
		}
	}
	return w, nil
}

// Close stops the worker: its completer starts no more jobs, the jobs
// running are given DrainTimeout to finish, then cancelled (given back
// unfinished, for another worker to resume). Close does not close the
// store.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	w.stop()
	w.mu.Unlock()
	clk := w.q.clock
	ctx, cancel := clk.WithTimeout(context.Background(), w.drain)
	w.wg.Wait(clk, ctx)
	cancel()
	w.mu.Lock()
	for _, c := range w.running {
		c(errClosing)
	}
	w.mu.Unlock()
	w.wg.Wait(clk, context.Background())
	for _, c := range w.comps {
		if c.id != 0 {
			freeWorkerID(c.st, c.id)
		}
	}
	return nil
}

// closeWhenIdle stops the worker's completers from starting jobs, lets
// the jobs running end however long they take, then closes it (a Hub's
// worker, replaced by one for new declarations: the jobs it runs finish
// their attempt under the old). Close meanwhile ends it as Close does.
func (w *Worker) closeWhenIdle() {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.stop()
	w.mu.Unlock()
	w.wg.Wait(w.q.clock, context.Background())
	w.Close()
}

// Running returns how many jobs run in this worker now.
func (w *Worker) Running() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.running)
}

// Run runs job id here now, if it is waiting for a worker (queued, due, or
// held by a worker that died), and returns the job as it stands after: its
// steps run under a claim of the job, from its first unfinished one. A job
// that is running elsewhere, parked, scheduled for later or ended is
// returned as it is, unrun. A job of a kind this worker did not register
// is an error wrapping ErrUnknownKind.
func (w *Worker) Run(ctx context.Context, id string) (*Job, error) {
	st, rec, err := w.q.holder(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("run: %w", err)
	}
	j, err := FromRecord(rec, w.q.clock.Now())
	if err != nil {
		return nil, fmt.Errorf("run: %w", err)
	}
	k := w.kinds[j.Kind]
	switch {
	case k == nil:
		return j, fmt.Errorf("run %s: %w: %s", rec.Key, ErrUnknownKind, j.Kind)
	case j.State == Waiting && j.NotBefore.After(w.q.clock.Now()) && !w.q.eventCame(ctx, st, j.Awaiting, id, j.Created):
		return j, nil // its event has not come, nor its timeout
	case j.State != Queued && j.State != Running && j.State != Waiting:
		return j, nil
	}
	if err := w.execute(ctx, id, rec.Fingerprint, k); err != nil && !errors.Is(err, etcdstore.ErrConflict) && !errors.Is(err, errReplayed) {
		return nil, fmt.Errorf("run: %w", err)
	}
	return w.q.Get(ctx, id)
}

// execute claims job id and runs an attempt of it. A job running here
// already, or elsewhere, is an error wrapping etcdstore.ErrConflict.
func (w *Worker) execute(ctx context.Context, id string, fp etcdstore.Fingerprint, k *Kind) error {
	w.mu.Lock()
	switch {
	case w.closed:
		w.mu.Unlock()
		return fmt.Errorf("job %s: %w: the worker is closed", id, etcdstore.ErrUnavailable)
	case w.running[id] != nil:
		w.mu.Unlock()
		return &etcdstore.ConflictError{Key: w.q.Key(id), RetryAfter: time.Second}
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	w.running[id] = cancel
	w.wg.Add(1)
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		delete(w.running, id)
		w.mu.Unlock()
		w.wg.Done()
	}()
	// Only while the job's record lives: a record that passed its
	// retention since it was read names no job, and a claim must not
	// make one (an in-flight record with no job in it, for anyone who
	// reads the key meanwhile).
	opts := []etcdstore.RunOption{storex.WithoutCreate()}
	if k.Deadline > 0 {
		opts = append(opts, etcdstore.WithDeadline(k.Deadline))
	}
	var held []heldSlot // limits' slots the attempt took: freed once its claim ends
	res, err := w.q.recs.Run(ctx, w.q.Key(id), fp, func(ctx context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		return w.attempt(ctx, c, k, &held)
	}, opts...)
	w.release(held)
	if err == nil && res.Replayed {
		// The claim found the job ended. It may have (another worker
		// ended it since it was read), or the store answered from a
		// record deleted since (a job replaced after its DedupWindow, read
		// from a cache behind etcd): never a run of the job that was seen
		// queued. Whoever tries it looks again.
		return fmt.Errorf("job %s: %w", id, errReplayed)
	}
	return err
}

// errReplayed is execute's answer when the claim replayed an ended job
// instead of running the one it was asked to: not a run.
var errReplayed = errors.New("the claim found the job ended: not run")

// attempt runs one attempt of a claimed job: every unfinished step in
// order, each finished by a fenced checkpoint, and says how the claim ends.
func (w *Worker) attempt(ctx context.Context, c *etcdstore.Claim, k *Kind, held *[]heldSlot) (etcdstore.Outcome, etcdstore.End) {
	// (Never a fresh claim: execute claims WithoutCreate.)
	st, err := decodeState(c.LastCheckpoint())
	if err != nil || st.Kind != k.Name {
		// Not a job of this kind (a newer format, or damage): never run
		// it, never rewrite it.
		w.log.Error("idem: not running a job whose state this worker cannot read", "job", c.Key().Digest(), "err", err)
		return etcdstore.Outcome{}, etcdstore.EndAbandon
	}
	n := c.Takeovers() - st.Base
	switch {
	case st.Parked || st.NotBefore > w.q.clock.Now().UnixMilli() && st.Limited == "" && !w.q.eventCame(ctx, storex.StoreOf(c), st.Awaiting, c.Key().ID, c.Created()):
		// (A job held back by a limit is tried whenever it is claimed:
		// its workers claim it when a slot frees.)
		return w.giveBack(ctx, c, st) // not this attempt's to run now
	case n > k.MaxAttempts:
		st.addError(w.errorOf(c, n, "", fmt.Errorf("attempt %d of %d: a previous attempt ended without saying why (its worker died or was cut off)", n, k.MaxAttempts)))
		return w.park(ctx, c, st, n)
	}
	if out, end, ok := w.limit(ctx, c, st, k, held); !ok {
		return out, end
	}
	// Whatever held it back (a wait, a backoff) is over: this attempt
	// runs. A wait it reaches again sets them anew; a failure, its backoff.
	st.NotBefore, st.Awaiting, st.Limited = 0, "", ""
	st.Steps = st.Steps[:0]
	for _, s := range k.Steps {
		st.Steps = append(st.Steps, s.Name)
	}
	if st.Compensating {
		return w.compensate(ctx, c, st, k, n)
	}
	// unsaved: the last step finished in this attempt without ops, and its
	// output is saved only with the job's end (no checkpoint of its own).
	unsaved := false
	var lastWaits []wait // the last step's waits, should its end not fit
	for i := range k.Steps {
		step := &k.Steps[i]
		if st.finished(step.Name) != nil {
			continue // finished by an earlier attempt: never again
		}
		if ctx.Err() != nil {
			return w.interrupted(ctx, c, st)
		}
		r := &Run{claim: c, tenant: w.q.tenant, st: st, step: step.Name, attempt: n, q: w.q, ctx: ctx}
		out, err := callStep(ctx, step, r)
		if r.suspend != nil {
			return w.suspended(ctx, c, st, r.suspend, r.retry)
		}
		if out, end, ok := w.remoteEnd(ctx, c, st, err); ok {
			return out, end
		}
		if err != nil {
			return w.stepFailed(ctx, c, st, k, step, n, err)
		}
		waits := st.Waits
		st.Waits = slices.DeleteFunc(slices.Clone(st.Waits), func(wt wait) bool { return wt.Step == step.Name })
		if len(st.Waits) == 0 {
			st.Waits = nil
		}
		st.Done = append(st.Done, doneStep{Name: step.Name, Token: int64(c.Token()), At: w.q.clock.Now().UnixMilli(), Output: out})
		if i == len(k.Steps)-1 {
			if len(r.ops) == 0 {
				unsaved, lastWaits = true, waits
				break // the job's end saves it
			}
			// Its ops commit with this checkpoint, and then the step is
			// never run again: the job's end must fit before they do.
			end := st.clone()
			end.Outcome = Succeeded
			if size, ok := fits(end, "", w.q.maxRecord()); !ok {
				st.Done, st.Waits = st.Done[:len(st.Done)-1], waits
				return w.stepFailed(ctx, c, st, k, step, n, fmt.Errorf("its checkpoint was refused: %w: the job's end would be %d bytes, limit %d",
					etcdstore.ErrTooLarge, size, w.q.maxRecord()))
			}
		}
		if err := checkpoint(ctx, w.q.clock, c, st.encode(), r.ops); err != nil {
			st.Done, st.Waits = st.Done[:len(st.Done)-1], waits
			if refused(err) {
				// Its output outgrew the record, or its ops are not
				// allowed: a failure of the step.
				return w.stepFailed(ctx, c, st, k, step, n, fmt.Errorf("its checkpoint was refused: %w", err))
			}
			return w.notSaved(c, step, err)
		}
	}
	st.Outcome, st.Waits, st.Awaiting = Succeeded, nil, ""
	last := &k.Steps[len(k.Steps)-1]
	// A step whose checkpoint landed (in this attempt, with its ops, or in
	// an earlier one) is finished, whatever its size: every output may be
	// cut. One whose output only the end saves keeps it, and fails if the
	// end cannot fit with it.
	cuttable := len(st.Done)
	if unsaved {
		cuttable--
	}
	saved := st.clone()
	out, ok := fit(st, "", w.q.maxRecord(), cuttable)
	if !ok && unsaved {
		// The last step's output outgrew the record: a failure of that
		// step, as its checkpoint's refusal would be.
		*st = *saved
		st.Outcome = ""
		st.Done = st.Done[:len(st.Done)-1]
		st.Waits = slices.Clone(lastWaits)
		return w.stepFailed(ctx, c, st, k, last, n, fmt.Errorf("its checkpoint was refused: %w: the job's state would be %d bytes, limit %d",
			etcdstore.ErrTooLarge, len(saved.encode()), w.q.maxRecord()))
	}
	if len(st.Truncated) > 0 {
		w.log.Warn("idem: a job's end was cut to fit the record", "job", c.Key().Digest(), "cut", st.Truncated)
	}
	w.log.Debug("idem: job succeeded", "job", c.Key().Digest(), "attempt", n, "token", c.Token())
	return out, etcdstore.EndSave
}

// end saves a job that ended (failed, compensated, or too large to keep)
// within the record's limit: see fit. A state that cannot fit even so
// (its parameters alone fill the record) ends with its error alone.
func (w *Worker) end(c *etcdstore.Claim, st *state, errText string) (etcdstore.Outcome, etcdstore.End) {
	st.Waits, st.Awaiting = nil, ""
	out, ok := fit(st, errText, w.q.maxRecord(), len(st.Done))
	if len(st.Truncated) > 0 {
		w.log.Warn("idem: a job's end was cut to fit the record", "job", c.Key().Digest(), "cut", st.Truncated)
	}
	if !ok {
		w.log.Error("idem: a job's end does not fit the record even cut", "job", c.Key().Digest())
	}
	return out, etcdstore.EndSave
}

// callStep runs a step, turning a panic into its error: the step may have
// acted before it panicked, so its policy decides what happens next.
func callStep(ctx context.Context, step *Step, r *Run) (out []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("step %s panicked: %v", step.Name, v)
		}
	}()
	return step.Run(ctx, r)
}

func callCompensate(ctx context.Context, step *Step, r *Run) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("compensation of step %s panicked: %v", step.Name, v)
		}
	}()
	return step.Compensate(ctx, r)
}

// remoteEnd ends an attempt whose step ran on a remote worker (Hub) that
// did not finish it: a worker that went silent ends the attempt as a
// crashed worker does (abandoned; the next claim counts it), and a step
// no worker took gives the job back uncounted. ok is false for any other
// error: the step's policy decides.
func (w *Worker) remoteEnd(ctx context.Context, c *etcdstore.Claim, st *state, err error) (etcdstore.Outcome, etcdstore.End, bool) {
	switch {
	case errors.Is(err, errWorkerLost):
		return etcdstore.Outcome{}, etcdstore.EndAbandon, true
	case errors.Is(err, errNoTaker):
		out, end := w.giveBack(ctx, c, st)
		return out, end, true
	}
	return etcdstore.Outcome{}, 0, false
}

// stepFailed ends an attempt whose step returned err, as the step's
// policy says.
func (w *Worker) stepFailed(ctx context.Context, c *etcdstore.Claim, st *state, k *Kind, step *Step, n int, err error) (etcdstore.Outcome, etcdstore.End) {
	if ctx.Err() != nil {
		return w.interrupted(ctx, c, st)
	}
	st.addError(w.errorOf(c, n, step.Name, err))
	switch step.OnError {
	case Fail:
		st.Outcome = Failed
		w.log.Info("idem: job failed", "job", c.Key().Digest(), "step", step.Name, "err", err)
		return w.end(c, st, fmt.Sprintf("step %s: %v", step.Name, err))
	case Compensate:
		st.Compensating, st.Failure = true, fmt.Sprintf("step %s: %v", step.Name, err)
		if err := checkpoint(ctx, w.q.clock, c, st.encode(), nil); err != nil {
			// Not saved: the next attempt runs the failed step again,
			// and compensates if it fails again.
			return etcdstore.Outcome{}, etcdstore.EndAbandon
		}
		return w.compensate(ctx, c, st, k, n)
	}
	return w.retryLater(ctx, c, st, k, n)
}

// compensate undoes the job's finished steps, last first, then ends it as
// failed.
func (w *Worker) compensate(ctx context.Context, c *etcdstore.Claim, st *state, k *Kind, n int) (etcdstore.Outcome, etcdstore.End) {
	for i := len(st.Done) - 1; i >= 0; i-- {
		d := &st.Done[i]
		step := k.step(d.Name)
		if d.Compensated || step == nil || step.Compensate == nil {
			continue
		}
		r := &Run{claim: c, tenant: w.q.tenant, st: st, step: d.Name, attempt: n, compensating: true, q: w.q, ctx: ctx}
		if err := callCompensate(ctx, step, r); err != nil {
			if ctx.Err() != nil {
				return w.interrupted(ctx, c, st)
			}
			if out, end, ok := w.remoteEnd(ctx, c, st, err); ok {
				return out, end
			}
			st.addError(w.errorOf(c, n, d.Name, fmt.Errorf("compensating: %w", err)))
			return w.retryLater(ctx, c, st, k, n)
		}
		d.Compensated = true
		if err := checkpoint(ctx, w.q.clock, c, st.encode(), r.ops); err != nil {
			d.Compensated = false
			if refused(err) {
				st.addError(w.errorOf(c, n, d.Name, fmt.Errorf("compensating: its checkpoint was refused: %w", err)))
				return w.retryLater(ctx, c, st, k, n)
			}
			return w.notSaved(c, step, err)
		}
	}
	st.Outcome = Failed
	w.log.Info("idem: job failed and compensated", "job", c.Key().Digest(), "failure", st.Failure)
	return w.end(c, st, st.Failure)
}

func (k *Kind) step(name string) *Step {
	for i := range k.Steps {
		if k.Steps[i].Name == name {
			return &k.Steps[i]
		}
	}
	return nil
}

// retryLater ends a failed attempt: the job waits for its backoff, or is
// parked once it has had its attempts.
func (w *Worker) retryLater(ctx context.Context, c *etcdstore.Claim, st *state, k *Kind, n int) (etcdstore.Outcome, etcdstore.End) {
	if n >= k.MaxAttempts {
		return w.park(ctx, c, st, n)
	}
	st.NotBefore = w.q.clock.Now().Add(k.backoff(n, jitter(c.Key(), n))).UnixMilli()
	return w.keep(ctx, c, st) // not saved: retried at once, one attempt counted all the same
}

// park gives the job up until an operator retries or cancels it.
func (w *Worker) park(ctx context.Context, c *etcdstore.Claim, st *state, n int) (etcdstore.Outcome, etcdstore.End) {
	st.Parked, st.NotBefore = true, 0
	w.log.Warn("idem: job parked after its last attempt", "job", c.Key().Digest(), "attempts", n, "err", st.lastError())
	return w.keep(ctx, c, st) // not saved: the next attempt finds the count past the limit and parks it
}

// suspended gives back a job one of whose steps waits (Run.Sleep,
// Run.Await): the wait is saved with it, and NotBefore holds it until the
// wait ends (a sleep's end, an await's timeout; an event that comes ends an
// await sooner). The attempt is not counted: it did not fail.
func (w *Worker) suspended(ctx context.Context, c *etcdstore.Claim, st *state, wt *wait, retry time.Time) (etcdstore.Outcome, etcdstore.End) {
	st.NotBefore, st.Awaiting = wt.Until, wt.Event
	if !retry.IsZero() && retry.UnixMilli() < wt.Until {
		// The store could not be read or written for the wait: look again
		// soon (the event may be there), not only at its timeout.
		st.NotBefore, st.Awaiting = ceilMilli(retry), ""
	}
	w.log.Debug("idem: job waits", "job", c.Key().Digest(), "step", wt.Step, "event", wt.Event, "until", time.UnixMilli(wt.Until))
	return w.giveBack(ctx, c, st)
}

// giveBack ends a claim that ran nothing: the job is abandoned as it was,
// and the takeover that claimed it is not counted as an attempt.
func (w *Worker) giveBack(ctx context.Context, c *etcdstore.Claim, st *state) (etcdstore.Outcome, etcdstore.End) {
	st.Base++
	return w.keep(ctx, c, st) // not saved: one attempt too many counted, which is safe
}

// keep saves st and abandons the claim, for the next attempt (or an
// operator) to find. A state refused for its size (its errors grew it past
// the record's limit) is saved with its errors cut to the last one; one
// refused even so ends the job as failed, with the outputs left out,
// rather than leave it to be retried without its backoff, or never parked.
func (w *Worker) keep(ctx context.Context, c *etcdstore.Claim, st *state) (etcdstore.Outcome, etcdstore.End) {
	err := checkpoint(ctx, w.q.clock, c, st.encode(), nil)
	if refused(err) && len(st.Errors) > 1 {
		st.Errors = st.Errors[len(st.Errors)-1:]
		err = checkpoint(ctx, w.q.clock, c, st.encode(), nil)
	}
	if !refused(err) {
		return etcdstore.Outcome{}, etcdstore.EndAbandon
	}
	for i := range st.Done {
		st.Done[i].Output = nil
	}
	st.Outcome, st.Parked, st.NotBefore = Failed, false, 0
	msg := fmt.Sprintf("the job's state is too large to save (%v); last error: %s", err, st.lastError())
	w.log.Error("idem: job failed: its state outgrew the record", "job", c.Key().Digest(), "err", err)
	return w.end(c, st, msg)
}

// interrupted ends an attempt whose context ended: its claim was lost
// (session, deadline), or the worker is closing, when the attempt is given
// back uncounted. An attempt past its kind's Deadline records so, for the
// next one (which another worker may be running already: fenced, the
// record stays theirs).
func (w *Worker) interrupted(ctx context.Context, c *etcdstore.Claim, st *state) (etcdstore.Outcome, etcdstore.End) {
	switch cause := context.Cause(ctx); {
	case errors.Is(cause, errClosing) && c.Err() == nil:
		return w.giveBack(ctx, c, st)
	case errors.Is(cause, etcdstore.ErrDeadline):
		st.addError(w.errorOf(c, c.Takeovers()-st.Base, "", fmt.Errorf("the attempt passed its deadline")))
		return w.keep(ctx, c, st)
	}
	return etcdstore.Outcome{}, etcdstore.EndAbandon
}

// notSaved ends an attempt whose step ran but whose checkpoint did not
// land: fenced (the job is another's now), or etcd did not answer (the next
// attempt runs the step again).
func (w *Worker) notSaved(c *etcdstore.Claim, step *Step, err error) (etcdstore.Outcome, etcdstore.End) {
	w.log.Info("idem: a job's checkpoint was not saved; the next attempt resumes before it", "job", c.Key().Digest(), "step", step.Name, "err", err)
	return etcdstore.Outcome{}, etcdstore.EndAbandon
}

// refused reports whether a checkpoint was refused for what it held, not
// for etcd's or the claim's state: a retry would be refused again.
func refused(err error) bool {
	return errors.Is(err, etcdstore.ErrTooLarge) || errors.Is(err, etcdstore.ErrInvalidArgument)
}

func (w *Worker) errorOf(c *etcdstore.Claim, n int, step string, err error) attemptError {
	return attemptError{Attempt: n, Token: int64(c.Token()), Step: step, Err: err.Error(), At: w.q.clock.Now().UnixMilli()}
}

// checkpoint saves a job's state (and ops) as the claim's recovery point,
// retrying while etcd's answer is unknown: a retry recognises a write that
// landed, so the ops apply once. It goes on after the step's context
// ended: what the step did must be recorded if the claim still holds. It
// stops once the claim is lost.
func checkpoint(ctx context.Context, clk clock.Clock, c *etcdstore.Claim, data []byte, ops []clientv3.Op) error {
	ctx = context.WithoutCancel(ctx)
	var err error
	for try := 0; try < 8; try++ {
		if err = c.Checkpoint(ctx, data, ops...); err == nil || !errors.Is(err, etcdstore.ErrUnavailable) || c.Err() != nil {
			return err
		}
		clock.Sleep(clk, ctx, time.Duration(50<<min(try, 5))*time.Millisecond)
	}
	return err
}

// jitter spreads the retries of jobs that failed together: a fraction in
// [0, 1) drawn from the job's key and attempt, so that a replayed run
// (package explore's simulations) retries at the same times.
func jitter(k etcdstore.Key, n int) float64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d", k, n)
	return float64(h.Sum64()>>11) / (1 << 53)
}
