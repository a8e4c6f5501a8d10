package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/storex"
)

// armedView is a clock view that reports each timer armed on it (a
// scheduler's loop going to sleep), so a test moves the fake clock only
// once the scheduler waits on it.
type armedView struct {
	clock.Clock
	armed chan time.Duration
}

func newArmedView(c clock.Clock) armedView {
	return armedView{Clock: c, armed: make(chan time.Duration, 1024)}
}

func (v armedView) AfterFunc(d time.Duration, f func()) func() bool {
	stop := v.Clock.AfterFunc(d, f)
	select {
	case v.armed <- d:
	default:
	}
	return stop
}

// waitArmed waits until the view armed a timer (the scheduler sleeps).
func (v armedView) waitArmed(t *testing.T) {
	t.Helper()
	select {
	case <-v.armed:
	case <-time.After(30 * time.Second):
		t.Fatal("the scheduler never went to sleep")
	}
}

// cursorHistory returns every value schedule name's cursor took since etcd
// revision from, in order (replayed on a Watch from that revision).
func cursorHistory(t *testing.T, q *Queue, name string, from int64) []cursorValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli := cluster.MustClient(t)
	key := q.store.Prefix() + "j/" + cursorName(q.tenant, name)
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("cursor %s: %v %v", key, resp, err)
	}
	lastMod := resp.Kvs[0].ModRevision
	var out []cursorValue
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(from)) {
		if err := wr.Err(); err != nil {
			t.Fatal(err)
		}
		for _, ev := range wr.Events {
			var cv cursorValue
			if err := json.Unmarshal(ev.Kv.Value, &cv); err != nil {
				t.Fatal(err)
			}
			out = append(out, cv)
			if ev.Kv.ModRevision >= lastMod {
				return out
			}
		}
	}
	t.Fatal("cursor history: the watch ended")
	return nil
}

func etcdRevision(t *testing.T) int64 {
	t.Helper()
	resp, err := cluster.MustClient(t).Get(testCtx(t), "/review-rev")
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

func decidedToRun(h []cursorValue, at time.Time) bool {
	for _, cv := range h {
		if cv.Prev.Equal(at) {
			return true
		}
	}
	return false
}

// DEFECT. Docs: under OverlapSkip "the job of an occurrence is created only
// after the job of the occurrence before it ended" (invariant O1), and a
// cursor written by an older version (no overlap fields) still works.
//
// Observed: a cursor from before the policies (or one an allow-all
// scheduler wrote: the same, no Prev) names no occurrence decided to run,
// so the first occurrence after the upgrade (or after switching a schedule
// to skip/buffer-one) is submitted while the previous occurrence's job is
// still queued: two at once.
//
// Cause: prevRunning (jobs/schedule.go:480-483) looks only at cursor.Prev,
// and answers "not running" when it is zero, never at the job of cur.Last
// that an allow-all (or older) scheduler submitted.
func TestReviewSkipOverACursorWithoutPrev(t *testing.T) {
	for _, how := range []string{"older version's cursor", "switched from allow-all"} {
		t.Run(how, func(t *testing.T) {
			ctx := testCtx(t)
			base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
			at := func(m int) time.Time { return base.Add(time.Duration(m) * time.Minute) }
			master := newFakeClock(at(1).Add(10 * time.Second))
			q := newQueue(t, newStore(t, testPrefix(t)))
			q.setClock(master.view(0))
			sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second}
			if how == "older version's cursor" {
				// What the version before the policies wrote: last, kind, spec.
				old := []byte(`{"last":"` + at(1).Format(time.RFC3339) + `","kind":"sync","spec":"every 1m0s"}`)
				if _, ok, err := storex.SetValue(q.store, ctx, cursorName(q.tenant, "sync"), old, 0); err != nil || !ok {
					t.Fatal(ok, err)
				}
				params, _ := sc.params(at(1))
				if _, err := q.Submit(ctx, OccurrenceID("sync", at(1)), "sync", params, RunAt(at(1))); err != nil {
					t.Fatal(err)
				}
			} else {
				master.set(at(0).Add(10 * time.Second))
				av0 := newArmedView(master.view(0))
				q.setClock(av0)
				s, err := NewScheduler(q, []Schedule{sc}) // allow-all
				if err != nil {
					t.Fatal(err)
				}
				waitCursor(t, q, "sync")
				av0.waitArmed(t)
				master.set(at(1).Add(10 * time.Second))
				waitExists(t, q, OccurrenceID("sync", at(1)))
				waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(1)) })
				s.Close()
			}
			// Occurrence 1's job is queued: no worker runs it; it has not ended.
			sc.Overlap = OverlapSkip
			av := newArmedView(master.view(0))
			q.setClock(av)
			s, err := NewScheduler(q, []Schedule{sc})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			av.waitArmed(t)
			master.set(at(2).Add(5 * time.Second))
			cv := waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(2)) })
			if j, err := q.Get(ctx, OccurrenceID("sync", at(1))); err != nil || j.State.Final() {
				t.Fatalf("occurrence 1's job: %+v, %v; want it not ended", j, err)
			}
			if cv.Prev.Equal(at(2)) {
				waitExists(t, q, OccurrenceID("sync", at(2)))
				t.Fatalf("under OverlapSkip, occurrence 2 was decided to run (cursor %+v) and submitted while occurrence 1's job is still queued", cv)
			}
		})
	}
}

