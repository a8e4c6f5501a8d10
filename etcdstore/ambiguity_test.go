package etcdstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// Each test here is a path on which an ambiguous outcome (a lost reply, a
// shutdown with a write pending) used to run work twice or hold a key
// forever. The rule they check: an outcome that may have happened is
// treated as having happened.

// loseTxns returns an interceptor that loses the reply of the next n Txns
// (they are applied; the caller sees an error) and one that fails them
// before they reach etcd.
func loseTxns(lose, fail *atomic.Int32) interceptor {
	return func(method string, req any, invoke func() error) error {
		if !strings.HasSuffix(method, "/Txn") {
			return invoke()
		}
		if fail != nil && fail.Add(-1) >= 0 {
			return errLost
		}
		err := invoke()
		if err == nil && lose != nil && lose.Add(-1) >= 0 {
			return errLost
		}
		return err
	}
}

// A worker claims without a session through process P, whose every reply
// is lost, so P reports an error; the worker retries with its attempt id
// through Q, which recognises the claim as the worker's. P must not then
// abandon that claim in the background: the next claimant would take over
// while the worker still runs.
func TestRecognisedClaimIsNotReapedElsewhere(t *testing.T) {
	var lose atomic.Int32
	prefix := testPrefix(t)
	p := newStore(t, hookedClient(t, loseTxns(&lose, nil)), prefix)
	q := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	key, fp := Key{ID: "k"}, fpOf(t, "p")
	opts := []ClaimOption{WithoutSession(), WithDeadline(time.Minute), WithAttempt("worker-1")}

	lose.Store(100)
	if _, _, err := p.Claim(ctx, key, fp, opts...); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("claim through P = %v; want ErrUnavailable (every reply lost)", err)
	}
	lose.Store(0)
	mine, _, err := q.Claim(ctx, key, fp, opts...)
	if err != nil {
		t.Fatalf("the worker's retry through Q: %v; want its own claim recognised", err)
	}
	settle(t, p) // whatever P does in the background, it has done it

	if _, _, err := q.Claim(ctx, key, fp, WithoutSession(), WithDeadline(time.Minute), WithAttempt("worker-2")); !errors.Is(err, ErrConflict) {
		t.Fatalf("a second worker's claim = %v; want ErrConflict while the first runs", err)
	}
	if err := mine.Complete(ctx, Outcome{Body: []byte("once")}); err != nil {
		t.Fatalf("the first worker's Complete: %v", err)
	}
}

// Work finished while etcd refused its Complete: the outcome is retried in
// the background. Close must flush it before revoking the session;
// otherwise the next claimant takes the key over and runs the work again.
func TestCloseFlushesPendingFinalWrites(t *testing.T) {
	var fail atomic.Int32
	prefix := testPrefix(t)
	s := newStore(t, hookedClient(t, loseTxns(nil, &fail)), prefix)
	other := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}

	res, err := s.Do(ctx, key, []byte(`{}`), func(context.Context, *Claim) ([]byte, error) {
		fail.Store(1000) // etcd is unreachable from now on
		return []byte("charged"), nil
	})
	if !errors.Is(err, ErrUnavailable) || string(res.Body) != "charged" {
		t.Fatalf("Do = %q, %v; want the work's result and ErrUnavailable", res.Body, err)
	}
	if s.Metrics().Pending != 1 {
		t.Fatalf("Pending = %d; want the final write pending", s.Metrics().Pending)
	}
	fail.Store(0) // etcd is back while the process shuts down
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	runs := 0
	res, err = other.Do(ctx, key, []byte(`{}`), func(context.Context, *Claim) ([]byte, error) {
		runs++
		return []byte("charged again"), nil
	})
	if err != nil || runs != 0 || !res.Replayed || string(res.Body) != "charged" {
		t.Fatalf("after Close: %q replayed=%v runs=%d err=%v; want the first outcome replayed, no run", res.Body, res.Replayed, runs, err)
	}
}

