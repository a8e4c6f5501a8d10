package jobs

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
)

// staleReplays answers Run of a key with a done record it was given, a
// number of times, as a store reading from a lagging member (or a cache
// that has not yet seen a delete) would: the record was deleted since.
type staleReplays struct {
	idem.Store
	mu     sync.Mutex
	stale  map[etcdstore.Key]*etcdstore.Record
	left   int
	served atomic.Int32
}

func (s *staleReplays) Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error) {
	s.mu.Lock()
	if r := s.stale[key]; r != nil && s.left > 0 {
		s.left--
		s.mu.Unlock()
		s.served.Add(1)
		return etcdstore.Result{Outcome: *r.Outcome, Replayed: true, Token: r.Token}, nil
	}
	s.mu.Unlock()
	return s.Store.Run(ctx, key, fp, work, opts...)
}

// Issue 37: a worker whose claim replayed a replaced job's old end
// returned without running it, the completer counted that as handled and
// never tried the queued job again. A replay is never a run: the job is
// tried again, and runs.
func TestReplayOfAReplacedJobIsNotARun(t *testing.T) {
	ctx := testCtx(t)
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	stale := &staleReplays{Store: q.recs, stale: map[etcdstore.Key]*etcdstore.Record{}}
	q.recs = stale
	var runs atomic.Int32
	k := Kind{Name: "k", Steps: []Step{{Name: "one", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		runs.Add(1)
		return r.Params(), nil
	}}}}
	newWorker(t, q, []Kind{k})
	if _, err := q.Submit(ctx, "r-1", "k", []byte(`1`), DedupWindow(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if j := waitJob(t, q, "r-1"); j.State != Succeeded {
		t.Fatalf("first job = %+v; want succeeded", j)
	}
	old, err := s.Get(ctx, q.Key("r-1"))
	if err != nil {
		t.Fatal(err)
	}
	stale.mu.Lock()
	stale.stale[q.Key("r-1")], stale.left = old, 2
	stale.mu.Unlock()
	// Past its window: the ended job is replaced by a new one.
	second, err := q.Submit(ctx, "r-1", "k", []byte(`2`), DedupWindow(time.Millisecond))
	if err != nil || !second.Created.After(old.Created) {
		t.Fatalf("re-submit past the window = %+v, %v; want a new job", second, err)
	}
	j := waitJob(t, q, "r-1")
	if j.State != Succeeded || string(j.Output("one")) != "2" || runs.Load() != 2 {
		t.Fatalf("the new job = %s output %q after %d runs; want it run with params 2", j.State, j.Output("one"), runs.Load())
	}
	if n := stale.served.Load(); n != 2 {
		t.Fatalf("%d stale replays served; want 2 (the test did not exercise the path)", n)
	}
}

// Issue 37: a plain key whose work failed (a saved error, no body) was
// read as a failed job with no kind, and listed among the jobs. A record
// says what it is: a plain key is never a job.
func TestAPlainKeyIsNeverAJob(t *testing.T) {
	ctx := testCtx(t)
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	if _, err := s.Do(ctx, q.Key("plain"), []byte(`{}`), func(context.Context, *etcdstore.Claim) ([]byte, error) {
		return nil, errors.New("card declined")
	}); err == nil {
		t.Fatal("the failing work's Do returned no error")
	}
	if _, err := q.Submit(ctx, "job", "k", []byte(`1`)); err != nil {
		t.Fatal(err)
	}
	got, err := q.List(ctx, ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Key.ID != "job" {
		t.Fatalf("List = %v; want the job alone", got)
	}
	if j, err := q.Get(ctx, "plain"); !errors.Is(err, ErrNotJob) {
		t.Fatalf("Get of a plain key = %+v, %v; want ErrNotJob", j, err)
	}
}
