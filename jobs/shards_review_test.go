package jobs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/shard"
)

// scheduleNamesOn returns n schedule names (prefix-i) that placement p puts
// on shard want (the key s/<name> of the default tenant).
func scheduleNamesOn(p []string, want, prefix string, n int) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		name := fmt.Sprintf("%s-%d", prefix, i)
		if (shard.Placement{Shards: p}).Place(etcdstore.Key{Tenant: DefaultTenant, ID: "schedule." + name}) == want {
			out = append(out, name)
		}
	}
	return out
}

// scheduleInfo returns schedule name's cursor as shard st holds it.
func scheduleInfo(t *testing.T, st *etcdstore.Store, name string) (ScheduleInfo, bool) {
	t.Helper()
	infos, err := Schedules(testCtx(t), &st.Admin, DefaultTenant)
	if err != nil {
		t.Fatal(err)
	}
	for _, si := range infos {
		if si.Name == name {
			return si, true
		}
	}
	return ScheduleInfo{}, false
}

// occurrences returns the times of schedule name's occurrence jobs, sorted.
func occurrences(t *testing.T, q *Queue, name string) []time.Time {
	t.Helper()
	all, err := q.List(testCtx(t), ListOptions{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var out []time.Time
	for _, j := range all {
		if n, at, ok := strings.Cut(j.Key.ID, "@"); ok && n == name {
			tm, err := time.Parse(time.RFC3339, at)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, tm)
		}
	}
	slices.SortFunc(out, time.Time.Compare)
	return out
}

// DEFECT: a schedule's cursor is carried over to its new shard only while
// the set hands keys over (Queue.cursorStore looks at the old shard only
// while Places says old != home). The drain looks at records, never at
// values, so a shard that holds no job record placed elsewhere is drained
// and the set settled within a check interval, whether or not any
// scheduler has read the cursor meanwhile (a scheduler restarted with the
// new file after the change, a schedule whose program was down). From
// then on the cursor's new home has none: the next scheduler makes a
// fresh one at now - MaxSkew. JOBS.md: "the first scheduler to read it
// under the new set carries it over (...), so that the occurrences missed
// meanwhile are caught up, not skipped"; and a paused schedule stays
// paused "on every scheduler". Here a paused schedule is resumed by the
// set change, and the other schedule's missed occurrences are skipped.
//
// (The occurrences' params are too large to submit, so that they leave
// no job record on a for the drain to wait on: a stand-in for jobs whose
// retention passed. Each occurrence a scheduler submits calls Params: the
// calls are the occurrences submitted.)
func TestReviewCursorNotCarriedOverOnceTheSetSettled(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	set1 := newShardSet(t, prefix, 1, []string{"a"}, nil)
	q1 := newShardQueue(t, set1)
	names := scheduleNamesOn([]string{"a", "b"}, "b", "every", 2)
	paused, running := names[0], names[1]
	var mu sync.Mutex
	calls := map[string][]time.Time{}
	called := func(name string) []time.Time {
		mu.Lock()
		defer mu.Unlock()
		out := slices.Clone(calls[name])
		slices.SortFunc(out, time.Time.Compare)
		return slices.Compact(out)
	}
	mk := func(name string) Schedule {
		return Schedule{Name: name, Kind: "tick", Every: time.Second, CatchUp: CatchUpAll, MaxCatchUp: 100, MaxSkew: 100 * time.Millisecond,
			Params: func(t time.Time) []byte {
				mu.Lock()
				calls[name] = append(calls[name], t)
				mu.Unlock()
				return make([]byte, 2<<20) // too large: never a record
			}}
	}
	s1, err := NewScheduler(q1, []Schedule{mk(paused), mk(running)})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		_, ok := scheduleInfo(t, set1.Shard("a"), paused)
		return ok && len(called(running)) >= 2
	})
	if err := q1.PauseSchedule(ctx, paused, true); err != nil {
		t.Fatal(err)
	}
	pausedAt := time.Now()
	s1.Close()
	closed := time.Now()
	before := called(running)

	// Generation 2 adds b, where both cursors' names are placed. No job
	// record on a is placed elsewhere: a drains and the set settles.
	set2 := newShardSet(t, prefix, 2, []string{"a", "b"}, []string{"a"})
	waitFor(t, func() bool {
		in := set2.Status().InForce
		return in.Generation == 2 && in.Settled
	})
	q2 := newShardQueue(t, set2)
	// (A gap of missed occurrences while no scheduler ran: two seconds.)
	time.Sleep(time.Until(closed.Add(2 * time.Second)))
	started := time.Now()
	s2, err := NewScheduler(q2, []Schedule{mk(paused), mk(running)})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	b := set2.Shard("b")
	waitFor(t, func() bool {
		p, ok1 := scheduleInfo(t, b, paused)
		r, ok2 := scheduleInfo(t, b, running)
		return ok1 && ok2 && p.Last.After(started.Add(time.Second)) && r.Last.After(started.Add(time.Second))
	})
	s2.Close()
	if p, _ := scheduleInfo(t, b, paused); !p.Paused {
		t.Errorf("schedule %s was paused before the set changed; its cursor on its new shard: %+v (a fresh one: not paused)", paused, p)
	}
	var late []time.Time
	for _, tm := range called(paused) {
		if tm.After(pausedAt) {
			late = append(late, tm)
		}
	}
	if len(late) > 0 {
		t.Errorf("paused schedule %s submitted occurrences %v after it was paused", paused, late)
	}
	after := called(running)
	for i := 1; i < len(after); i++ {
		if after[i].Sub(after[i-1]) != time.Second {
			t.Errorf("schedule %s: occurrence %v then %v: the ones between (while no scheduler ran; the last before the change %v) were skipped, not caught up",
				running, after[i-1], after[i], before[len(before)-1])
			break
		}
	}
}