// A checkpoint (or a renewal) that landed while its caller saw an error is
// recognised by the claim's next write, which keeps it: the next owner must
// never resume from an older step, nor a deadline move back.
func TestCheckpointNeverMovesBackwards(t *testing.T) {
	var lose atomic.Int32
	prefix := testPrefix(t)
	s := newStore(t, hookedClient(t, loseTxns(&lose, nil)), prefix)
	other := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	fp := fpOf(t, "p")

	c, _, err := s.Claim(ctx, Key{ID: "checkpoint"}, fp, WithDeadline(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(ctx, []byte("step1")); err != nil {
		t.Fatal(err)
	}
	lose.Store(100)
	if err := c.Checkpoint(ctx, []byte("step2")); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Checkpoint(step2) = %v; want ErrUnavailable (replies lost)", err)
	}
	lose.Store(0)
	if rec, err := s.Get(ctx, c.Key()); err != nil || string(rec.Checkpoint) != "step2" {
		t.Fatalf("record %+v, %v; want step2 landed", rec, err)
	}
	if err := c.Abandon(ctx); err != nil {
		t.Fatal(err)
	}
	next, _, err := other.Claim(ctx, c.Key(), fp)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(next.LastCheckpoint()); got != "step2" {
		t.Fatalf("the next owner resumes from %q; want step2", got)
	}

	c, _, err = s.Claim(ctx, Key{ID: "renew"}, fp, WithDeadline(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(100)
	if err := c.Renew(ctx, time.Hour); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Renew = %v; want ErrUnavailable (replies lost)", err)
	}
	lose.Store(0)
	if err := c.Checkpoint(ctx, []byte("step1")); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx, c.Key())
	if err != nil || time.Until(rec.Deadline) < 50*time.Minute || !c.Deadline().Equal(rec.Deadline) {
		t.Fatalf("record deadline %v (claim's %v), %v; want the renewed deadline kept", rec.Deadline, c.Deadline(), err)
	}
}

// Run's work ran but its outcome is too large, and the fallback (saving
// that fact) fails for a reason other than availability: the claim must
// still end, never stay registered here while other processes see a live
// owner.
func TestRunEndsItsClaimWhenEveryEndFails(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	_, err := s.Run(ctx, key, fpOf(t, "p"), func(context.Context, *Claim) (Outcome, End) {
		// Something overwrites the record with bytes no store can read.
		if _, err := cli.Put(ctx, s.ks.record(key), "garbage"); err != nil {
			t.Error(err)
		}
		return Outcome{Body: bytes.Repeat([]byte("x"), s.MaxRecordSize()+1)}, EndSave
	})
	if !errors.Is(err, ErrTooLarge) {
		t.Fatalf("Run = %v; want ErrTooLarge", err)
	}
	settle(t, s)
	if n := s.Metrics().Running; n != 0 {
		t.Fatalf("Running = %d; want the claim ended", n)
	}
}

// The claim write of acquire's last round has an unknown outcome: it may
// have landed under this process's session. The store must give it up in
// the background, as it does after any other ambiguous claim write.
func TestUnknownLastClaimWriteIsReaped(t *testing.T) {
	prefix := testPrefix(t)
	cli := client(t)
	ctx := testCtx(t)
	key, fp := Key{ID: "k"}, fpOf(t, "p")
	// A dead owner's claim: every round tries to take it over.
	dead := newStore(t, cli, prefix)
	if _, _, err := dead.Claim(ctx, key, fp); err != nil {
		t.Fatal(err)
	}
	dead.Close()

	var s *Store
	var rounds atomic.Int32
	hook := func(method string, req any, invoke func() error) error {
		txn, ok := req.(*pb.TxnRequest)
		if !ok || s == nil || !slices.ContainsFunc(txn.Compare, func(c *pb.Compare) bool { return string(c.Key) == s.ks.record(key) }) {
			return invoke()
		}
		if rounds.Add(1) < 8 {
			// A competing write moves the record's revision just before
			// each takeover, so the compare fails and the round repeats.
			resp, err := cli.Get(ctx, s.ks.record(key))
			if err != nil || len(resp.Kvs) == 0 {
				t.Errorf("read: %v", err)
				return invoke()
			}
			if _, err := cli.Put(ctx, s.ks.record(key), string(resp.Kvs[0].Value)); err != nil {
				t.Error(err)
			}
			return invoke()
		}
		if err := invoke(); err != nil {
			return err
		}
		return errLost // the last round's takeover lands; its reply is lost
	}
	s = newStore(t, hookedClient(t, hook), prefix)
	_, _, err := s.Claim(ctx, key, fp)
	if err == nil {
		t.Fatal("Claim succeeded; the test expects every round to be defeated")
	}
	if rounds.Load() < 8 {
		t.Fatalf("only %d rounds ran", rounds.Load())
	}
	settle(t, s)
	rec, err := s.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Owner == s.Owner() {
		t.Fatalf("the key is held by this process's session (%s) with nobody running it", rec.Owner)
	}
}

// A claim attached for one write and dropped (what the worker API does on
// every heartbeat through another process) must not stay reachable, with
// its checkpoint, until its deadline.
func TestAttachedClaimsAreNotKeptAlive(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t))
	ctx := testCtx(t)
	c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithoutSession(), WithDeadline(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(ctx, bytes.Repeat([]byte("c"), 64<<10)); err != nil {
		t.Fatal(err)
	}
	const n = 20
	var collected atomic.Int32
	for i := 0; i < n; i++ {
		a, err := s.Attach(ctx, c.Handle())
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Renew(ctx, time.Hour); err != nil {
			t.Fatal(err)
		}
		runtime.AddCleanup(a, func(*atomic.Int32) { collected.Add(1) }, &collected)
	}
	deadline := time.Now().Add(10 * time.Second)
	for collected.Load() < n && time.Now().Before(deadline) {
		runtime.GC() // cleanups run after a collection, on their own goroutine
		runtime.Gosched()
	}
	if got := collected.Load(); got < n {
		t.Fatalf("%d of %d dropped attached claims were collected; the rest are held until their deadline", got, n)
	}
}

