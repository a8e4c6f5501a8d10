package jobs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// threeSteps is a kind whose steps each apply an effect at sink, and whose
// second step reads the first's output.
func threeSteps(name string, sk *sink, hooks map[string]func(ctx context.Context, r *Run) error) Kind {
	step := func(n string) Step {
		return Step{Name: n, Run: func(ctx context.Context, r *Run) ([]byte, error) {
			if h := hooks[n]; h != nil {
				if err := h(ctx, r); err != nil {
					return nil, err
				}
			}
			if err := sk.apply(r); err != nil {
				return nil, err
			}
			return []byte(n + " of " + r.Key().ID), nil
		}}
	}
	return Kind{Name: name, Steps: []Step{step("reserve"), step("charge"), step("ship")}, Backoff: 10 * time.Millisecond}
}

// A job's steps run once each, in order, with the outputs of earlier
// steps; running it again (or submitting it again) runs nothing.
func TestStepsRunOnceInOrder(t *testing.T) {
	ctx := testCtx(t)
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	sk := newSink()
	var order []string
	var mu sync.Mutex
	k := threeSteps("order", sk, map[string]func(context.Context, *Run) error{
		"reserve": func(ctx context.Context, r *Run) error {
			mu.Lock()
			order = append(order, "reserve")
			mu.Unlock()
			return nil
		},
		"charge": func(ctx context.Context, r *Run) error {
			mu.Lock()
			order = append(order, "charge")
			mu.Unlock()
			if got := string(r.Output("reserve")); got != "reserve of o-1" {
				return fmt.Errorf("charge sees reserve's output %q", got)
			}
			return nil
		},
		"ship": func(ctx context.Context, r *Run) error {
			mu.Lock()
			order = append(order, "ship")
			mu.Unlock()
			return nil
		},
	})
	w := newWorker(t, q, []Kind{k}, Concurrency(0))

	j, err := q.Submit(ctx, "o-1", "order", []byte(`{"amount":100}`))
	if err != nil || j.State != Queued || j.Attempts != 0 || string(j.Params) != `{"amount":100}` {
		t.Fatalf("Submit = %+v, %v; want queued with its params", j, err)
	}
	j, err = w.Run(ctx, "o-1")
	if err != nil {
		t.Fatal(err)
	}
	if j.State != Succeeded || j.Attempts != 1 || len(j.Steps) != 3 {
		t.Fatalf("after Run: %+v; want succeeded in 1 attempt with 3 steps", j)
	}
	if got := strings.Join(order, ","); got != "reserve,charge,ship" {
		t.Fatalf("steps ran %s; want reserve,charge,ship", got)
	}
	for _, st := range j.Steps {
		if !st.Finished || st.Token != j.Steps[0].Token || string(st.Output) != st.Name+" of o-1" {
			t.Fatalf("step %+v; want finished by one token with its output", st)
		}
	}
	again, err := w.Run(ctx, "o-1")
	if err != nil || again.State != Succeeded {
		t.Fatalf("Run again = %+v, %v", again, err)
	}
	if sub, err := q.Submit(ctx, "o-1", "order", []byte(` { "amount" : 100 } `)); err != nil || sub.State != Succeeded {
		t.Fatalf("Submit again (same params, other spelling) = %+v, %v; want the succeeded job", sub, err)
	}
	if _, err := q.Submit(ctx, "o-1", "order", []byte(`{"amount":200}`)); !errors.Is(err, etcdstore.ErrMismatch) {
		t.Fatalf("Submit with other params = %v; want ErrMismatch", err)
	}
	if len(order) != 3 {
		t.Fatalf("steps ran %d times in all; want 3", len(order))
	}
}

