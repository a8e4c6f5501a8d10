package jobs

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// Issue 38: a kind's Limit key function that panicked on one job's
// parameters crashed every process running that kind's completer, again at
// each restart. Now that job fails, with an error naming the function and
// the panic, and the worker runs the others.
func TestALimitKeyThatPanicsFailsItsJobAlone(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	var runs atomic.Int32
	key := func(params []byte) (string, error) {
		if strings.Contains(string(params), "poison") {
			panic("no merchant in " + string(params))
		}
		return ParamKey("merchant")(params)
	}
	k := Kind{Name: "charge", Limits: []Limit{{Name: "merchant", Key: key, Concurrency: 1}},
		Steps: []Step{{Name: "charge", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			runs.Add(1)
			return nil, nil
		}}}}
	newWorker(t, q, []Kind{k}, Concurrency(2))
	ctx := testCtx(t)
	if _, err := q.Submit(ctx, "bad", "charge", []byte(`{"poison":true}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Submit(ctx, "good", "charge", []byte(`{"merchant":"m1"}`)); err != nil {
		t.Fatal(err)
	}
	if j := waitJob(t, q, "good"); j.State != Succeeded || runs.Load() != 1 {
		t.Fatalf("the good job = %s after %d runs; want it run once", j.State, runs.Load())
	}
	j := waitJob(t, q, "bad")
	if j.State != Failed || !strings.Contains(j.Err, "Key function panicked") || !strings.Contains(j.Err, "no merchant") {
		t.Fatalf("the poisoned job = %s %q; want failed with the panic named", j.State, j.Err)
	}
}

// A schedule's Params function that panics skips that occurrence (the
// error names the function), never the process: Backfill says so, and the
// scheduler goes on to the next occurrence.
func TestAParamsFunctionThatPanicsSkipsItsOccurrence(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base.Add(time.Hour))
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	poisoned := base.Add(2 * time.Minute)
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Params: func(at time.Time) []byte {
		if at.Equal(poisoned) {
			panic("no params for " + at.String())
		}
		return []byte(`{}`)
	}}
	n, err := q.Backfill(ctx, sc, base.Add(time.Minute), base.Add(3*time.Minute))
	if n != 1 || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "Params function panicked") {
		t.Fatalf("Backfill over a panicking occurrence = %d, %v; want 1 submitted, then an error naming the function", n, err)
	}
	// The scheduler: the poisoned occurrence is skipped, the next one is
	// submitted.
	sched := Schedule{Name: "tick", Every: time.Minute, Kind: "sync", Lateness: 30 * time.Second, MaxSkew: time.Second,
		Params: func(at time.Time) []byte {
			if at.Equal(base.Add(62 * time.Minute)) {
				panic("poisoned occurrence")
			}
			return []byte(`{}`)
		}}
	s, err := NewScheduler(q, []Schedule{sched})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	waitCursor(t, q, sched.Name)
	for m := 61; m <= 63; m++ {
		master.set(base.Add(time.Duration(m)*time.Minute + time.Second))
		if m != 62 {
			waitExists(t, q, OccurrenceID(sched.Name, base.Add(time.Duration(m)*time.Minute)))
		}
	}
	if exists(t, q, OccurrenceID(sched.Name, base.Add(62*time.Minute))) {
		t.Fatal("the occurrence whose Params panicked was submitted")
	}
}

// A kind whose declared sleep or await is past half the retention is
// refused when it is registered, not when each of its jobs reaches the
// step.
func TestAKindThatWaitsPastTheRetentionIsRefusedAtRegistration(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t), etcdstore.WithRetention(time.Hour)))
	for _, step := range []Step{SleepStep("nap", 31*time.Minute), AwaitStep("approval", "approved", 45*time.Minute, Fail)} {
		_, err := NewWorker(q, []Kind{{Name: "k", Steps: []Step{step}}})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "step "+step.Name+" waits") {
			t.Errorf("NewWorker with step %s = %v; want ErrInvalid naming the step and its wait", step.Name, err)
		}
	}
	w, err := NewWorker(q, []Kind{{Name: "k", Steps: []Step{SleepStep("nap", 29*time.Minute)}}})
	if err != nil {
		t.Fatalf("a sleep within half the retention = %v", err)
	}
	w.Close()
}

// Issue 38: a schedule created now submitted at once every occurrence of
// the MaxSkew window before it existed (an every-10-seconds schedule, 30
// jobs at its first tick). Its first occurrence is its first one after it
// was created.
func TestANewScheduleDoesNotRunItsPast(t *testing.T) {
	base := time.Date(2026, 12, 2, 3, 0, 5, 0, time.UTC)
	master := newFakeClock(base)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	sc := Schedule{Name: "often", Every: 10 * time.Second, Kind: "k"}
	s, err := NewScheduler(q, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	waitCursor(t, q, sc.Name)
	first := base.Truncate(10 * time.Second).Add(10 * time.Second)
	master.set(first.Add(time.Second))
	waitExists(t, q, OccurrenceID(sc.Name, first))
	jobs, err := q.List(testCtx(t), ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 1 {
		var ids []string
		for _, j := range jobs {
			ids = append(ids, j.Key.ID)
		}
		t.Fatalf("a new schedule submitted %d jobs at its first occurrence: %v; want only %s", len(jobs), ids, OccurrenceID(sc.Name, first))
	}
}

// Issue 38: after an outage, every occurrence of the last MaxSkew (5
// minutes by default) counted as on time, on top of CatchUp: a schedule
// every second submitted ~300 jobs when its scheduler came back. CatchUp
// is the one rule for the past: CatchUpLatest runs the latest missed
// occurrence and what is on time, nothing else.
func TestAnOutageRunsOnlyWhatCatchUpSays(t *testing.T) {
	base := time.Date(2026, 12, 2, 3, 0, 0, 500_000_000, time.UTC)
	master := newFakeClock(base)
	prefix := testPrefix(t)
	sc := Schedule{Name: "every-second", Every: time.Second, Kind: "k"} // CatchUpLatest, MaxSkew 5 min
	start := func() *Scheduler {
		q := newQueue(t, newStore(t, prefix, etcdstore.WithRetention(time.Hour)))
		q.setClock(master.view(0))
		s, err := NewScheduler(q, []Schedule{sc})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	q := newQueue(t, newStore(t, prefix, etcdstore.WithRetention(time.Hour)))
	s := start()
	waitCursor(t, q, sc.Name)
	first := base.Truncate(time.Second).Add(time.Second)
	master.set(first.Add(100 * time.Millisecond))
	waitExists(t, q, OccurrenceID(sc.Name, first))
	s.Close()
	// Down for 20 minutes; then a scheduler comes back.
	back := first.Add(20 * time.Minute)
	master.set(back.Add(100 * time.Millisecond))
	start()
	waitExists(t, q, OccurrenceID(sc.Name, back))
	waitCursorWhere(t, q, sc.Name, func(cv cursorValue) bool { return !cv.Last.Before(back) })
	all, err := q.List(testCtx(t), ListOptions{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, j := range all {
		ids = append(ids, j.Key.ID)
	}
	// The first occurrence; then the latest missed one (back-1s, late by
	// more than Lateness, 1 s) and back itself, on time.
	want := []string{OccurrenceID(sc.Name, first), OccurrenceID(sc.Name, back.Add(-time.Second)), OccurrenceID(sc.Name, back)}
	slices.Sort(want)
	slices.Sort(ids)
	if !slices.Equal(ids, want) {
		t.Fatalf("after a 20-minute outage, an every-second schedule submitted %d jobs (%v...); want %v", len(ids), ids[:min(len(ids), 5)], want)
	}
}

// The outage rule needs the cursor's write time to be the last write's: a
// fleet that runs writes the cursor at every occurrence it handles, so a
// cursor written long ago says that no scheduler ran (an old one would
// make a fast scheduler take a running fleet for an outage).
func TestTheCursorSaysWhenASchedulerLastWroteIt(t *testing.T) {
	base := time.Date(2026, 12, 2, 3, 0, 0, 500_000_000, time.UTC)
	master := newFakeClock(base)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	sc := Schedule{Name: "often", Every: 10 * time.Second, Kind: "k"}
	s, err := NewScheduler(q, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	made := waitCursorWhere(t, q, sc.Name, func(cursorValue) bool { return true })
	if !made.At.Equal(base) {
		t.Fatalf("a new cursor says it was written at %v; want %v, its scheduler's clock", made.At, base)
	}
	for i := 1; i <= 3; i++ {
		occ := base.Truncate(10 * time.Second).Add(time.Duration(i) * 10 * time.Second)
		now := occ.Add(200 * time.Millisecond)
		master.set(now)
		cv := waitCursorWhere(t, q, sc.Name, func(cv cursorValue) bool { return !cv.Last.Before(occ) })
		if !cv.At.Equal(now) {
			t.Fatalf("after occurrence %v the cursor says it was written at %v; want %v, when its scheduler moved it", occ, cv.At, now)
		}
	}
}

// Issue 38: the same signal sent with its JSON in another spelling
// (member order, spacing, 2.0 for 2) was refused as another payload,
// though job parameters are compared canonically.
func TestASignalInAnotherJSONSpellingIsTheSameSignal(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	if _, err := q.Submit(ctx, "refund-1", "k", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	if err := q.Signal(ctx, "refund-1", "approved", []byte(`{"by":"ada","amount":2}`)); err != nil {
		t.Fatal(err)
	}
	if err := q.Signal(ctx, "refund-1", "approved", []byte("{ \"amount\": 2.0,\n  \"by\": \"ada\" }")); err != nil {
		t.Fatalf("the same signal in another spelling = %v; want it taken as the same", err)
	}
	if err := q.Signal(ctx, "refund-1", "approved", []byte(`{"by":"bob","amount":2}`)); !errors.Is(err, ErrSignalMismatch) {
		t.Fatalf("another payload = %v; want ErrSignalMismatch", err)
	}
}

// Issue 38: package jobs logged nothing unless WithLogger was set, so
// failures and skips that are "counted and logged" were silent. It logs
// through the process's logger (slog.Default) by default.
func TestJobsLogThroughTheProcesssLogger(t *testing.T) {
	var buf syncBuf
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	defer slog.SetDefault(old)
	q := newQueue(t, newStore(t, testPrefix(t)))
	key := func([]byte) (string, error) { return "", errors.New("no merchant") }
	k := Kind{Name: "charge", Limits: []Limit{{Name: "merchant", Key: key, Concurrency: 1}},
		Steps: []Step{{Name: "s", Run: func(context.Context, *Run) ([]byte, error) { return nil, nil }}}}
	newWorker(t, q, []Kind{k})
	if _, err := q.Submit(testCtx(t), "j", "charge", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	if j := waitJob(t, q, "j"); j.State != Failed {
		t.Fatalf("job = %s; want failed", j.State)
	}
	if got := buf.String(); !strings.Contains(got, "job failed: its limits") {
		t.Fatalf("the process's logger got %q; want the job's failure logged", got)
	}
}

// syncBuf is a bytes.Buffer safe for the loggers of several goroutines.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) { s.mu.Lock(); defer s.mu.Unlock(); return s.b.Write(p) }
func (s *syncBuf) String() string              { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// Issue 38: refusing a non-ASCII name quoted a character that was not
// sent (the first byte of "é" as 'Ã').
func TestARefusedNameQuotesTheCharacterSent(t *testing.T) {
	err := validName("apprové", 64, true)
	if err == nil || !strings.Contains(err.Error(), "'é'") || strings.Contains(err.Error(), "Ã") {
		t.Fatalf("validName(apprové) = %v; want the character é named", err)
	}
	if err := validName("a\xffb", 64, true); err == nil || !strings.Contains(err.Error(), "0xff") {
		t.Fatalf("validName of a byte that is not UTF-8 = %v; want the byte named", err)
	}
}