// DEFECT: carrying a cursor over copies it and leaves the old copy where
// it was, for good. A later set that places the schedule's name back on
// that shard (here at once: generation 3 takes generation 2 back, which
// ARCHITECTURE.md says is safe "in any order") finds the stale copy at
// the cursor's home and uses it: cursorStore only looks at the old shard
// when the home has none. Everything written on the carried-over cursor
// is lost: here the operator paused the schedule under generation 2, and
// under generation 3 its occurrences are submitted again (JOBS.md: "while
// a schedule is paused, its occurrences are skipped on every scheduler").
func TestReviewStaleCursorCopyComesBackWithTheShard(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	set1 := newShardSet(t, prefix, 1, []string{"a"}, nil)
	q1 := newShardQueue(t, set1)
	name := scheduleNamesOn([]string{"a", "b"}, "b", "every", 1)[0]
	sc := Schedule{Name: name, Kind: "tick", Every: time.Second, CatchUp: CatchUpAll, MaxCatchUp: 100, MaxSkew: 100 * time.Millisecond}
	s1, err := NewScheduler(q1, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return len(occurrences(t, q1, name)) >= 1 })
	s1.Close()
	// A queued job that generation 2 places on b keeps a from draining:
	// the hand-over lasts, and the cursor is carried over.
	var keep string
	for i := 0; keep == ""; i++ {
		if id := fmt.Sprintf("keep-%d", i); (shard.Placement{Shards: []string{"a", "b"}}).Place(q1.Key(id)) == "b" {
			keep = id
		}
	}
	if _, err := q1.Submit(ctx, keep, "nobody-runs-this", nil); err != nil {
		t.Fatal(err)
	}

	set2 := newShardSet(t, prefix, 2, []string{"a", "b"}, []string{"a"})
	waitFor(t, func() bool { return set2.Status().InForce.Generation == 2 })
	q2 := newShardQueue(t, set2)
	if err := q2.PauseSchedule(ctx, name, true); err != nil {
		t.Fatalf("pause under generation 2: %v", err)
	}
	if si, ok := scheduleInfo(t, set2.Shard("b"), name); !ok || !si.Paused {
		t.Fatalf("the cursor on b after the pause: %+v, %v; want it carried over and paused", si, ok)
	}
	pausedAt := time.Now()

	// Generation 3 takes generation 2 back: the name's home is a again.
	set3 := newShardSet(t, prefix, 3, []string{"a"}, []string{"a", "b"})
	waitFor(t, func() bool { return set3.Status().InForce.Generation == 3 })
	q3 := newShardQueue(t, set3)
	started := time.Now()
	s3, err := NewScheduler(q3, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	waitFor(t, func() bool {
		for _, n := range []string{"a", "b"} {
			if si, ok := scheduleInfo(t, set3.Shard(n), name); ok && si.Last.After(started.Add(1500*time.Millisecond)) {
				return true
			}
		}
		return false
	})
	s3.Close()
	var late []time.Time
	for _, tm := range occurrences(t, q3, name) {
		if tm.After(pausedAt) {
			late = append(late, tm)
		}
	}
	if len(late) > 0 {
		si, _ := scheduleInfo(t, set3.Shard("a"), name)
		t.Fatalf("schedule %s, paused under generation 2, submitted occurrences %v under generation 3 (the cursor on a, its stale pre-carry-over copy: %+v)", name, late, si)
	}
}

// newShardSetChecking is newShardSet with the set in force looked at
// again every check (shard.Config.Check): a process that has not yet
// learned a change by itself (default 30 s).
func newShardSetChecking(t testing.TB, prefix string, gen int64, placement []string, check time.Duration) *shard.Store {
	t.Helper()
	return newShardProcess(t, prefix, gen, placement, nil, check, nil)
}