// The completer of a worker runs submitted jobs without anyone asking, and
// only jobs of the kinds it registered.
func TestCompleterRunsSubmittedJobs(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	sk := newSink()
	newWorker(t, newQueue(t, newStore(t, prefix)), []Kind{threeSteps("order", sk, nil)}, Concurrency(3))
	newWorker(t, newQueue(t, newStore(t, prefix)), []Kind{threeSteps("order", sk, nil)}, Concurrency(3))
	const n = 20
	for i := range n {
		if _, err := q.Submit(ctx, fmt.Sprintf("o-%d", i), "order", nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := q.Submit(ctx, "other", "refund", nil); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		j := waitJob(t, q, fmt.Sprintf("o-%d", i))
		if j.State != Succeeded || j.Attempts != 1 {
			t.Fatalf("job %s: %s after %d attempts; want succeeded in 1", j.Key.ID, j.State, j.Attempts)
		}
		for _, step := range []string{"reserve", "charge", "ship"} {
			key := fmt.Sprintf("jobs:o-%d.%s", i, step)
			if applied, calls := sk.count(key); applied != 1 || calls != 1 {
				t.Fatalf("%s: applied %d, called %d times; want once", key, applied, calls)
			}
		}
	}
	if j, err := q.Get(ctx, "other"); err != nil || j.State != Queued {
		t.Fatalf("job of an unregistered kind: %+v, %v; want left queued", j, err)
	}
}

// A worker that dies mid-step (its session ends) is taken over by another
// worker's completer, found by the owner key's deletion: the new worker
// resumes at the unfinished step with a greater token and never runs the
// finished one again; the old worker, when it wakes, is fenced everywhere.
func TestTakeoverResumesAtTheUnfinishedStep(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	sk := newSink()
	sa := newStore(t, prefix)
	entered, release := make(chan struct{}), make(chan struct{})
	slow := threeSteps("order", sk, map[string]func(context.Context, *Run) error{
		"charge": func(ctx context.Context, r *Run) error {
			if r.Attempt() == 1 {
				close(entered)
				<-release // a worker paused mid-step: it does not notice its claim is lost
			}
			return nil
		},
	})
	qa := newQueue(t, sa)
	wa := newWorker(t, qa, []Kind{slow}, Concurrency(0))
	if _, err := qa.Submit(ctx, "o-1", "order", nil); err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() {
		_, err := wa.Run(ctx, "o-1")
		ran <- err
	}()
	<-entered
	// The other worker runs a completer; the paused one's session ends.
	qb := newQueue(t, newStore(t, prefix))
	newWorker(t, qb, []Kind{threeSteps("order", sk, nil)}, Concurrency(2))
	endSession(t, sa)
	j := waitJob(t, qb, "o-1")
	if j.State != Succeeded || j.Attempts != 2 {
		t.Fatalf("job %+v; want succeeded on attempt 2", j)
	}
	first, second := j.Steps[0].Token, j.Steps[1].Token
	if second <= first || j.Steps[2].Token != second {
		t.Fatalf("step tokens %d, %d, %d; want reserve by the first attempt, charge and ship by a greater token", first, second, j.Steps[2].Token)
	}
	if applied, calls := sk.count("jobs:o-1.reserve"); applied != 1 || calls != 1 {
		t.Fatalf("reserve applied %d, called %d times; want once: a finished step is never run again", applied, calls)
	}
	close(release) // the paused worker wakes and calls the sink late
	<-ran          // the old worker's attempt ends, fenced
	toks := sk.tokens("jobs:o-1.charge")
	if len(toks) != 2 || toks[0] != second || toks[1] != first {
		t.Fatalf("charge called with tokens %v; want the new worker's %d then the old one's %d (late)", toks, second, first)
	}
	if applied, _ := sk.count("jobs:o-1.charge"); applied != 1 {
		t.Fatalf("charge applied %d times; want once", applied)
	}
	if sk.refused != 1 {
		t.Fatalf("the sink refused %d late calls; want the old worker's one", sk.refused)
	}
	if j2, err := qb.Get(ctx, "o-1"); err != nil || j2.State != Succeeded || j2.Token != j.Token {
		t.Fatalf("after the old worker woke: %+v, %v; want the job as the new worker left it", j2, err)
	}
}

// A step's etcd effect commits with its checkpoint, exactly once, even when
// the checkpoint's reply is lost and the write retried.
func TestCommitIsExactlyOnce(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	s := newStoreOn(t, cli, prefix)
	q := newQueue(t, s)
	effects := "/effects" + prefix
	k := Kind{Name: "ledger", Steps: []Step{
		{Name: "debit", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			r.Commit(clientv3.OpPut(effects+r.Key().ID+"/debit", "-100"))
			lose.Store(1) // the checkpoint that commits it loses its reply
			return nil, nil
		}},
		{Name: "credit", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			r.Commit(clientv3.OpPut(effects+r.Key().ID+"/credit", "+100"))
			return nil, nil
		}},
	}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "tx-1", "ledger", nil); err != nil {
		t.Fatal(err)
	}
	j, err := w.Run(ctx, "tx-1")
	if err != nil || j.State != Succeeded {
		t.Fatalf("Run = %+v, %v", j, err)
	}
	if lose.Load() != 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	for _, e := range []string{"debit", "credit"} {
		resp, err := cluster.MustClient(t).Get(ctx, effects+"tx-1/"+e)
		if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Version != 1 {
			t.Fatalf("%s effect: %v, %v; want written once", e, resp, err)
		}
	}
}