// skipCounter counts the occurrences the schedulers log as skipped missed
// ones.
type skipCounter struct {
	mu      sync.Mutex
	skipped int64
	logs    int
}

func (c *skipCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *skipCounter) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c *skipCounter) WithGroup(string) slog.Handler            { return c }
func (c *skipCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "idem: schedule: skipped missed occurrences" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "skipped" {
			c.mu.Lock()
			c.skipped += a.Value.Int64()
			c.logs++
			c.mu.Unlock()
		}
		return true
	})
	return nil
}

func (c *skipCounter) get() (int64, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.skipped, c.logs
}

// DEFECT (for skip and buffer-one; allow-all is the regression baseline).
// Docs: missed occurrences skipped by the catch-up policy are "counted and
// logged", the cursor's Last is "the latest occurrence a scheduler handled
// (submitted or skipped)", and catch-up policies combine with the overlap
// policies.
//
// Observed: under OverlapSkip or OverlapBufferOne with CatchUpNone, when
// every due occurrence is a missed one, the cursor is never moved past the
// skipped ones: `idem jobs schedules` shows a stale last occurrence, and
// every later tick plans (and logs, and counts) the same missed
// occurrences as skipped again (twice here; every second while an
// occurrence is buffered).
//
// Cause: Scheduler.tick (jobs/schedule.go:360-366) returns from the
// exclusive branch without advance(ctx, sc, last); exclusive only writes
// Last for occurrences in submit, and plan leaves the skipped missed ones
// out of it.
func TestReviewCatchUpNoneWithOverlapMovesTheCursor(t *testing.T) {
	for _, policy := range []Overlap{OverlapAllowAll, OverlapSkip, OverlapBufferOne} {
		t.Run(policy.String(), func(t *testing.T) {
			ctx := testCtx(t)
			base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
			at := func(m int) time.Time { return base.Add(time.Duration(m) * time.Minute) }
			master := newFakeClock(at(10).Add(30 * time.Second))
			counter := &skipCounter{}
			q := newQueue(t, newStore(t, testPrefix(t)), WithLogger(slog.New(counter)))
			av := newArmedView(master.view(0))
			q.setClock(av)
			sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second,
				CatchUp: CatchUpNone, Overlap: policy}
			// The cursor as schedulers left it before an outage of ten
			// minutes.
			cv := cursorValue{Last: base}
			sc2 := sc
			if err := sc2.validate(q.store.Retention()); err != nil {
				t.Fatal(err)
			}
			cv.describe(&sc2)
			b, _ := json.Marshal(cv)
			if _, ok, err := storex.SetValue(q.store, ctx, cursorName(q.tenant, "sync"), b, 0); err != nil || !ok {
				t.Fatal(ok, err)
			}
			s, err := NewScheduler(q, []Schedule{sc})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			av.waitArmed(t) // first tick done: occurrences 1 to 10 missed, skipped
			if n, _ := counter.get(); n != 10 {
				t.Fatalf("first tick logged %d skipped; want 10", n)
			}
			infos, err := Schedules(ctx, &q.store.Admin, q.tenant)
			if err != nil {
				t.Fatal(err)
			}
			staleLast := infos[0].Last
			master.set(at(11).Add(5 * time.Second))
			waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(11)) })
			waitExists(t, q, OccurrenceID("sync", at(11)))
			if n, logs := counter.get(); n != 10 || !staleLast.Equal(at(10)) {
				t.Fatalf("missed occurrences 1-10 logged as skipped %d times in %d logs (want 10 in 1); the cursor after the first tick said last=%v (want %v)",
					n, logs, staleLast, at(10))
			}
		})
	}
}

