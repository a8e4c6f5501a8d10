package jobs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// DEFECT. docs/JOBS.md, "Submitting from anywhere": past its dedup window, a
// submit of the id "replaces a job that has ended with a new one". An event
// belongs to a job ("delivers event name ... to job id"). But events are kept
// under e/<tenant>/<id>/<event>, which replacing the job (EvictIf) does not
// touch: the new job's Await returns the OLD job's payload without anyone
// signalling it, and a signal meant for the new job is refused with
// ErrSignalMismatch (409 signal-mismatch over HTTP, "never retry").
func TestReviewDedupWindowNewJobInheritsTheOldJobsEvent(t *testing.T) {
	ctx := testCtx(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	s := newStore(t, testPrefix(t), etcdstore.WithClock(fc.view(0)))
	q := newQueue(t, s)
	k := Kind{Name: "refund", Steps: []Step{AwaitStep("approval", "approved", 0, Fail)}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))

	if _, err := q.Submit(ctx, "r-1", "refund", []byte(`1`), DedupWindow(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := q.Signal(ctx, "r-1", "approved", []byte(`"ada"`)); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "r-1"); err != nil || j.State != Succeeded || string(j.Output("approval")) != `"ada"` {
		t.Fatalf("first job = %+v, %v; want succeeded with ada's approval", j, err)
	}

	fc.set(t0.Add(time.Hour)) // past the window: the id names a new job
	second, err := q.Submit(ctx, "r-1", "refund", []byte(`2`), DedupWindow(time.Hour))
	if err != nil || second.State != Queued || string(second.Params) != "2" {
		t.Fatalf("Submit past the window = %+v, %v; want a new queued job", second, err)
	}
	// Nobody approved the new refund: it must wait.
	j, err := w.Run(ctx, "r-1")
	if err != nil {
		t.Fatal(err)
	}
	if j.State != Waiting {
		t.Errorf("the new job, never signalled, is %s with approval %q; want it waiting for its own approval (it got the replaced job's event)",
			j.State, j.Output("approval"))
	}
	// Ask with a fresh job to see the signal side without the worker's
	// consumption muddying it.
	fc.set(t0.Add(3 * time.Hour))
	if _, err := q.Submit(ctx, "r-1", "refund", []byte(`3`), DedupWindow(time.Hour)); err != nil {
		t.Fatalf("third submit: %v", err)
	}
	if err := q.Signal(ctx, "r-1", "approved", []byte(`"bob"`)); err != nil {
		t.Errorf("Signal of the new job's first event = %v; want nil (the job was never signalled)", err)
	}
}

// DEFECT. docs/JOBS.md "What a step's error does": Retry "ends the attempt:
// the job is retried after a backoff". A job woken because its awaited event
// came, whose step then fails before reaching its Await (code before a wait
// runs again, as documented), keeps Awaiting set: retryLater sets NotBefore
// but not Awaiting = "", so the job reads as "waiting" (not "scheduled"), and
// the completer (when(): the event came) and attempt() (eventCame) both skip
// the backoff. All attempts burn at once, on a clock that never moved, and
// the job is parked.
// Cause: worker.go retryLater/keep leave st.Awaiting (set by suspended) in
// place; completer.go when() "e.awaiting != "" && c.events[...]" -> now;
// worker.go attempt "st.NotBefore > now && !eventCame(...)".
func TestReviewRetryAfterWakeIgnoresBackoff(t *testing.T) {
	ctx := testCtx(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(fc.view(0))
	var runs atomic.Int32
	k := Kind{Name: "k", MaxAttempts: 3, Backoff: time.Hour, Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		if runs.Add(1) > 1 {
			return nil, errors.New("downstream 503") // transient, before the wait
		}
		_, err := r.Await("go", 0)
		return nil, err
	}}}}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	if _, err := q.Submit(ctx, "b-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, q, "b-1", func(j *Job) bool { return j.State == Waiting })
	if err := q.Signal(ctx, "b-1", "go", []byte(`1`)); err != nil {
		t.Fatal(err)
	}
	// The clock never moves: after the failure the job must sit out its
	// 1 h backoff, scheduled.
	j := waitUntil(t, q, "b-1", func(j *Job) bool {
		return j.State == Parked || j.State == Scheduled && len(j.Errors) > 0
	})
	if j.State != Scheduled || runs.Load() != 2 {
		t.Fatalf("after one failed retry the job is %s (awaiting %q) after %d runs of its step, with the clock still at %v; want scheduled for %v, 2 runs",
			j.State, j.Awaiting, runs.Load(), t0, t0.Add(time.Hour))
	}
}