// Evict through a store drops the record from its cache; a watch event
// older than the eviction, delivered after it, must not put it back.
func TestEvictIsNotUndoneByALaggingWatch(t *testing.T) {
	held := make(chan struct{})
	var mu sync.Mutex
	var applied []int64
	var hold atomic.Bool
	testHookCacheApplied = func(rev int64) {
		mu.Lock()
		applied = append(applied, rev)
		mu.Unlock()
		if hold.Load() {
			<-held
		}
	}
	t.Cleanup(func() { testHookCacheApplied = nil })
	s := newStore(t, client(t), testPrefix(t), WithCache(1<<20), WithClaimPath(ClaimPathWriteFirst))
	var release sync.Once
	free := func() { hold.Store(false); close(held) }
	t.Cleanup(func() { release.Do(free) }) // before the store closes: its watch may be held
	ctx := testCtx(t)
	key := Key{ID: "k"}

	// The watch runs once it has proved itself current; then a first key.
	waitFor(t, "the cache's watch", func() bool { return s.Metrics().Cache.Lag < DefaultCacheStaleness })
	if _, err := s.Do(ctx, Key{ID: "warm"}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("w"), nil }); err != nil {
		t.Fatal(err)
	}
	waitApplied := func(n int) {
		t.Helper()
		for start := time.Now(); ; {
			mu.Lock()
			got := len(applied)
			mu.Unlock()
			if got >= n {
				return
			}
			if time.Since(start) > 10*time.Second {
				t.Fatalf("the cache applied %d watch events; want %d", got, n)
			}
			runtime.Gosched()
		}
	}
	waitApplied(2) // the warm key's claim and its completion
	mu.Lock()
	before := len(applied)
	mu.Unlock()

	hold.Store(true) // the watch lags: events are applied one by one, on release
	if _, err := s.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("v1"), nil }); err != nil {
		t.Fatal(err)
	}
	if err := s.Evict(ctx, key); err != nil {
		t.Fatal(err)
	}
	// The claim's event is applied; let the completion through, then hold
	// the deletion.
	waitApplied(before + 1)
	held <- struct{}{}
	waitApplied(before + 2)
	if r, ok := s.cache.Get(s.ks.record(key)); ok {
		t.Fatalf("the cache replays the evicted outcome %q", r.Outcome.Body)
	}
	release.Do(free)
}

// An outcome too large to save is replaced by a saved error, and the key is
// not left claimed.
func TestRunOutcomeTooLargeIsNotLeftHeld(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t), WithMaxRecordSize(4096))
	ctx := testCtx(t)
	runs := 0
	work := func(context.Context, *Claim) (Outcome, End) {
		runs++
		return Outcome{Body: make([]byte, 8192)}, EndSave
	}
	if _, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("Run = %v; want ErrTooLarge", err)
	}
	if s.Metrics().Running != 0 {
		t.Fatalf("Running = %d; want the claim ended", s.Metrics().Running)
	}
	res, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work)
	if err != nil || !res.Replayed || res.Err == "" || runs != 1 {
		t.Fatalf("retry = %+v, %v (runs %d); want the saved error, no second run", res, err, runs)
	}
}

// failDoneWrites returns an interceptor that fails, before etcd, every Txn
// that would write a done record (alone or inside a batch) while on is set:
// finished work cannot save its outcome, everything else reaches etcd.
func failDoneWrites(on *atomic.Bool) interceptor {
	var writesDone func(ops []*pb.RequestOp) bool
	writesDone = func(ops []*pb.RequestOp) bool {
		for _, op := range ops {
			if put := op.GetRequestPut(); put != nil && isDone(put.Value) {
				return true
			}
			if txn := op.GetRequestTxn(); txn != nil && writesDone(txn.Success) {
				return true
			}
		}
		return false
	}
	return func(method string, req any, invoke func() error) error {
		if txn, ok := req.(*pb.TxnRequest); ok && on.Load() && writesDone(txn.Success) {
			return errLost
		}
		return invoke()
	}
}