// Regression: a decided occurrence whose scheduler died before submitting
// it is submitted by the next tick of any scheduler; under skip it then
// holds the schedule.
func TestReviewDecidedButNotSubmittedIsSubmitted(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	at := func(m int) time.Time { return base.Add(time.Duration(m) * time.Minute) }
	master := newFakeClock(at(1).Add(10 * time.Second))
	q := newQueue(t, newStore(t, testPrefix(t)))
	av := newArmedView(master.view(0))
	q.setClock(av)
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second, Overlap: OverlapSkip}
	sc2 := sc
	if err := sc2.validate(q.store.Retention()); err != nil {
		t.Fatal(err)
	}
	cv := cursorValue{Last: at(1), Prev: at(1)}
	cv.describe(&sc2)
	b, _ := json.Marshal(cv)
	if _, ok, err := storex.SetValue(q.store, ctx, cursorName(q.tenant, "sync"), b, 0); err != nil || !ok {
		t.Fatal(ok, err)
	}
	s, err := NewScheduler(q, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitExists(t, q, OccurrenceID("sync", at(1)))
	av.waitArmed(t)
	master.set(at(2).Add(5 * time.Second))
	cur := waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(2)) })
	if !cur.Prev.Equal(at(1)) || exists(t, q, OccurrenceID("sync", at(2))) {
		t.Fatalf("cursor %+v: occurrence 2 came while 1 was queued; want it skipped", cur)
	}
}

// Regression: a stalled scheduler's submission of an occurrence decided at
// a cursor revision the cursor has left is refused (ErrValueChanged), and
// writes nothing.
func TestReviewStaleDecisionIsFenced(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base.Add(2 * time.Minute))
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second, Overlap: OverlapSkip}
	if err := sc.validate(q.store.Retention()); err != nil {
		t.Fatal(err)
	}
	s := &Scheduler{q: q}
	cv := cursorValue{Last: base.Add(time.Minute), Prev: base.Add(time.Minute)}
	r1, err := s.setCursor(ctx, &sc, 0, cv)
	if err != nil || r1 == 0 {
		t.Fatal(r1, err)
	}
	cv.Last, cv.Prev = base.Add(2*time.Minute), base.Add(2*time.Minute)
	if r2, err := s.setCursor(ctx, &sc, r1, cv); err != nil || r2 == 0 {
		t.Fatal(r2, err)
	}
	err = s.submit(ctx, &sc, base.Add(time.Minute), &cursorFence{rev: r1, cur: cursorValue{Last: base.Add(time.Minute), Prev: base.Add(time.Minute)}})
	if !errors.Is(err, storex.ErrValueChanged) || exists(t, q, OccurrenceID("sync", base.Add(time.Minute))) {
		t.Fatalf("late submit of a stale decision = %v, job exists %v; want ErrValueChanged and no job", err, exists(t, q, OccurrenceID("sync", base.Add(time.Minute))))
	}
}