// DEFECT: a process that has not yet learned a set change (it looks again
// every Check, 30 s by default) answers "not found" for a job that exists,
// and refuses to signal it. Signal, Get and Wait find the job's shard by
// a read (shard.Store.Holder / readShard) under the set the process knows:
// the old placement's shard holds nothing (or a Moved record naming the
// job's shard, which is skipped, not followed), and nothing refreshes the
// set, since only a refused write teaches a process. Signal reads, and
// writes only where the read found the job, so it never gets there. An
// event for an existing job is refused with etcdstore.ErrNotFound (the
// worker API answers 404 no such job: a caller drops the event).
// ARCHITECTURE.md: "the order in which processes learn a change does not
// matter, nor whether they learn it from a file at all". (Check is an
// hour here so that the old process does not learn the change by its
// timer during the test.)
func TestReviewSignalFromAProcessThatHasNotLearnedTheChange(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	old := newShardSetChecking(t, prefix, 1, []string{"a"}, time.Hour)
	qOld := newShardQueue(t, old)
	set := newShardSet(t, prefix, 2, []string{"a", "b"}, []string{"a"})
	waitFor(t, func() bool { return set.Status().InForce.Generation == 2 })
	q := newShardQueue(t, set)
	var id string
	for i := 0; id == ""; i++ {
		if k := fmt.Sprintf("order-%d", i); set.Place(q.Key(k)) == "b" {
			id = k
		}
	}
	if _, err := q.Submit(ctx, id, "pay", nil); err != nil {
		t.Fatal(err)
	}
	if h := holderOf(t, set, q, id); h != "b" {
		t.Fatalf("job %s on %s; want b", id, h)
	}
	j, gerr := qOld.Get(ctx, id)
	serr := qOld.Signal(ctx, id, "approved", []byte(`"yes"`))
	if gerr != nil || serr != nil {
		t.Fatalf("a process still on generation 1: Get(%s) = %+v, %v; Signal(%s) = %v; want the job, and the event delivered", id, j, gerr, id, serr)
	}
}

// DEFECT: shard.Store.Settings (the queue's retention and record size on a
// shard set: "the shards' shortest retention is the queue's") skips a
// shard whose options are invalid, but when that shard is the first one
// it also skips taking the first valid shard's values: every later
// comparison is "less than 0", and the queue gets retention 0 and record
// size 0. Such a shard never connects (its New keeps failing); the doc
// says a shard that does not answer "stops only its own jobs", yet here a
// job on b cannot be submitted with RunAt a minute ahead ("past half the
// store's retention (0s)") nor signalled with any payload (limit 0).
func TestReviewSettingsWithAnUnusableFirstShard(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	healthy := newShardSet(t, prefix, 1, []string{"a", "b", "c"}, nil) // the set in force
	qh := newShardQueue(t, healthy)
	cfg := shard.Config{Placement: shard.Placement{Shards: []string{"a", "b", "c"}}, Generation: 1, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond}
	for _, n := range []string{"a", "b", "c"} {
		opts := []etcdstore.Option{etcdstore.WithPrefix(prefix + n + "/")}
		if n == "a" {
			opts = append(opts, etcdstore.WithRetention(-time.Hour)) // invalid: a never connects
		}
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: n, Client: cluster.MustClient(t), Options: opts})
	}
	nctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	set, err := shard.New(nctx, cfg, etcdstore.WithSessionTTL(2*time.Second))
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { set.Close() })
	if s := set.Settings(); s.Retention != etcdstore.DefaultRetention || s.MaxRecordSize != etcdstore.DefaultMaxRecordSize {
		t.Errorf("Settings() = %+v; want b's and c's (retention %v, records of %d bytes)", s, etcdstore.DefaultRetention, etcdstore.DefaultMaxRecordSize)
	}
	q := newShardQueue(t, set)
	var id string
	for i := 0; id == ""; i++ {
		if k := fmt.Sprintf("on-b-%d", i); healthy.Place(q.Key(k)) == "b" {
			id = k
		}
	}
	if _, err := q.Submit(ctx, id, "report", nil, RunAt(time.Now().Add(time.Minute))); err != nil {
		t.Errorf("Submit(%s) on shard b, RunAt in a minute: %v", id, err)
	}
	if _, err := qh.Submit(ctx, id+"-now", "report", nil); err != nil {
		t.Fatal(err)
	}
	if err := q.Signal(ctx, id+"-now", "go", []byte(`"x"`)); err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
		t.Errorf("Signal with a 3-byte payload: %v", err)
	}
}
