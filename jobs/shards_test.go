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

// A shard set for the tests: shards "a", "b" and "c" under sub-prefixes of
// prefix on the test cluster, each a store of its own (session, leases,
// epoch), asking for placement at generation gen (with the previous one
// while keys move).
func newShardSet(t testing.TB, prefix string, gen int64, placement, previous []string) *shard.Store {
	t.Helper()
	return newShardProcess(t, prefix, gen, placement, previous, 100*time.Millisecond, nil)
}

func newShardQueue(t testing.TB, set *shard.Store, opts ...Option) *Queue {
	t.Helper()
	q, err := NewOnShards(set, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// holderOf returns the name of the shard that holds job id's record.
func holderOf(t testing.TB, set *shard.Store, q *Queue, id string) string {
	t.Helper()
	st, _, err := set.Holder(testCtx(t), q.Key(id))
	if err != nil {
		t.Fatalf("holder of %s: %v", id, err)
	}
	for _, n := range set.Shards() {
		if set.Shard(n) == st {
			return n
		}
	}
	t.Fatalf("holder of %s is no shard of the set", id)
	return ""
}

// Jobs on a shard set: each is kept on its key's shard and run there by a
// worker of the set (a completer per shard), each step once; an event is
// delivered to the job's shard, and a retried signal is one event.
func TestJobsOnAShardSet(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	set1 := newShardSet(t, prefix, 1, []string{"a", "b", "c"}, nil)
	set2 := newShardSet(t, prefix, 1, []string{"a", "b", "c"}, nil)
	q1, q2 := newShardQueue(t, set1), newShardQueue(t, set2)
	out := newSink()
	var mu sync.Mutex
	approvals := map[string]string{}
	k := Kind{Name: "pay", Steps: []Step{
		{Name: "charge", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, out.apply(r) }},
		AwaitStep("approval", "approved", time.Minute, Fail),
		{Name: "note", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			mu.Lock()
			approvals[r.Key().ID] += string(r.Output("approval"))
			mu.Unlock()
			return nil, out.apply(r)
		}},
	}}
	const n = 12
	for i := range n {
		if _, err := q1.Submit(ctx, fmt.Sprintf("p-%d", i), "pay", nil); err != nil {
			t.Fatal(err)
		}
	}
	// Two workers, each a completer per shard.
	newWorker(t, q1, []Kind{k}, Concurrency(2))
	newWorker(t, q2, []Kind{k}, Concurrency(2))
	shards := map[string]int{}
	for i := range n {
		id := fmt.Sprintf("p-%d", i)
		waitUntil(t, q2, id, func(j *Job) bool { return j.State == Waiting && j.Awaiting == "approved" })
		shards[holderOf(t, set1, q1, id)]++
		// A retried signal, from both processes: one event. (The job may
		// have ended by the retry: then it is refused as ended.)
		for i, q := range []*Queue{q2, q1} {
			if err := q.Signal(ctx, id, "approved", []byte(id)); err != nil && !(i == 1 && errors.Is(err, ErrFinal)) {
				t.Fatalf("Signal(%s): %v", id, err)
			}
		}
	}
	if len(shards) < 2 {
		t.Fatalf("the jobs are on shards %v; want them spread", shards)
	}
	for i := range n {
		id := fmt.Sprintf("p-%d", i)
		j := waitJob(t, q1, id)
		if j.State != Succeeded {
			t.Fatalf("job %s: %+v; want succeeded", id, j)
		}
		for _, step := range []string{"charge", "note"} {
			if applied, calls := out.count("jobs:" + id + "." + step); applied != 1 || calls != 1 {
				t.Fatalf("step %s of %s applied %d times in %d calls; want once", step, id, applied, calls)
			}
		}
		mu.Lock() // other jobs' notes may still run
		got := approvals[id]
		mu.Unlock()
		if got != id {
			t.Fatalf("job %s saw approvals %q; want its own once", id, got)
		}
	}
	if jobs, err := q2.List(ctx, ListOptions{}); err != nil || len(jobs) != n {
		t.Fatalf("List: %d jobs, %v; want %d", len(jobs), err, n)
	}
	// The same submit again is the same job, wherever it is asked.
	if j, err := q2.Submit(ctx, "p-0", "pay", nil); err != nil || j.State != Succeeded {
		t.Fatalf("Submit again: %+v, %v; want the succeeded job", j, err)
	}
}

