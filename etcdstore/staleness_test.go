package etcdstore

import (
	"errors"
	"sync"
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
		if _, err := cli.Revoke(ctx, s.sessionLeaseID()); err != nil {
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
