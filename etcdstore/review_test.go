package etcdstore

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A claim is never written under a session that has ended: either it is
// refused, or it is made under the new session.
func TestNoClaimUnderADeadSession(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	for i := 0; i < 5; i++ {
		dead := s.Owner()
		if _, err := cli.Revoke(ctx, s.sessionLease()); err != nil {
			t.Fatal(err)
		}
		key := Key{ID: "k" + string(rune('a'+i))}
		c, _, err := s.Claim(ctx, key, fpOf(t, "p"))
		if err != nil && !errors.Is(err, ErrUnavailable) {
			t.Fatalf("claim right after the session died = %v; want ErrUnavailable or a claim under a new session", err)
		}
		resp, rerr := cli.Get(ctx, s.ks.record(key))
		if rerr != nil {
			t.Fatal(rerr)
		}
		if len(resp.Kvs) > 0 {
			rec, _ := decode(key, resp.Kvs[0])
			if alive, _, _ := s.ownerAlive(ctx, rec.Owner); !alive {
				t.Fatalf("a claim was written under the dead session %s", rec.Owner)
			}
		}
		if err == nil {
			c.Release(ctx)
		}
		for o := s.Owner(); o == "" || o == dead; o = s.Owner() { // the store replaces its session on its own schedule
			select {
			case <-ctx.Done():
				t.Fatal("no new session")
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
}

// Our own claim, retried with its attempt id after its deadline, is taken
// over (a fresh deadline and a greater token), never resumed as it was.
func TestOwnClaimPastDeadlineIsTakenOver(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t))
	ctx := testCtx(t)
	old, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithAttempt("a1"), WithDeadline(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	<-old.Done()
	c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithAttempt("a1"), WithDeadline(time.Hour))
	if err != nil || !c.TookOver() || c.Token() <= old.Token() || time.Until(c.Deadline()) < time.Minute {
		t.Fatalf("same attempt after its deadline = %v; want a takeover with a new deadline", err)
	}
	c.Release(ctx)
}

// An Abandon whose reply was lost landed: it is not reported as a failure.
func TestLostAbandonReplyIsRecognised(t *testing.T) {
	var lose atomic.Int32
	s := newStore(t, lossyClient(t, &lose), testPrefix(t))
	ctx := testCtx(t)
	c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(1)
	if err := c.Abandon(ctx); err != nil {
		t.Fatalf("Abandon after a lost reply = %v; want nil", err)
	}
}

// Header values that are not UTF-8 replay byte for byte.
func TestHeaderBytesReplayExactly(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t))
	ctx := testCtx(t)
	hdr := map[string][]string{"Content-Disposition": {"attachment; filename=\"caf\xe9.txt\""}}
	work := func(context.Context, *Claim) (Outcome, End) { return Outcome{Status: 200, Header: hdr}, EndSave }
	if _, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work); err != nil {
		t.Fatal(err)
	}
	res, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work)
	if err != nil || !res.Replayed || res.Header["Content-Disposition"][0] != hdr["Content-Disposition"][0] {
		t.Fatalf("replayed header = %q, %v; want %q", res.Header["Content-Disposition"], err, hdr["Content-Disposition"][0])
	}
}

// Attempt ids are scoped by key: two keys may use the same one at once.
func TestSameAttemptOnTwoKeys(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t))
	ctx := testCtx(t)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, k := range []string{"k1", "k2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, _, err := s.Claim(ctx, Key{ID: k}, fpOf(t, "p"), WithAttempt("shared"))
			if err == nil {
				err = c.Release(ctx)
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatalf("claims of two keys with one attempt id: %v; want both", errs)
	}
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
	if s.Running() != 0 {
		t.Fatalf("Running = %d; want the claim ended", s.Running())
	}
	res, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work)
	if err != nil || !res.Replayed || res.Err == "" || runs != 1 {
		t.Fatalf("retry = %+v, %v (runs %d); want the saved error, no second run", res, err, runs)
	}
}

// A claim made WithoutSession outlives its process's session, and goes
// stale only at its deadline.
func TestClaimWithoutSession(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	if _, _, err := a.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithoutSession()); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("WithoutSession without a deadline = %v; want ErrInvalidArgument", err)
	}
	c, _, err := a.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithoutSession(), WithDeadline(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	a.Close() // its session is revoked
	if _, _, err := b.Claim(ctx, Key{ID: "k"}, fpOf(t, "p")); !errors.Is(err, ErrConflict) {
		t.Fatalf("claim after the maker's session ended = %v; want ErrConflict until the deadline", err)
	}
	remote, err := b.Attach(ctx, c.Handle())
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Renew(ctx, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	n, _, err := b.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithWait())
	if err != nil || !n.TookOver() {
		t.Fatalf("claim after the deadline = %v; want a takeover", err)
	}
	n.Release(ctx)
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