// A shard set changes while jobs wait: a job that lives on its old shard
// stays there until it ends (its event goes there, it runs there once), a
// new job goes to its new home, and a schedule's cursor is carried over to
// the shard the new set places it on, its occurrences still once each.
func TestJobsAcrossAShardSetChange(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	old := newShardSet(t, prefix, 1, []string{"a"}, nil)
	qOld := newShardQueue(t, old)
	out := newSink()
	k := Kind{Name: "pay", Steps: []Step{
		AwaitStep("approval", "approved", time.Minute, Fail),
		{Name: "charge", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, out.apply(r) }},
	}}
	tick := Kind{Name: "tick", Steps: []Step{{Name: "t", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, out.apply(r) }}}}
	wOld := newWorker(t, qOld, []Kind{k, tick}, Concurrency(2))
	// A schedule whose cursor the new set places elsewhere.
	sc := Schedule{Kind: "tick", Every: time.Second, CatchUp: CatchUpAll, MaxCatchUp: 100, MaxSkew: 100 * time.Millisecond}
	for i := 0; sc.Name == ""; i++ {
		if name := fmt.Sprintf("every-%d", i); (shard.Placement{Shards: []string{"a", "b", "c"}}).Place(etcdstore.Key{Tenant: DefaultTenant, ID: "schedule." + name}) != "a" {
			sc.Name = name
		}
	}
	s1, err := NewScheduler(qOld, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	const n = 8
	for i := range n {
		if _, err := qOld.Submit(ctx, fmt.Sprintf("w-%d", i), "pay", nil); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		waitUntil(t, qOld, fmt.Sprintf("w-%d", i), func(j *Job) bool { return j.State == Waiting })
	}
	// Occurrences on set 1.
	waitFor(t, func() bool { js, _ := qOld.List(ctx, ListOptions{State: Succeeded}); return len(js) >= 2 })
	// Generation 2 adds b and c: keys placed on them move once their
	// records on a end. Its processes schedule and work from now on.
	before, err := Schedules(ctx, &old.Shard("a").Admin, qOld.Tenant())
	if err != nil || len(before) != 1 {
		t.Fatalf("the cursor on a: %v, %v", before, err)
	}
	s1.Close()
	closed := time.Now()
	wOld.Close()
	set := newShardSet(t, prefix, 2, []string{"a", "b", "c"}, []string{"a"})
	q := newShardQueue(t, set)
	newWorker(t, q, []Kind{k, tick}, Concurrency(2))
	moved := 0
	for i := range n {
		id := fmt.Sprintf("w-%d", i)
		if h := holderOf(t, set, q, id); h != "a" {
			t.Fatalf("job %s, waiting, is on shard %s; want it kept on a until it ends", id, h)
		}
		if set.Place(q.Key(id)) != "a" {
			moved++
			// Submitted again under the new set: the job on a, not a
			// second one at its new home.
			j, err := q.Submit(ctx, id, "pay", nil)
			if err != nil || j.State != Waiting || j.Token == 0 {
				t.Fatalf("Submit(%s) again under the new set: %+v, %v; want the waiting job", id, j, err)
			}
			if h := holderOf(t, set, q, id); h != "a" {
				t.Fatalf("job %s is on %s after a second submit; want a", id, h)
			}
			if rec, err := set.Shard(set.Place(q.Key(id))).Get(ctx, q.Key(id)); !errors.Is(err, etcdstore.ErrNotFound) {
				t.Fatalf("its new home holds %+v, %v; want nothing", rec, err)
			}
		}
		if err := q.Signal(ctx, id, "approved", nil); err != nil {
			t.Fatalf("Signal(%s): %v", id, err)
		}
	}
	if moved == 0 {
		t.Fatal("no job is placed elsewhere by the new set: the test shows nothing")
	}
	for i := range n {
		id := fmt.Sprintf("w-%d", i)
		if j := waitJob(t, q, id); j.State != Succeeded {
			t.Fatalf("job %s: %+v", id, j)
		}
		if applied, calls := out.count("jobs:" + id + ".charge"); applied != 1 || calls != 1 {
			t.Fatalf("%s charged %d times in %d calls; want once", id, applied, calls)
		}
	}
	// New jobs go to their new home.
	for i := range n {
		id := fmt.Sprintf("new-%d", i)
		if _, err := q.Submit(ctx, id, "tick", nil); err != nil {
			t.Fatal(err)
		}
		if h, want := holderOf(t, set, q, id), set.Place(q.Key(id)); h != want {
			t.Fatalf("new job %s is on %s; want its home %s", id, h, want)
		}
	}
	// The schedule goes on from its cursor, wherever the new set puts it:
	// the occurrences missed while no scheduler ran (two seconds and more,
	// the gap this test makes) are caught up, not skipped as a new cursor
	// would.
	time.Sleep(time.Until(closed.Add(2 * time.Second)))
	s2, err := NewScheduler(q, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	home := set.Shard(set.Place(etcdstore.Key{Tenant: q.Tenant(), ID: "schedule." + sc.Name}))
	waitFor(t, func() bool {
		infos, _ := Schedules(ctx, &home.Admin, q.Tenant())
		return len(infos) == 1 && infos[0].Last.After(before[0].Last.Add(2*time.Second))
	})
	s2.Close()
	all, err := q.List(ctx, ListOptions{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var times []time.Time
	for _, j := range all {
		if _, at, ok := strings.Cut(j.Key.ID, "@"); ok {
			tm, err := time.Parse(time.RFC3339, at)
			if err != nil {
				t.Fatal(err)
			}
			times = append(times, tm)
		}
	}
	slices.SortFunc(times, time.Time.Compare)
	for i := 1; i < len(times); i++ {
		if times[i].Sub(times[i-1]) != time.Second {
			t.Fatalf("occurrences %v then %v: the ones between were skipped (the cursor was not carried over)", times[i-1], times[i])
		}
	}
	for _, j := range all {
		if j.Kind != "tick" || j.State.Final() && j.State != Succeeded {
			continue
		}
		if applied, calls := out.count("jobs:" + j.Key.ID + ".t"); calls > 1 || applied > 1 {
			t.Fatalf("occurrence %s ran %d times; want once", j.Key.ID, calls)
		}
	}
}

// What needs one cluster is refused on a shard set, with an error that
// says so, before anything runs.
func TestShardSetRefusals(t *testing.T) {
	set := newShardSet(t, testPrefix(t), 1, []string{"a", "b"}, nil)
	q := newShardQueue(t, set)
	limited := Kind{Name: "lim", Limits: []Limit{{Name: "m", Key: ParamKey("m"), Concurrency: 1}},
		Steps: []Step{{Name: "s", Run: func(context.Context, *Run) ([]byte, error) { return nil, nil }}}}
	if _, err := NewWorker(q, []Kind{limited}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NewWorker with a limited kind = %v; want ErrInvalid", err)
	}
	if _, err := NewScheduler(q, []Schedule{{Name: "x", Kind: "lim", Every: time.Minute, Overlap: OverlapSkip}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NewScheduler with overlap skip = %v; want ErrInvalid", err)
	}
	if slots, err := q.Slots(testCtx(t), "m"); err != nil || len(slots) != 0 {
		t.Fatalf("Slots = %v, %v; want none", slots, err)
	}
	if _, err := NewOnShards(nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NewOnShards(nil) = %v; want ErrInvalid", err)
	}
}

// Worker.Explain says what each completer knows of a job: on a shard set,
// a line per shard, the job in the index of its own shard only.
func TestWorkerExplain(t *testing.T) {
	ctx := testCtx(t)
	set := newShardSet(t, testPrefix(t), 1, []string{"a", "b"}, nil)
	q := newShardQueue(t, set)
	k := Kind{Name: "later", Steps: []Step{{Name: "s", Run: func(context.Context, *Run) ([]byte, error) { return nil, nil }}}}
	if got := newWorker(t, q, []Kind{k}, Concurrency(0)).Explain("x"); !strings.Contains(got, "no completer") {
		t.Fatalf("Explain without a completer = %q", got)
	}
	w := newWorker(t, q, []Kind{k}, Concurrency(1))
	if _, err := q.Submit(ctx, "in-an-hour", "later", nil, RunAt(time.Now().Add(time.Hour))); err != nil {
		t.Fatal(err)
	}
	home := set.Place(q.Key("in-an-hour"))
	waitFor(t, func() bool { return strings.Contains(w.Explain("in-an-hour"), "shard "+home+": rev") })
	lines := strings.Split(w.Explain("in-an-hour"), "\n")
	if len(lines) != 4 || lines[0] != "running here: []" {
		t.Fatalf("Explain = %q; want a line per shard the set is configured with", lines)
	}
	for _, l := range lines[1:] {
		switch {
		case strings.HasPrefix(l, "shard "+home+": "):
			if !strings.Contains(l, "queued=true") || !strings.Contains(l, `owner ""`) || !strings.Contains(l, "notBefore=59m") {
				t.Fatalf("its shard's line %q; want it queued for in an hour", l)
			}
		case !strings.Contains(l, "not in the index"):
			t.Fatalf("the other shard's line %q; want it not indexed there", l)
		}
	}
}
