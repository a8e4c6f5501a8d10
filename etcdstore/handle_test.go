package etcdstore

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A worker claims through one process and finishes through another.
func TestAttachFromAnotherProcess(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	c, _, err := a.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithDeadline(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	stale := c.Handle()
	if err := c.Checkpoint(ctx, []byte("cp")); err != nil {
		t.Fatal(err)
	}
	// A handle from before a checkpoint (its reply was lost) still names
	// the claim: only this claim writes with its token and attempt.
	if older, err := b.Attach(ctx, stale); err != nil || older.Handle().Revision == stale.Revision {
		t.Fatalf("Attach with a handle from before a checkpoint = %v; want the claim at its current revision", err)
	}
	bad := c.Handle()
	bad.Token++
	if _, err := b.Attach(ctx, bad); !errors.Is(err, ErrFenced) {
		t.Fatalf("Attach with another token = %v; want ErrFenced", err)
	}
	other := c.Handle()
	other.Attempt = "someone-else"
	if _, err := b.Attach(ctx, other); !errors.Is(err, ErrFenced) {
		t.Fatalf("Attach with another attempt = %v; want ErrFenced", err)
	}
	if _, err := b.Attach(ctx, Handle{Key: Key{ID: "k"}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Attach with an empty handle = %v; want ErrInvalidArgument", err)
	}
	h := c.Handle()
	remote, err := b.Attach(ctx, h)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	if remote.Token() != c.Token() || string(remote.LastCheckpoint()) != "cp" || !remote.Deadline().Equal(c.Deadline()) {
		t.Fatalf("attached claim: token %d checkpoint %q deadline %v; want the original's", remote.Token(), remote.LastCheckpoint(), remote.Deadline())
	}
	if err := remote.Complete(ctx, Outcome{Body: []byte("done remotely")}); err != nil {
		t.Fatal(err)
	}
	// The claim has ended; its original handle cannot save another outcome.
	if err := c.Complete(ctx, Outcome{Body: []byte("late")}); !errors.Is(err, ErrClaimEnded) {
		t.Fatalf("original Complete after the remote one = %v; want ErrClaimEnded", err)
	}
	rec, err := a.Get(ctx, Key{ID: "k"})
	if err != nil || string(rec.Outcome.Body) != "done remotely" {
		t.Fatalf("outcome = %+v, %v", rec, err)
	}
}

func TestRenewMovesTheDeadline(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	c, _, err := a.Claim(ctx, key, fpOf(t, "p"), WithDeadline(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Claim(ctx, key, fpOf(t, "p")); !errors.Is(err, ErrConflict) {
		t.Fatalf("before renew: %v; want ErrConflict", err)
	}
	if err := c.Renew(ctx, 50*time.Millisecond); err != nil { // a shorter heartbeat
		t.Fatal(err)
	}
	rec, err := a.Get(ctx, key)
	if err != nil || rec.Deadline.After(time.Now().Add(time.Minute)) {
		t.Fatalf("record deadline %v, %v; want about 50ms from now", rec.Deadline, err)
	}
	<-c.Done()
	if !errors.Is(c.Err(), ErrDeadline) {
		t.Fatalf("cause = %v; want ErrDeadline", c.Err())
	}
	if a.Metrics().Running != 0 {
		t.Fatalf("Running = %d after the deadline; want 0", a.Metrics().Running)
	}
	n, _, err := b.Claim(ctx, key, fpOf(t, "p"))
	if err != nil || !n.TookOver() {
		t.Fatalf("claim after the renewed deadline = %v; want a takeover", err)
	}
	if err := c.Renew(ctx, time.Hour); !errors.Is(err, ErrFenced) {
		t.Fatalf("Renew after a takeover = %v; want ErrFenced", err)
	}
	if err := n.Renew(ctx, 0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Renew(0) = %v; want ErrInvalidArgument", err)
	}
	if err := n.Complete(ctx, Outcome{}); err != nil {
		t.Fatal(err)
	}
}

// Run saves whole outcomes, and ends claims as the work says.
func TestRunEnds(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	fp := fpOf(t, "p")
	out := Outcome{Status: 201, Header: map[string][]string{"Location": {"/charges/1"}}, Body: []byte(`{"id":1}`)}

	res, err := s.Run(ctx, Key{ID: "save"}, fp, func(context.Context, *Claim) (Outcome, End) { return out, EndSave })
	if err != nil || res.Replayed || res.Status != 201 {
		t.Fatalf("Run = %+v, %v", res, err)
	}
	res, err = s.Run(ctx, Key{ID: "save"}, fp, func(context.Context, *Claim) (Outcome, End) {
		t.Fatal("work ran on a replay")
		return Outcome{}, EndSave
	})
	if err != nil || !res.Replayed || res.Status != 201 || res.Header["Location"][0] != "/charges/1" || string(res.Body) != `{"id":1}` {
		t.Fatalf("replay = %+v, %v; want the whole saved outcome", res, err)
	}

	if _, err := s.Run(ctx, Key{ID: "release"}, fp, func(context.Context, *Claim) (Outcome, End) { return Outcome{}, EndRelease }); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, Key{ID: "release"}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after EndRelease: %v; want ErrNotFound", err)
	}
	if _, err := s.Run(ctx, Key{ID: "abandon"}, fp, func(context.Context, *Claim) (Outcome, End) { return Outcome{}, EndAbandon }); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Get(ctx, Key{ID: "abandon"}); err != nil || rec.State != InFlight || rec.Owner != "" {
		t.Fatalf("after EndAbandon: %+v, %v; want an ownerless in-flight record", rec, err)
	}
}

// A claim with a deadline, renewed through another process, is not taken
// over as an orphan by the process that made it once its local copy is gone.
func TestRenewedRemoteClaimIsNotAnOrphan(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	c, _, err := a.Claim(ctx, key, fpOf(t, "p"), WithDeadline(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	a.unregister(c) // A's copy lapsed (say, past the deadline it knew of)
	remote, err := b.Attach(ctx, c.Handle())
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Renew(ctx, time.Hour); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Claim(ctx, key, fpOf(t, "p")); !errors.Is(err, ErrConflict) {
		t.Fatalf("claim in the process that made it = %v; want ErrConflict, the claim is live", err)
	}
	if err := remote.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
}