// DEFECT. docs/JOBS.md: "A compensation cannot wait" (reach() returns
// ErrInvalid for it). But Run.Sleep/SleepUntil/Await dereference r.q
// (r.now(), r.q.store.Retention()) before reach() checks r.compensating, and
// compensate() builds its Run without q (worker.go compensate: Run{...,
// compensating: true} has no q, ctx): the compensation panics with a nil
// pointer instead of getting ErrInvalid. A compensation that handles the
// documented error cannot: it is retried until parked.
// Cause: kind.go Run.Sleep "r.sleep(r.now().Add(d), d)" and Run.Await
// "r.q.store.Retention()" before r.reach; worker.go compensate's Run literal.
func TestReviewCompensationThatTriesToWaitGetsErrInvalid(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	var mu sync.Mutex
	var seen []string
	k := Kind{Name: "saga", MaxAttempts: 2, Backoff: time.Millisecond, Steps: []Step{
		{Name: "book", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil },
			Compensate: func(ctx context.Context, r *Run) error {
				err := r.Sleep(time.Minute)
				_, aerr := r.Await("x", time.Minute)
				mu.Lock()
				seen = append(seen, fmt.Sprint(err), fmt.Sprint(aerr))
				mu.Unlock()
				if !errors.Is(err, ErrInvalid) || !errors.Is(aerr, ErrInvalid) {
					return fmt.Errorf("Sleep = %v, Await = %v; want ErrInvalid", err, aerr)
				}
				return nil
			}},
		{Name: "pay", OnError: Compensate, Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, errors.New("card refused") }},
	}}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	if _, err := q.Submit(ctx, "c-1", "saga", nil); err != nil {
		t.Fatal(err)
	}
	j := waitJob(t, q, "c-1")
	if j.State != Failed || !j.Steps[0].Compensated {
		t.Fatalf("job %s (err %q, errors %+v); want failed and compensated, the compensation having been told ErrInvalid (it saw %q)",
			j.State, j.Err, j.Errors, seen)
	}
}

// Regression (passes): a step that calls Sleep twice sleeps both, in order,
// once each; what runs before the first sleep runs three times, and the two
// sleeps add up on one clock.
func TestReviewTwoSleepsInOneStep(t *testing.T) {
	ctx := testCtx(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(fc.view(0))
	var runs atomic.Int32
	var doneAt time.Time
	k := Kind{Name: "k", Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		runs.Add(1)
		if err := r.Sleep(time.Hour); err != nil {
			return nil, err
		}
		if err := r.Sleep(2 * time.Hour); err != nil {
			return nil, err
		}
		doneAt = q.clock.Now()
		return []byte(`"ok"`), nil
	}}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "s-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		at   time.Duration
		want State
	}{{0, Scheduled}, {time.Hour - time.Millisecond, Scheduled}, {time.Hour, Scheduled}, {3*time.Hour - time.Millisecond, Scheduled}, {3 * time.Hour, Succeeded}} {
		fc.set(t0.Add(c.at))
		j, err := w.Run(ctx, "s-1")
		if err != nil || j.State != c.want {
			t.Fatalf("Run at +%v = %+v, %v; want %s", c.at, j, err, c.want)
		}
	}
	if runs.Load() != 3 || !doneAt.Equal(t0.Add(3*time.Hour)) {
		t.Fatalf("step ran %d times, finished at %v; want 3 runs, finished at %v", runs.Load(), doneAt, t0.Add(3*time.Hour))
	}
}