// A step that keeps failing is retried with backoff, each attempt counted
// and its error kept, and parked after MaxAttempts; an operator's Retry
// queues it again with a fresh count, and it resumes at the failed step.
func TestRetryBackoffParkAndRetry(t *testing.T) {
	ctx := testCtx(t)
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	sk := newSink()
	var broken atomic.Bool
	broken.Store(true)
	k := threeSteps("order", sk, map[string]func(context.Context, *Run) error{
		"charge": func(ctx context.Context, r *Run) error {
			if broken.Load() {
				return fmt.Errorf("card processor down (attempt %d)", r.Attempt())
			}
			return nil
		},
	})
	k.MaxAttempts = 3
	w := newWorker(t, q, []Kind{k}, Concurrency(2))
	if _, err := q.Submit(ctx, "o-1", "order", nil); err != nil {
		t.Fatal(err)
	}
	j := waitJob(t, q, "o-1")
	if j.State != Parked || j.Attempts != 3 || len(j.Errors) != 3 {
		t.Fatalf("job %+v; want parked after 3 attempts with 3 errors", j)
	}
	// Nothing touches a parked job: not the completer that parked it
	// (whose own writes reach its watch after the attempt ends).
	w.Close()
	if again, err := q.Get(ctx, "o-1"); err != nil || again.Token != j.Token || again.State != Parked {
		t.Fatalf("parked job afterwards: %+v, %v; want it untouched (token %d)", again, err, j.Token)
	}
	newWorker(t, q, []Kind{k}, Concurrency(2))
	for i, e := range j.Errors {
		if e.Attempt != i+1 || e.Step != "charge" || !strings.Contains(e.Err, fmt.Sprintf("attempt %d", i+1)) {
			t.Fatalf("error %d: %+v", i, e)
		}
	}
	if !strings.Contains(j.Err, "card processor down (attempt 3)") {
		t.Fatalf("parked job's error %q; want the last attempt's", j.Err)
	}
	if applied, calls := sk.count("jobs:o-1.reserve"); applied != 1 || calls != 1 {
		t.Fatalf("reserve applied %d, called %d times over 3 attempts; want once", applied, calls)
	}
	broken.Store(false)
	r, err := q.Retry(ctx, "o-1")
	if err != nil || (r.State != Queued && r.State != Running && r.State != Succeeded) {
		t.Fatalf("Retry = %+v, %v; want it queued again", r, err)
	}
	j = waitJob(t, q, "o-1")
	if j.State != Succeeded || j.Attempts != 1 {
		t.Fatalf("after Retry: %+v; want succeeded, on the first attempt of the new series", j)
	}
	if _, err := q.Retry(ctx, "o-1"); !errors.Is(err, ErrFinal) {
		t.Fatalf("Retry of a succeeded job = %v; want ErrFinal", err)
	}
}

// Fail ends the job with the error saved; later steps never run.
func TestFailPolicy(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	sk := newSink()
	k := threeSteps("order", sk, map[string]func(context.Context, *Run) error{
		"charge": func(ctx context.Context, r *Run) error { return errors.New("card declined") },
	})
	k.Steps[1].OnError = Fail
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	q.Submit(ctx, "o-1", "order", nil)
	j, err := w.Run(ctx, "o-1")
	if err != nil || j.State != Failed || !strings.Contains(j.Err, "card declined") {
		t.Fatalf("Run = %+v, %v; want failed with the error", j, err)
	}
	if _, calls := sk.count("jobs:o-1.ship"); calls != 0 {
		t.Fatal("a step after the failed one ran")
	}
	if j.Steps[0].Finished != true || j.Steps[1].Finished || j.Steps[2].Finished {
		t.Fatalf("steps %+v; want only reserve finished", j.Steps)
	}
}

