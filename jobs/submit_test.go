package jobs

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// RefuseDuplicate refuses another submission's job, returning it, and
// writes nothing; a submission whose reply was lost (its write landed) is
// recognised as its own, not refused.
func TestRefuseDuplicate(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	var lose atomic.Int32
	q := newQueue(t, newStoreOn(t, lossyClient(t, &lose), prefix))
	lose.Store(1) // the first Txn's reply is lost: Enqueue retries and finds its own job
	j, err := q.Submit(ctx, "d-1", "k", []byte(`{"n":1}`), RefuseDuplicate())
	if err != nil || j.State != Queued {
		t.Fatalf("first Submit, its reply lost = %+v, %v; want the job, queued, not refused", j, err)
	}
	if lose.Load() != 0 {
		t.Fatal("the reply was not lost: the test proves nothing")
	}
	other := newQueue(t, newStore(t, prefix))
	dup, err := other.Submit(ctx, "d-1", "k", []byte(`{"n":1}`), RefuseDuplicate())
	if !errors.Is(err, ErrDuplicate) || dup == nil || dup.Token != j.Token {
		t.Fatalf("second Submit = %+v, %v; want ErrDuplicate with the first job (token %d)", dup, err, j.Token)
	}
	if again, err := other.Submit(ctx, "d-1", "k", []byte(`{"n":1}`)); err != nil || again.Token != j.Token {
		t.Fatalf("Submit without RefuseDuplicate = %+v, %v; want the job as it stands", again, err)
	}
	if _, err := other.Submit(ctx, "d-1", "k", []byte(`{"n":2}`), RefuseDuplicate()); !errors.Is(err, etcdstore.ErrMismatch) {
		t.Fatalf("other params = %v; want ErrMismatch", err)
	}
}

// DedupWindow: within the window an id names its job; past it, an ended
// job is replaced by a new one (its params may differ), and a job that has
// not ended is never replaced.
func TestDedupWindow(t *testing.T) {
	ctx := testCtx(t)
	// The queue's clock is moved by hand; the store's (its sessions,
	// the records' creation) is the machine's, from which it starts.
	t0 := time.Now()
	fc := newFakeClock(t0)
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	q.setClock(fc.view(0))
	var runs atomic.Int32
	k := Kind{Name: "k", Steps: []Step{{Name: "one", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		runs.Add(1)
		return r.Params(), nil
	}}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	first, err := q.Submit(ctx, "w-1", "k", []byte(`1`), DedupWindow(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "w-1"); err != nil || j.State != Succeeded {
		t.Fatalf("Run = %+v, %v", j, err)
	}
	fc.set(t0.Add(59 * time.Minute))
	if j, err := q.Submit(ctx, "w-1", "k", []byte(`1`), DedupWindow(time.Hour)); err != nil || j.State != Succeeded || !j.Created.Equal(first.Created) {
		t.Fatalf("Submit within the window = %+v, %v; want the job that ran", j, err)
	}
	if _, err := q.Submit(ctx, "w-1", "k", []byte(`2`), DedupWindow(time.Hour)); !errors.Is(err, etcdstore.ErrMismatch) {
		t.Fatalf("other params within the window = %v; want ErrMismatch", err)
	}
	fc.set(t0.Add(time.Hour + time.Second)) // (the job was created a moment after t0)
	second, err := q.Submit(ctx, "w-1", "k", []byte(`2`), DedupWindow(time.Hour), RefuseDuplicate())
	if err != nil || second.State != Queued || !second.Created.After(first.Created) || string(second.Params) != "2" {
		t.Fatalf("Submit past the window = %+v, %v; want a new job with the new params", second, err)
	}
	fc.set(t0.Add(3 * time.Hour)) // the new job has not run: never replaced
	if j, err := q.Submit(ctx, "w-1", "k", []byte(`3`), DedupWindow(time.Hour)); !errors.Is(err, etcdstore.ErrMismatch) || j != nil {
		t.Fatalf("Submit over a job that has not ended = %+v, %v; want ErrMismatch", j, err)
	}
	if j, err := w.Run(ctx, "w-1"); err != nil || j.State != Succeeded || string(j.Output("one")) != "2" || runs.Load() != 2 {
		t.Fatalf("the new job = %+v, %v, runs %d; want it run once with params 2", j, err, runs.Load())
	}
	if _, err := q.Submit(ctx, "w-1", "k", nil, DedupWindow(-time.Second)); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a negative window = %v; want ErrInvalid", err)
	}
}