// Regression (passes): a step that swallows ErrSuspended and returns an
// output is suspended anyway (its output is not saved), and a second wait
// after the swallowed one is ErrNondeterministic, not a second wait.
func TestReviewStepSwallowingErrSuspended(t *testing.T) {
	ctx := testCtx(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(fc.view(0))
	var second error
	k := Kind{Name: "k", Steps: []Step{{Name: "last", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		_ = r.Sleep(time.Hour) // swallowed
		if fc.view(0).Now().Equal(t0) {
			_, second = r.Await("x", time.Minute)
		}
		return []byte(`"too early"`), nil
	}}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "w-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "w-1"); err != nil || j.State != Scheduled || j.Output("last") != nil {
		t.Fatalf("Run = %+v, %v; want it asleep, nothing saved", j, err)
	}
	if !errors.Is(second, ErrNondeterministic) {
		t.Fatalf("a wait after a swallowed ErrSuspended = %v; want ErrNondeterministic", second)
	}
	fc.set(t0.Add(time.Hour))
	if j, err := w.Run(ctx, "w-1"); err != nil || j.State != Succeeded || j.Attempts != 1 {
		t.Fatalf("Run after the sleep = %+v, %v; want succeeded in one attempt", j, err)
	}
}

// Regression (passes): two Awaits of the same event in one step both return
// its one payload; the event was signalled once.
func TestReviewTwoAwaitsOfOneEvent(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	k := Kind{Name: "k", Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		a, err := r.Await("go", 0)
		if err != nil {
			return nil, err
		}
		b, err := r.Await("go", 0)
		if err != nil {
			return nil, err
		}
		return []byte(fmt.Sprintf("[%s,%s]", a, b)), nil
	}}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "e-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "e-1"); err != nil || j.State != Waiting || j.Awaiting != "go" {
		t.Fatalf("Run = %+v, %v; want waiting for go", j, err)
	}
	if err := q.Signal(ctx, "e-1", "go", []byte(`7`)); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "e-1"); err != nil || j.State != Succeeded || string(j.Output("s")) != "[7,7]" {
		t.Fatalf("Run after the signal = %+v, %v; want succeeded with [7,7]", j, err)
	}
}

// Regression (passes): a wait in the LAST step, whose output is saved only
// with the job's end: a worker whose session dies after the await decided
// (checkpointed) but before the end leaves the next worker the same payload,
// never a timeout, even once the timeout passed.
func TestReviewLastStepAwaitTakenOverAfterDecision(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	sa := newStore(t, prefix)
	qa := newQueue(t, sa)
	qa.setClock(fc.view(0))
	entered := make(chan struct{})
	block := make(chan struct{})
	defer close(block)
	var once sync.Once
	k := func(stall bool) Kind {
		return Kind{Name: "k", Steps: []Step{{Name: "last", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) {
			p, err := r.Await("go", time.Minute)
			if err != nil {
				return nil, err
			}
			if stall {
				once.Do(func() { close(entered) })
				select {
				case <-block:
				case <-ctx.Done():
				}
				return nil, ctx.Err()
			}
			return p, nil
		}}}}
	}
	wa := newWorker(t, qa, []Kind{k(true)}, Concurrency(0))
	if _, err := qa.Submit(ctx, "l-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	if j, err := wa.Run(ctx, "l-1"); err != nil || j.State != Waiting {
		t.Fatalf("Run = %+v, %v", j, err)
	}
	if err := qa.Signal(ctx, "l-1", "go", []byte(`"yes"`)); err != nil {
		t.Fatal(err)
	}
	go wa.Run(context.Background(), "l-1")
	<-entered
	endSession(t, sa) // the worker dies after its await decided
	fc.set(t0.Add(time.Hour))
	qb := newQueue(t, newStore(t, prefix))
	qb.setClock(fc.view(0))
	newWorker(t, qb, []Kind{k(false)}, Concurrency(1))
	j := waitJob(t, qb, "l-1")
	if j.State != Succeeded || string(j.Output("last")) != `"yes"` {
		t.Fatalf("job %+v; want succeeded with the payload the first worker received", j)
	}
}

// Regression (passes): a waiting job can be cancelled; a signal then is
// ErrFinal and writes nothing.
func TestReviewCancelWaitingThenSignal(t *testing.T) {
	ctx := testCtx(t)
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	k := Kind{Name: "k", Steps: []Step{AwaitStep("a", "go", 0, Fail)}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "x-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "x-1"); err != nil || j.State != Waiting {
		t.Fatalf("Run = %+v, %v", j, err)
	}
	if j, err := q.Cancel(ctx, "x-1", "no longer"); err != nil || j.State != Cancelled {
		t.Fatalf("Cancel of a waiting job = %+v, %v", j, err)
	}
	if err := q.Signal(ctx, "x-1", "go", nil); !errors.Is(err, ErrFinal) {
		t.Fatalf("Signal after Cancel = %v; want ErrFinal", err)
	}
	if vs, err := s.Values(ctx, eventPrefix(q.tenant)); err != nil || len(vs) != 0 {
		t.Fatalf("events: %v, %v; want none", vs, err)
	}
}