// Work finished while its outcome could not be saved, and then the
// process's session was lost (a partition longer than the session TTL).
// The outcome exists only in this process, which must never run the key
// again: a retry through it is answered with a conflict until the save
// lands, and then with the saved outcome. (Until 0.5 the session
// supervisor dropped the pending claim, the retry saw the old session
// dead, took the key over in the very process holding the answer, and ran
// the work twice.)
func TestPendingOutcomeSurvivesSessionLoss(t *testing.T) {
	var cut atomic.Bool
	prefix := testPrefix(t)
	cli := client(t)
	s := newStore(t, hookedClient(t, failDoneWrites(&cut)), prefix)
	ctx := testCtx(t)
	key, params := Key{ID: "charge"}, []byte(`{"amount":1}`)
	runs := 0
	work := func(context.Context, *Claim) ([]byte, error) {
		runs++
		cut.Store(true) // the outcome cannot be saved from now on
		return []byte(fmt.Sprintf("charged %d", runs)), nil
	}
	if res, err := s.Do(ctx, key, params, work); !errors.Is(err, ErrUnavailable) || string(res.Body) != "charged 1" {
		t.Fatalf("Do = %q, %v; want the work's result and ErrUnavailable", res.Body, err)
	}
	if p := s.Metrics().Pending; p != 1 {
		t.Fatalf("Pending = %d; want the outcome pending", p)
	}
	lost := s.Owner()
	if _, err := cli.Revoke(ctx, s.sessionLeaseID()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a new session", func() bool { o := s.Owner(); return o != "" && o != lost })

	// The client retries through the same process.
	if _, err := s.Do(ctx, key, params, work); !errors.Is(err, ErrConflict) || runs != 1 {
		t.Fatalf("a retry while the outcome is pending: %v, the work ran %d times; want ErrConflict and one run", err, runs)
	}
	cut.Store(false)
	settle(t, s)
	res, err := s.Do(ctx, key, params, work)
	if err != nil || !res.Replayed || string(res.Body) != "charged 1" || runs != 1 {
		t.Fatalf("after the save landed: %q replayed=%v runs=%d err=%v; want %q replayed, one run", res.Body, res.Replayed, runs, err, "charged 1")
	}
}

// The same when the claim's deadline passes while the save is being tried:
// the claim stays registered here (the deadline makes it stale to other
// processes, not to the one holding its outcome), and a retry through this
// process conflicts instead of taking the key over and running it again.
// (Found by the explorer, invariant 15: the deadline's timer unregistered
// the claim before its save was handed to the background.)
func TestPendingOutcomeSurvivesItsDeadline(t *testing.T) {
	var cut atomic.Bool
	prefix := testPrefix(t)
	fail := failDoneWrites(&cut)
	slow := func(method string, req any, invoke func() error) error {
		err := fail(method, req, invoke)
		if errors.Is(err, errLost) {
			time.Sleep(300 * time.Millisecond) // a save that takes its time to fail: etcd far away
		}
		return err
	}
	s := newStore(t, hookedClient(t, slow), prefix, WithEndTimeout(3*time.Second))
	ctx := testCtx(t)
	key, params := Key{ID: "charge"}, []byte(`{"amount":1}`)
	runs := 0
	work := func(context.Context, *Claim) ([]byte, error) {
		runs++
		cut.Store(true) // the outcome cannot be saved from now on
		return []byte(fmt.Sprintf("charged %d", runs)), nil
	}
	began := time.Now()
	if res, err := s.Do(ctx, key, params, work, WithDeadline(500*time.Millisecond)); !errors.Is(err, ErrUnavailable) || string(res.Body) != "charged 1" {
		t.Fatalf("Do = %q, %v; want the work's result and ErrUnavailable", res.Body, err)
	}
	if d := time.Since(began); d < 500*time.Millisecond {
		t.Fatalf("Do returned after %v, before the deadline: the test does not test what it says", d)
	}
	if _, err := s.Do(ctx, key, params, work); !errors.Is(err, ErrConflict) || runs != 1 {
		t.Fatalf("a retry past the deadline while the outcome is pending: %v, the work ran %d times; want ErrConflict and one run", err, runs)
	}
	cut.Store(false)
	settle(t, s)
	res, err := s.Do(ctx, key, params, work)
	if err != nil || !res.Replayed || string(res.Body) != "charged 1" || runs != 1 {
		t.Fatalf("after the save landed: %q replayed=%v runs=%d err=%v; want %q replayed, one run", res.Body, res.Replayed, runs, err, "charged 1")
	}
}