// Compensate undoes the finished steps, last first, each once, then ends
// the job as failed.
func TestCompensatePolicy(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	var undone []string
	var mu sync.Mutex
	var flaky atomic.Int32
	flaky.Store(1)
	undo := func(name string) func(ctx context.Context, r *Run) error {
		return func(ctx context.Context, r *Run) error {
			if want := "jobs:trip-1." + name + "!undo"; r.StepKey() != want || !r.Compensating() {
				return fmt.Errorf("compensation's step key %q; want %q, apart from the step's own", r.StepKey(), want)
			}
			if name == "reserve" && flaky.Add(-1) >= 0 {
				return errors.New("warehouse busy") // a compensation is retried like a step
			}
			mu.Lock()
			undone = append(undone, name)
			mu.Unlock()
			return nil
		}
	}
	ok := func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }
	k := Kind{Name: "trip", Backoff: 10 * time.Millisecond, Steps: []Step{
		{Name: "reserve", Run: ok, Compensate: undo("reserve")},
		{Name: "flight", Run: ok, Compensate: undo("flight")},
		{Name: "hotel", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, errors.New("no rooms") }, OnError: Compensate},
	}}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	q.Submit(ctx, "trip-1", "trip", nil)
	j := waitJob(t, q, "trip-1")
	if j.State != Failed || !strings.Contains(j.Err, "no rooms") || j.Attempts != 2 {
		t.Fatalf("job %+v; want failed for the hotel, after 2 attempts (one compensation retried)", j)
	}
	if got := strings.Join(undone, ","); got != "flight,reserve" {
		t.Fatalf("compensations ran %s; want flight,reserve: last first, each once", got)
	}
	for _, s := range j.Steps[:2] {
		if !s.Compensated {
			t.Fatalf("step %+v not marked compensated", s)
		}
	}
}

// A job whose attempts all die with their workers (no error is ever
// returned) is parked after MaxAttempts all the same: every attempt is
// counted by the takeover that starts it.
func TestAttemptsThatKillTheirWorkerAreCounted(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	var started atomic.Int32
	entered := make(chan struct{}, 3)
	k := Kind{Name: "poison", MaxAttempts: 2, Steps: []Step{{Name: "crash", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		started.Add(1)
		entered <- struct{}{}
		<-ctx.Done() // the worker dies here (its session ends)
		return nil, ctx.Err()
	}}}}
	q := newQueue(t, newStore(t, prefix))
	q.Submit(ctx, "p-1", "poison", nil)
	for i := 1; i <= 3; i++ {
		s := newStore(t, prefix)
		w := newWorker(t, newQueue(t, s), []Kind{k}, Concurrency(0))
		done := make(chan *Job, 1)
		go func() {
			j, _ := w.Run(ctx, "p-1")
			done <- j
		}()
		if i <= 2 {
			<-entered
			endSession(t, s)
		}
		<-done
	}
	j, err := q.Get(ctx, "p-1")
	if err != nil || j.State != Parked || started.Load() != 2 {
		t.Fatalf("job %+v, %v, step started %d times; want parked after 2 attempts, the third never started", j, err, started.Load())
	}
}

// Close gives a running job back unfinished, without counting the attempt;
// another worker resumes it.
func TestCloseGivesRunningJobsBack(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	entered := make(chan struct{})
	var first atomic.Bool
	first.Store(true)
	k := Kind{Name: "long", Steps: []Step{{Name: "wait", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		if first.Swap(false) {
			close(entered)
			<-ctx.Done() // the worker closes meanwhile
			return nil, ctx.Err()
		}
		return []byte("done"), nil
	}}}}
	w, err := NewWorker(q, []Kind{k}, Concurrency(1), DrainTimeout(0))
	if err != nil {
		t.Fatal(err)
	}
	q.Submit(ctx, "l-1", "long", nil)
	<-entered
	w.Close()
	j, err := q.Get(ctx, "l-1")
	if err != nil || j.State != Queued || j.Attempts != 0 {
		t.Fatalf("after Close: %+v, %v; want queued again with no attempt counted", j, err)
	}
	newWorker(t, newQueue(t, newStore(t, prefix)), []Kind{k}, Concurrency(1))
	if j := waitJob(t, q, "l-1"); j.State != Succeeded || j.Attempts != 1 {
		t.Fatalf("job %+v; want succeeded on (counted) attempt 1", j)
	}
}

