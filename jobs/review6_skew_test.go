package jobs

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
)

// Promise (JOBS.md, Schedule.MaxSkew; kernel.Plan.AfterOutage): "While a
// schedule runs, a scheduler counts an occurrence as missed only once it
// is late by more than Lateness plus MaxSkew on its own clock, so one whose
// clock runs ahead never skips, for the fleet, an occurrence the others
// would submit on time"; the outage rule applies only when "the first
// occurrence after the cursor was missed by every clock within MaxSkew: no
// scheduler ran". The outage test compares the first occurrence with
// now-Lateness-MaxSkew on the looking scheduler's clock: a clock MaxSkew
// ahead takes a fleet that is 2 s late (an etcd election, a GC pause) for
// an outage, and skips every occurrence up to now-Lateness on its own
// clock: those the fleet would run on time, and 5 minutes of occurrences
// whose time has not come yet.
func TestReview6AFastClockSkipsNothingTheFleetRunsOnTime(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	sc := Schedule{Name: "s", Every: time.Second, Kind: "k"} // Lateness 1 s, MaxSkew 5 min, CatchUpLatest
	if err := sc.validate(24 * time.Hour); err != nil {
		t.Fatal(err)
	}
	// The cursor is at t0; real time is t0+3s (the fleet's tick is 2 s
	// late). A scheduler on time submits t0+1s..t0+3s, none skipped.
	real := t0.Add(3 * time.Second)
	onTime, _, skipped, _ := sc.plan(t0, real, 24*time.Hour)
	if skipped != 0 || len(onTime) != 3 {
		t.Fatalf("the scheduler on time: submit %v, skip %d", onTime, skipped)
	}
	// The same instant on a clock MaxSkew ahead (what the schedule allows).
	fast, _, fskipped, _ := sc.plan(t0, real.Add(sc.MaxSkew), 24*time.Hour)
	var lost []time.Time
	for _, o := range onTime {
		if !slices.ContainsFunc(fast, o.Equal) {
			lost = append(lost, o)
		}
	}
	if len(lost) > 0 {
		t.Fatalf("a scheduler %v ahead skips %d occurrences (submits %d: %v); the scheduler on time submits %v as on time, and it skips %v",
			sc.MaxSkew, fskipped, len(fast), fast, onTime, lost)
	}
}

// The same with real etcd and two running schedulers: S1 on time, whose
// tick is held up 2 s by its etcd link; S2, whose clock is MaxSkew ahead,
// starts meanwhile. S2 takes the fleet's 2 s delay for an outage and moves
// the cursor 5 minutes on, skipping the occurrences S1 would have
// submitted on time (and ~300 that have not happened yet).
func TestReview6AFastSchedulerJoiningARunningFleetSkipsNothing(t *testing.T) {
	prefix := testPrefix(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 500_000_000, time.UTC)
	master := newFakeClock(base)
	sc := Schedule{Name: "every-second", Every: time.Second, Kind: "k"} // Lateness 1 s, MaxSkew 5 min, CatchUpLatest
	p, err := etcdtest.NewProxy(strings.TrimPrefix(cluster.Members[0].ClientURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	q1 := newQueue(t, newStoreOn(t, cluster.MustClient(t, p.URL()), prefix))
	q1.setClock(master.view(0))
	s1, err := NewScheduler(q1, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s1.Close() })
	q := newQueue(t, newStore(t, prefix)) // an observer
	waitCursor(t, q, sc.Name)
	first := base.Truncate(time.Second).Add(time.Second)
	master.set(first.Add(100 * time.Millisecond))
	waitExists(t, q, OccurrenceID(sc.Name, first))
	waitCursorWhere(t, q, sc.Name, func(cv cursorValue) bool { return !cv.Last.Before(first) })
	// S1's etcd link stalls; two seconds pass.
	p.Hold()
	defer p.Heal() // before the schedulers and stores close
	master.set(first.Add(2*time.Second + 100*time.Millisecond))
	before := p.Forwarded.Load()
	q2 := newQueue(t, newStore(t, prefix))
	const skew = 5 * time.Minute // MaxSkew's default: within what the schedule allows
	q2.setClock(master.view(skew))
	s2, err := NewScheduler(q2, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s2.Close() })
	cv := waitCursorWhere(t, q, sc.Name, func(cv cursorValue) bool { return cv.Last.After(first) })
	// S1 still waits for etcd: whatever was submitted, S2 submitted.
	var missing []string
	for _, o := range []time.Time{first.Add(time.Second), first.Add(2 * time.Second)} {
		if !exists(t, q, OccurrenceID(sc.Name, o)) {
			missing = append(missing, OccurrenceID(sc.Name, o))
		}
	}
	t.Logf("cursor %v; missing %v; forwarded through S1's link while held: %d", cv.Last, missing, p.Forwarded.Load()-before)
	if len(missing) > 0 && cv.Last.After(first.Add(2*time.Second)) {
		t.Fatalf("with the fleet 2 s late, a scheduler %v ahead moved the cursor to %v (real time %v) and never submitted %v, "+
			"which the scheduler on time would submit as on time (late by at most 1.1 s, under Lateness plus MaxSkew)",
			skew, cv.Last, first.Add(2*time.Second+100*time.Millisecond), missing)
	}
}