// Regression: a parked previous job holds a skip schedule.
func TestReviewParkedPreviousHoldsTheSchedule(t *testing.T) {
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	at := func(m int) time.Time { return base.Add(time.Duration(m) * time.Minute) }
	master := newFakeClock(at(0).Add(10 * time.Second))
	q := newQueue(t, newStore(t, testPrefix(t)))
	av := newArmedView(master.view(0))
	q.setClock(av)
	k := Kind{Name: "sync", MaxAttempts: 1, Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		return nil, errors.New("broken")
	}}}}
	wq := newQueue(t, newStore(t, q.store.Prefix()))
	wq.setClock(master.view(0))
	newWorker(t, wq, []Kind{k})
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second, Overlap: OverlapSkip}
	s, err := NewScheduler(q, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitCursor(t, q, "sync")
	av.waitArmed(t)
	master.set(at(1).Add(5 * time.Second))
	waitExists(t, q, OccurrenceID("sync", at(1)))
	if j := waitJob(t, q, OccurrenceID("sync", at(1))); j.State != Parked {
		t.Fatalf("job 1: %v; want parked", j.State)
	}
	for m := 2; m <= 3; m++ {
		master.set(at(m).Add(5 * time.Second))
		cv := waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(m)) })
		if !cv.Prev.Equal(at(1)) || exists(t, q, OccurrenceID("sync", at(m))) {
			t.Fatalf("cursor %+v: occurrence %d ran while 1 is parked", cv, m)
		}
	}
}

// Regression: Backfill's refusals write nothing.
func TestReviewBackfillRefusalsWriteNothing(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base.Add(6 * time.Hour))
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	sc := Schedule{Name: "tick", Every: time.Second, Kind: "tick"}
	half := q.store.Retention() / 2
	now := master.view(0).Now()
	for name, r := range map[string][2]time.Time{
		"over MaxBackfill": {base, base.Add(MaxBackfill * time.Second)}, // 10,001 occurrences
		"future":           {base, now.Add(time.Second)},
		"reversed":         {base.Add(time.Minute), base},
		"too old":          {now.Add(-half - time.Second), base},
	} {
		n, err := q.Backfill(ctx, sc, r[0], r[1])
		if !errors.Is(err, ErrInvalid) || n != 0 {
			t.Errorf("Backfill %s = %d, %v; want ErrInvalid", name, n, err)
		}
	}
	for _, at := range []time.Time{base, base.Add(time.Second), base.Add(time.Minute), now.Add(-half)} {
		if exists(t, q, OccurrenceID("tick", at)) {
			t.Fatalf("a refused backfill submitted %v", at)
		}
	}
	// Exactly at the retention bound, a single occurrence: accepted, once.
	if n, err := q.Backfill(ctx, sc, now.Add(-half), now.Add(-half)); err != nil || n != 1 {
		t.Fatalf("Backfill of one occurrence at the bound = %d, %v", n, err)
	}
	if n, err := q.Backfill(ctx, sc, now.Add(-half), now.Add(-half)); err != nil || n != 0 {
		t.Fatalf("Backfill again = %d, %v; want 0", n, err)
	}
}

// Regression (explorer seed 1796408677881101843): a buffered occurrence
// promoted to Prev long after its own time (the schedule was paused for
// longer than the retention) and not yet submitted is not taken for
// forgotten: it was decided at PrevAt, and its job is absent because its
// scheduler has not submitted it yet. The next tick submits it and counts
// it as running, so the occurrence after it waits.
func TestReviewPromotedBufferedOccurrenceIsNotForgotten(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	now := base.Add(q.retention() + time.Hour)
	q.setClock(newFakeClock(now).view(0))
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second, Overlap: OverlapBufferOne}
	if err := sc.validate(q.store.Retention()); err != nil {
		t.Fatal(err)
	}
	s := &Scheduler{q: q}
	cv := cursorValue{Last: now.Add(-time.Minute), Prev: base, PrevAt: now.Add(-time.Minute)}
	rev, err := s.setCursor(ctx, &sc, 0, cv)
	if err != nil || rev == 0 {
		t.Fatal(rev, err)
	}
	running, undecided, err := s.prevRunning(ctx, &sc, cv, rev, now)
	if err != nil {
		t.Fatal(err)
	}
	if !running || undecided || !exists(t, q, OccurrenceID("sync", base)) {
		t.Fatalf("promoted occurrence a minute after its promotion, its job absent: running=%v undecided=%v submitted=%v; want it submitted and running",
			running, undecided, exists(t, q, OccurrenceID("sync", base)))
	}
}
