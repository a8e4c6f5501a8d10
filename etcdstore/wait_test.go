package etcdstore

import (
	"errors"
	"testing"
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
	if _, err := cli.Revoke(ctx, owner.sessionLease()); err != nil { // the owner dies
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
