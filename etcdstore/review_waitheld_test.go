package etcdstore

import (
	"context"
	"errors"
	"testing"
	"time"
)

// BUG (Store.Wait re-derives a record's meaning instead of asking the
// kernel, and disagrees with it): Wait returns an in-flight record as
// stale as soon as its deadline passed (wait.go: `case cur.State == Done,
// cur.Owner == "", cur.pastDeadline(now): return cur`), before it asks
// whether this very process holds the attempt. The kernel orders these
// the other way (decision table C8 before C9: "in flight under another
// attempt this process holds (runs it, or holds its outcome while saving
// it): conflict (or wait, WithWait): its owner is alive by definition";
// claim.go: "Its owner is alive by definition, whatever its session or
// deadline"). Wait's godoc promises that a stale record it returns is one
// to "claim the key to take it over"; here a claim from the same store
// answers ErrConflict, so a caller that loops Wait -> Claim spins (Wait
// returns at once every time) while the work still runs here.
func TestReviewWaitAgreesWithClaimOnAClaimHeldHerePastItsDeadline(t *testing.T) {
	clk := newShiftClock()
	s := newStore(t, client(t), testPrefix(t), WithClock(clk))
	ctx := testCtx(t)
	key, fp := Key{ID: "k"}, fpOf(t, "p")

	held, _, err := s.Claim(ctx, key, fp, WithDeadline(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(ctx)
	clk.Shift(2 * time.Second) // its deadline has passed; its work still runs here

	wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	rec, werr := s.Wait(wctx, key)
	if werr != nil {
		if errors.Is(werr, context.DeadlineExceeded) {
			return // Wait keeps waiting, as a claim would conflict: consistent
		}
		t.Fatalf("Wait: %v", werr)
	}
	_, _, cerr := s.Claim(ctx, key, fp)
	if errors.Is(cerr, ErrConflict) {
		t.Fatalf("Wait returned the record as stale (state %s, deadline %v passed, owner %s), "+
			"but a claim of it from the same store answers %v: the kernel holds a claim this process "+
			"runs alive whatever its deadline", rec.State, rec.Deadline, rec.Owner, cerr)
	}
}