// Cancel ends a waiting job, never a running one; Retry is only for parked
// jobs; bad input is refused before anything is written.
func TestCancelAndRefusals(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	s := newStore(t, prefix)
	q := newQueue(t, s)
	if _, err := q.Submit(ctx, "q-1", "order", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Retry(ctx, "q-1"); !errors.Is(err, ErrNotParked) {
		t.Fatalf("Retry of a queued job = %v; want ErrNotParked", err)
	}
	j, err := q.Cancel(ctx, "q-1", "customer asked")
	if err != nil || j.State != Cancelled || !strings.Contains(j.Err, "customer asked") {
		t.Fatalf("Cancel = %+v, %v", j, err)
	}
	if _, err := q.Cancel(ctx, "q-1", ""); !errors.Is(err, ErrFinal) {
		t.Fatalf("Cancel again = %v; want ErrFinal", err)
	}
	// A running job cannot be cancelled.
	entered, release := make(chan struct{}), make(chan struct{})
	k := Kind{Name: "order", Steps: []Step{{Name: "one", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		close(entered)
		<-release
		return nil, nil
	}}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	q.Submit(ctx, "r-1", "order", nil)
	go w.Run(ctx, "r-1")
	<-entered
	if _, err := q.Cancel(ctx, "r-1", ""); !errors.Is(err, ErrRunning) {
		t.Fatalf("Cancel of a running job = %v; want ErrRunning", err)
	}
	close(release)
	if j := waitJob(t, q, "r-1"); j.State != Succeeded {
		t.Fatalf("job %+v; want it to finish undisturbed", j)
	}

	cli := cluster.MustClient(t)
	rev := func() int64 {
		resp, err := cli.Get(ctx, "/none")
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	before := rev()
	for _, bad := range []struct{ id, kind string }{{"", "order"}, {"a/b", "order"}, {"ok", ""}, {"ok", "a b"}} {
		if _, err := q.Submit(ctx, bad.id, bad.kind, nil); err == nil {
			t.Fatalf("Submit(%q, %q) succeeded", bad.id, bad.kind)
		}
	}
	if _, err := q.Submit(ctx, "far", "order", nil, RunAt(time.Now().Add(13*time.Hour))); !errors.Is(err, ErrInvalid) {
		t.Fatalf("RunAt past half the retention = %v; want ErrInvalid", err)
	}
	if after := rev(); after != before {
		t.Fatalf("bad input moved the revision from %d to %d", before, after)
	}
	for _, k := range []Kind{{}, {Name: "x"}, {Name: "x", Steps: []Step{{Name: "a"}}}, {Name: "x", Steps: []Step{{Name: "a.b", Run: k.Steps[0].Run}}},
		{Name: "x", Steps: []Step{{Name: "a", Run: k.Steps[0].Run}, {Name: "a", Run: k.Steps[0].Run}}},
		{Name: "x", MaxBackoff: 13 * time.Hour, Steps: []Step{{Name: "a", Run: k.Steps[0].Run}}}} {
		if _, err := NewWorker(q, []Kind{k}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("NewWorker(%+v) = %v; want ErrInvalid", k, err)
		}
	}
}

// A job submitted to run later is scheduled until then.
func TestRunAt(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	var ranAt atomic.Int64
	k := Kind{Name: "later", Steps: []Step{{Name: "one", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		ranAt.Store(time.Now().UnixMilli())
		return nil, nil
	}}}}
	at := time.Now().Add(700 * time.Millisecond)
	j, err := q.Submit(ctx, "l-1", "later", nil, RunAt(at))
	if err != nil || j.State != Scheduled || !j.NotBefore.Equal(time.UnixMilli(ceilMilli(at))) {
		t.Fatalf("Submit = %+v, %v; want scheduled for %v", j, err, at)
	}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	if j := waitJob(t, q, "l-1"); j.State != Succeeded {
		t.Fatalf("job %+v", j)
	}
	if ranAt.Load() < at.UnixMilli() {
		t.Fatalf("ran %d ms before its time", at.UnixMilli()-ranAt.Load())
	}
}

// lossyClient returns a client whose Txn replies are lost while lose > 0:
// the Txn is applied, and the caller sees codes.Unavailable.
func lossyClient(t *testing.T, lose *atomic.Int32) *clientv3.Client {
	t.Helper()
	return lossyClientOf(t, cluster.Endpoints(), lose)
}

// A step whose checkpoint is refused for what it holds (an output that
// outgrows the record, ops inside the store's prefix) fails as the step's
// own error: a retry would be refused again.
func TestRefusedCheckpointIsTheStepsFailure(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix, etcdstore.WithMaxRecordSize(4096)))
	k := Kind{Name: "big", MaxAttempts: 2, Backoff: 10 * time.Millisecond, Steps: []Step{
		{Name: "huge", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) { return make([]byte, 8192), nil }},
		{Name: "never", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			return nil, errors.New("ran after a refused checkpoint")
		}},
	}}
	inside := Kind{Name: "inside", MaxAttempts: 2, Backoff: 10 * time.Millisecond, Steps: []Step{
		{Name: "bad-op", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			r.Commit(clientv3.OpPut(prefix+"k/other/x", "y"))
			return nil, nil
		}},
		{Name: "next", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }},
	}}
	newWorker(t, q, []Kind{k, inside}, Concurrency(2))
	q.Submit(ctx, "b-1", "big", nil)
	q.Submit(ctx, "i-1", "inside", nil)
	if j := waitJob(t, q, "b-1"); j.State != Failed || !strings.Contains(j.Err, "too large") || j.Steps[0].Finished {
		t.Fatalf("job %+v; want failed, its step unfinished, saying the checkpoint was too large", j)
	}
	if j := waitJob(t, q, "i-1"); j.State != Parked || j.Attempts != 2 || !strings.Contains(j.Err, "inside the store's prefix") {
		t.Fatalf("job %+v; want parked after 2 attempts, saying the op was refused", j)
	}
}

