package etcdstore

import (
	"context"
	"errors"
	"testing"
	"time"
)

// waitAsync starts Wait in a goroutine and returns once it is blocked on its
// watches, so the change that follows is seen through the Watch.
func waitAsync(t *testing.T, s *Store, key Key) <-chan waitResult {
	t.Helper()
	waiting := make(chan struct{}, 1)
	testHookAwait = func() {
		select {
		case waiting <- struct{}{}:
		default: // later rounds of the same Wait
		}
	}
	t.Cleanup(func() { testHookAwait = nil })
	out := make(chan waitResult, 1)
	go func() {
		rec, err := s.Wait(testCtx(t), key)
		out <- waitResult{rec, err}
	}()
	<-waiting
	return out
}

type waitResult struct {
	rec *Record
	err error
}

func TestWaitReturnsOutcomeWhenOwnerCompletes(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	owner := newStore(t, cli, prefix)
	waiter := newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	c, _, err := owner.Claim(ctx, key, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	got := waitAsync(t, waiter, key)
	if err := c.Checkpoint(ctx, []byte("halfway")); err != nil { // not an end: keep waiting
		t.Fatal(err)
	}
	if err := c.Complete(ctx, Outcome{Status: 201, Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil || r.rec.State != Done || r.rec.Outcome.Status != 201 || string(r.rec.Outcome.Body) != "done" {
		t.Fatalf("Wait = %+v, %v; want the saved outcome", r.rec, r.err)
	}
}

func TestWaitEndsWhenReleasedOrStale(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	owner := newStore(t, cli, prefix)
	waiter := newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}

	c, _, err := owner.Claim(ctx, key, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	got := waitAsync(t, waiter, key)
	if err := c.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-got; !errors.Is(r.err, ErrNotFound) {
		t.Fatalf("Wait after release = %+v, %v; want ErrNotFound", r.rec, r.err)
	}

	c, _, err = owner.Claim(ctx, key, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	got = waitAsync(t, waiter, key)
	if _, err := cli.Revoke(ctx, owner.sessionLeaseID()); err != nil { // the owner dies
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil || r.rec.State != InFlight || r.rec.Token != c.Token() {
		t.Fatalf("Wait after the owner died = %+v, %v; want the stale in-flight record", r.rec, r.err)
	}
	if _, err := waiter.Wait(ctx, Key{ID: "never-claimed"}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Wait of an unknown key = %v; want ErrNotFound", err)
	}
}

// A wait on a record whose last write was compacted away blocks on its
// watch until something changes; it does not return at once (and so spin,
// re-reading, in its callers' loops).
func TestWaitAfterCompaction(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	owner, waiter := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	c, _, err := owner.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	// Move the revision on and compact past the record's last write.
	for i := 0; i < 3; i++ {
		if _, err := cli.Put(ctx, prefix+"../other", "x"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Compact(ctx, revision(t, cli)); err != nil {
		t.Fatal(err)
	}
	cur, rev, err := waiter.get(ctx, Key{ID: "k"})
	if err != nil {
		t.Fatal(err)
	}
	_, ownerRev, _ := waiter.ownerAlive(ctx, cur.Owner)
	// Nothing changes: the wait must last until its context ends.
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	got, _, err := waiter.awaitChange(wctx, Key{ID: "k"}, cur, rev, ownerRev)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("awaitChange on an unchanged, compacted record = %+v, %v; want it to block until its context ends", got, err)
	}
}
