package jobs

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// decideAndSubmit makes occurrence at the cursor's Prev, decided at its
// own time, and submits its job fenced on the cursor, as exclusive does.
func decideAndSubmit(t *testing.T, s *Scheduler, sc *Schedule, at time.Time) {
	t.Helper()
	ctx := testCtx(t)
	cv := cursorValue{Last: at, Prev: at, PrevAt: at}
	rev, err := s.setCursor(ctx, sc, 0, cv)
	if err != nil || rev == 0 {
		t.Fatal(rev, err)
	}
	if err := s.submit(ctx, sc, at, &cursorFence{rev, cv}); err != nil {
		t.Fatal(err)
	}
}

// Regression (review): under skip, a scheduler whose clock finds the
// previous occurrence's job past its retention takes it for ended and
// decides the next occurrence. A worker whose clock is behind (within
// MaxSkew) read the same record live; its takeover compares only the
// record's revision, and used to land after the decision, running the
// forgotten job beside the next one. The scheduler now deletes the
// expired record (if still as read) before it decides: the takeover finds
// nothing.
func TestReviewForgottenJobIsNotTakenOverBesideTheNext(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base)
	const skew = 2 * time.Second
	fast := newStore(t, prefix, etcdstore.WithRetention(time.Minute), etcdstore.WithClock(master.view(skew/2)))
	slow := newStore(t, prefix, etcdstore.WithRetention(time.Minute), etcdstore.WithClock(master.view(-skew/2)))
	qF := newQueue(t, fast)
	sc := Schedule{Name: "sync", Every: 10 * time.Second, Kind: "sync", Lateness: 5 * time.Second, MaxSkew: skew, Overlap: OverlapSkip}
	if err := sc.validate(time.Minute); err != nil {
		t.Fatal(err)
	}
	sF := &Scheduler{q: qF}
	t1 := base
	decideAndSubmit(t, sF, &sc, t1)
	id1 := OccurrenceID("sync", t1)
	// Nobody took it for its retention: past it on F's clock, not on W's.
	master.set(base.Add(time.Minute + 1500*time.Millisecond))
	rec, err := slow.Get(ctx, qF.Key(id1))
	if err != nil {
		t.Fatalf("setup: the slow clock finds job 1 gone: %v", err)
	}
	if exists(t, qF, id1) {
		t.Fatalf("setup: the fast clock finds job 1 live")
	}
	now := qF.clock.Now()
	cur, rev, err := sF.cursor(ctx, &sc, now)
	if err != nil {
		t.Fatal(err)
	}
	t2 := base.Add(time.Minute)
	if _, moved, err := sF.exclusive(ctx, &sc, cur, rev, []time.Time{t2}, t2, now); err != nil || moved {
		t.Fatal(moved, err)
	}
	if !exists(t, qF, OccurrenceID("sync", t2)) {
		t.Fatalf("setup: occurrence 2 was not decided to run")
	}
	// W's completer claims job 1 as Worker.execute does.
	ran := false
	_, err = slow.Run(ctx, rec.Key, rec.Fingerprint, func(ctx context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		ran = true
		return etcdstore.Outcome{}, etcdstore.EndAbandon
	}, storex.WithoutCreate())
	if ran || !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("a takeover of job 1 read live before occurrence 2 was decided: ran=%v err=%v; want it refused (etcdstore.ErrNotFound), job 1 never run beside occurrence 2", ran, err)
	}
}

// Regression (review): a job ended by a process whose store keeps records
// for less time than the scheduler's is gone (swept) before the
// scheduler's retention has passed. The scheduler took "absent" for
// "decided but never submitted" and submitted the ended occurrence again:
// it ran twice. The submission now marks the cursor (Submitted) in the
// job's own transaction, and a job the cursor says was submitted is never
// submitted again.
func TestReviewEndedOccurrenceGoneEarlyIsNotSubmittedAgain(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base)
	long := newStore(t, prefix, etcdstore.WithRetention(time.Minute), etcdstore.WithClock(master.view(0)))
	short := newStore(t, prefix, etcdstore.WithRetention(2*time.Second), etcdstore.WithClock(master.view(0)))
	qL, qS := newQueue(t, long), newQueue(t, short)
	sc := Schedule{Name: "sync", Every: 10 * time.Second, Kind: "sync", Lateness: 5 * time.Second, MaxSkew: time.Second, Overlap: OverlapSkip}
	if err := sc.validate(time.Minute); err != nil {
		t.Fatal(err)
	}
	sL := &Scheduler{q: qL}
	t1 := base
	decideAndSubmit(t, sL, &sc, t1)
	id1 := OccurrenceID("sync", t1)
	j, err := qS.Cancel(ctx, id1, "ended")
	if err != nil || !j.State.Final() {
		t.Fatal(j, err)
	}
	// Its 2 s pass and its record is swept (its lease ends).
	master.set(base.Add(3 * time.Second))
	ended, err := storex.Peek(&long.Admin, ctx, qL.Key(id1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := long.EvictIf(ctx, ended.Key, ended.Revision); err != nil {
		t.Fatal(err)
	}
	now := qL.clock.Now()
	cur, rev, err := sL.cursor(ctx, &sc, now)
	if err != nil {
		t.Fatal(err)
	}
	running, _, err := sL.prevRunning(ctx, &sc, cur, rev, now)
	if err != nil {
		t.Fatal(err)
	}
	if j, err := qL.Get(ctx, id1); err == nil || running {
		t.Fatalf("occurrence 1 ended (cancelled) and gone: running=%v, its job %+v; want it not submitted again", running, j)
	}
}