// The last step's output, which is saved with the job's end, is held to
// the record's limit like any step's: its failure, as its policy says, not
// a job lost with its outputs.
func TestLastStepOutputTooLarge(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(4096)))
	k := Kind{Name: "big", Steps: []Step{
		{Name: "small", Run: func(ctx context.Context, r *Run) ([]byte, error) { return []byte("ok"), nil }},
		{Name: "huge", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) { return make([]byte, 8192), nil }},
	}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	q.Submit(ctx, "b-1", "big", nil)
	j, err := w.Run(ctx, "b-1")
	if err != nil || j.State != Failed || len(j.Steps) != 2 || !j.Steps[0].Finished || j.Steps[1].Finished ||
		len(j.Errors) != 1 || j.Errors[0].Step != "huge" || !strings.Contains(j.Err, "too large") {
		t.Fatalf("job %+v, %v; want failed in step huge, step small's output kept", j, err)
	}
}

// A job whose state nears the record's limit still gets its backoff and is
// still parked: the errors it collects are cut to the last one rather than
// let its bookkeeping be refused (and the job retried at once, forever).
func TestStateNearTheLimitIsStillParked(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(4096)))
	k := Kind{Name: "near", MaxAttempts: 3, Backoff: 10 * time.Millisecond, Steps: []Step{
		{Name: "fill", Run: func(ctx context.Context, r *Run) ([]byte, error) { return make([]byte, 1800), nil }}, // 2,400 bytes as base64 in the state
		{Name: "fail", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			return nil, errors.New(strings.Repeat("x", 900))
		}},
	}}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	q.Submit(ctx, "n-1", "near", nil)
	j := waitJob(t, q, "n-1")
	if j.State != Parked || j.Attempts != 3 || len(j.Errors) == 0 || len(j.Errors) == 3 {
		t.Fatalf("job %s after %d attempts with %d errors; want parked after 3, its errors cut to fit", j.State, j.Attempts, len(j.Errors))
	}
}

// A job whose worker died is cancelled (taken over); only a live worker's
// job is refused.
func TestCancelAJobWhoseWorkerDied(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	s := newStore(t, prefix)
	entered := make(chan struct{})
	k := Kind{Name: "retired", Steps: []Step{{Name: "one", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		close(entered)
		<-ctx.Done()
		return nil, ctx.Err()
	}}}}
	w := newWorker(t, newQueue(t, s), []Kind{k}, Concurrency(0))
	q := newQueue(t, newStore(t, prefix))
	q.Submit(ctx, "r-1", "retired", nil)
	done := make(chan struct{})
	go func() { w.Run(ctx, "r-1"); close(done) }()
	<-entered
	if _, err := q.Cancel(ctx, "r-1", ""); !errors.Is(err, ErrRunning) {
		t.Fatalf("Cancel while its worker lives = %v; want ErrRunning", err)
	}
	endSession(t, s) // the worker dies
	<-done
	j, err := q.Cancel(ctx, "r-1", "its kind was retired")
	if err != nil || j.State != Cancelled {
		t.Fatalf("Cancel after its worker died = %+v, %v; want cancelled", j, err)
	}
}

// Defect 6 of 0.5's review: a last step whose etcd ops were committed with
// its checkpoint was failed and run again (its ops committed again) when
// the job's end no longer fitted the record once its outcome was added.
// Over a range of output sizes (one of which lands in that window), the
// step's effect is committed at most once, and a job whose effect exists
// ended with the step finished.
func TestLastStepWithOpsIsNeverRunAgain(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	st := newStore(t, prefix, etcdstore.WithMaxRecordSize(4096))
	q := newQueue(t, st)
	size := 0
	k := Kind{Name: "commit", MaxAttempts: 3, Backoff: time.Millisecond, Steps: []Step{
		{Name: "first", Run: func(ctx context.Context, r *Run) ([]byte, error) { return []byte("ok"), nil }},
		{Name: "last", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) {
			r.Commit(clientv3.OpPut("/effects"+prefix+r.Key().ID, "done"))
			return bytes.Repeat([]byte{'x'}, size), nil
		}},
	}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	cli := cluster.MustClient(t)
	cut := 0
	for size = 2850; size < 3000; size++ { // (the window moves with what every state holds)
		id := fmt.Sprintf("c-%d", size)
		q.Submit(ctx, id, "commit", nil)
		j, err := w.Run(ctx, id)
		if err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		eff, err := cli.Get(ctx, "/effects"+prefix+id)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case len(eff.Kvs) == 1 && eff.Kvs[0].Version != 1:
			t.Fatalf("size %d: the last step's effect was committed %d times", size, eff.Kvs[0].Version)
		case len(eff.Kvs) == 1 && (j.State != Succeeded || !j.Steps[1].Finished):
			t.Fatalf("size %d: its effect is committed, and the job is %s with its last step finished %v", size, j.State, j.Steps[1].Finished)
		case len(eff.Kvs) == 0 && j.State != Failed:
			t.Fatalf("size %d: no effect, and the job is %s; want failed (the step's checkpoint refused)", size, j.State)
		}
		if len(j.Truncated) > 0 {
			cut++
		}
	}
	if cut == 0 {
		t.Fatal("no size landed in the window where the end had to be cut: the test tests nothing")
	}
}

// Defect 9: a job that failed near the record's limit lost its whole state
// (the store saved "the outcome could not be saved" in its place). Its end
// is cut to fit instead, and says so.
func TestFailedJobNearTheLimitKeepsItsState(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(4096)))
	k := Kind{Name: "near", Steps: []Step{
		{Name: "fill", Run: func(ctx context.Context, r *Run) ([]byte, error) { return make([]byte, 1800), nil }},
		{Name: "fail", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) {
			return nil, errors.New(strings.Repeat("y", 3000))
		}},
	}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	q.Submit(ctx, "f-1", "near", []byte(`{"order":42}`))
	j, err := w.Run(ctx, "f-1")
	if err != nil || j.State != Failed || j.Kind != "near" || string(j.Params) != `{"order":42}` || len(j.Steps) != 2 || !j.Steps[0].Finished ||
		!strings.Contains(j.Err, "step fail: yyy") || len(j.Truncated) == 0 {
		t.Fatalf("job %+v, %v; want failed with its kind, params, steps and (cut) error, saying what was cut", j, err)
	}
}
