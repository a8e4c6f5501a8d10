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

	"github.com/idem-dev/idem/internal/storex"
)

// gauge counts the jobs of each key inside a step at once, and the most
// there ever were.
type gauge struct {
	mu   sync.Mutex
	now  map[string]int
	high map[string]int
	runs map[string]int
}

func newGauge() *gauge {
	return &gauge{now: map[string]int{}, high: map[string]int{}, runs: map[string]int{}}
}

func (g *gauge) enter(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.now[key]++
	g.runs[key]++
	g.high[key] = max(g.high[key], g.now[key])
}

func (g *gauge) leave(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.now[key]--
}

func (g *gauge) get(key string) (high, runs int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.high[key], g.runs[key]
}

// merchantOf reads the test jobs' key.
func merchantOf(params []byte) string {
	k, _ := ParamKey("merchant")(params)
	return k
}

// Jobs of one merchant never run more at once than its limit, across two
// workers, while another merchant's jobs run beside them.
func TestConcurrencyLimitHoldsAcrossWorkers(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	g := newGauge()
	release := make(chan struct{})
	closeRelease := sync.OnceFunc(func() { close(release) })
	defer closeRelease() // a failure must not leave the steps blocked
	k := Kind{Name: "charge", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Concurrency: 2}},
		Steps: []Step{{Name: "call", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			m := merchantOf(r.Params())
			g.enter(m)
			defer g.leave(m)
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return nil, nil
		}}}}
	var qs []*Queue
	for i := 0; i < 2; i++ {
		q := newQueue(t, newStore(t, prefix))
		newWorker(t, q, []Kind{k}, Concurrency(4))
		qs = append(qs, q)
	}
	var ids []string
	for i := 0; i < 6; i++ {
		for _, m := range []string{"m1", "m2"} {
			id := fmt.Sprintf("%s-%d", m, i)
			if _, err := qs[i%2].Submit(ctx, id, "charge", []byte(`{"merchant":"`+m+`"}`)); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
	}
	// Both merchants reach their limit (4 jobs running of 8 worker
	// slots), and no more start while they hold.
	waitFor(t, func() bool {
		h1, _ := g.get("m1")
		h2, _ := g.get("m2")
		return h1 >= 2 && h2 >= 2
	})
	closeRelease()
	for _, id := range ids {
		if j := waitJob(t, qs[0], id); j.State != Succeeded {
			t.Fatalf("job %s: %s (%s)", id, j.State, j.Err)
		}
	}
	for _, m := range []string{"m1", "m2"} {
		if high, runs := g.get(m); high > 2 || runs < 6 {
			t.Errorf("merchant %s: %d jobs ran at once (limit 2), %d runs", m, high, runs)
		}
	}
	// Every slot was released.
	vals, err := storex.Values(qs[0].store, ctx, limitPrefix(qs[0].tenant))
	if err != nil || len(vals) != 0 {
		t.Errorf("slots left after every job ended: %v (%v)", vals, err)
	}
}

// waitFor polls cond (every 10 ms, up to 30 s): for states a test can
// only see from outside (steps blocked on a channel).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition never held")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A job held back by its key's limit is not counted as an attempt, says
// which limit holds it, and runs once a slot frees.
func TestLimitedJobWaitsUncounted(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	release := make(chan struct{})
	closeRelease := sync.OnceFunc(func() { close(release) })
	defer closeRelease() // a failure must not leave the step blocked
	entered := make(chan string, 2)
	k := Kind{Name: "one", MaxAttempts: 1, Limits: []Limit{{Name: "tenant", Key: ParamKey("t"), Concurrency: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			entered <- r.Key().ID
			if r.Key().ID == "first" {
				<-release
			}
			return nil, nil
		}}}}
	newWorker(t, q, []Kind{k}, Concurrency(2))
	if _, err := q.Submit(ctx, "first", "one", []byte(`{"t":"a"}`)); err != nil {
		t.Fatal(err)
	}
	if got := <-entered; got != "first" {
		t.Fatalf("%s ran first", got)
	}
	if _, err := q.Submit(ctx, "second", "one", []byte(`{"t":"a"}`)); err != nil {
		t.Fatal(err)
	}
	// Tried while first holds the slot (a worker's completer would not
	// try it: its index shows the key full), it is given back.
	other := newWorker(t, newQueue(t, newStore(t, prefix)), []Kind{k}, Concurrency(0))
	j, err := other.Run(ctx, "second")
	if err != nil {
		t.Fatal(err)
	}
	if j.Limited != "tenant=a" || j.State != Scheduled || j.Attempts != 0 {
		t.Fatalf("second, held back: state %s, limited %q, attempts %d", j.State, j.Limited, j.Attempts)
	}
	closeRelease()
	if got := <-entered; got != "second" {
		t.Fatalf("%s ran second", got)
	}
	if j := waitJob(t, q, "second"); j.State != Succeeded || j.Limited != "" {
		t.Fatalf("second: %s, limited %q (%s)", j.State, j.Limited, j.Err)
	}
}

// A slot held by a claim that can write nothing more (its worker died, its
// job was taken over; or its release was lost) is taken by the next job.
func TestStaleSlotIsTaken(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	st := newStore(t, prefix)
	q := newQueue(t, st)
	// A slot left by an attempt of a job that has ended since.
	if _, ok, err := storex.SetValue(st, ctx, limitPrefix(q.tenant)+"tenant/a/c/0", []byte(`{"job":"gone","token":7}`), 0); err != nil || !ok {
		t.Fatal(ok, err)
	}
	k := Kind{Name: "one", Limits: []Limit{{Name: "tenant", Key: ParamKey("t"), Concurrency: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "j", "one", []byte(`{"t":"a"}`)); err != nil {
		t.Fatal(err)
	}
	j, err := w.Run(ctx, "j")
	if err != nil || j.State != Succeeded {
		t.Fatalf("run: %+v, %v", j, err)
	}
}

// Starts of one key are spread by its rate: at most Burst in any
// Burst/Rate, on the store's clock.
func TestRateLimitSpacesStarts(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	var mu sync.Mutex
	var starts []time.Time
	k := Kind{Name: "tick", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Rate: 10, Burst: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			mu.Lock()
			starts = append(starts, time.Now())
			mu.Unlock()
			return nil, nil
		}}}}
	newWorker(t, q, []Kind{k}, Concurrency(4))
	for i := 0; i < 4; i++ {
		if _, err := q.Submit(ctx, fmt.Sprintf("r%d", i), "tick", []byte(`{"merchant":"m"}`)); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 4; i++ {
		if j := waitJob(t, q, fmt.Sprintf("r%d", i)); j.State != Succeeded {
			t.Fatalf("r%d: %s (%s)", i, j.State, j.Err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(starts); i++ {
		// 100 ms apart, less the millisecond a slot's time is rounded to.
		if d := starts[i].Sub(starts[i-1]); d < 99*time.Millisecond {
			t.Errorf("starts %d and %d %v apart; the rate allows one per 100ms", i-1, i, d)
		}
	}
}

// Parameters that give no key fail the job, saying which limit; a kind's
// limits are checked when it is registered.
func TestLimitErrors(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	step := Step{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}
	for _, tc := range []struct {
		l    Limit
		want string
	}{
		{Limit{Name: "x", Key: ParamKey("m")}, "bounds nothing"},
		{Limit{Name: "", Key: ParamKey("m"), Concurrency: 1}, "limit name"},
		{Limit{Name: "x", Concurrency: 1}, "has no Key"},
		{Limit{Name: "x", Key: ParamKey("m"), Concurrency: -1}, "Concurrency -1"},
		{Limit{Name: "x", Key: ParamKey("m"), Rate: -2}, "Rate -2"},
		{Limit{Name: "x", Key: ParamKey("m"), Rate: 5000}, "needs a Burst"},
	} {
		_, err := NewWorker(q, []Kind{{Name: "k", Steps: []Step{step}, Limits: []Limit{tc.l}}}, Concurrency(0))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("limit %+v: %v, want ErrInvalid saying %q", tc.l, err, tc.want)
		}
	}
	k := Kind{Name: "k", Steps: []Step{step}, Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Concurrency: 1}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "bad", "k", []byte(`{"merchant":{"id":1}}`)); err != nil {
		t.Fatal(err)
	}
	j, err := w.Run(ctx, "bad")
	if err != nil || j.State != Failed || !strings.Contains(j.Err, "limit merchant") {
		t.Fatalf("a job whose key is an object: %+v, %v", j, err)
	}
}

// One key with many jobs due does not hold another key back: due jobs of
// different keys start in turn.
func TestKeysTakeTurns(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	var mu sync.Mutex
	var order []string
	k := Kind{Name: "turn", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Concurrency: 100}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			mu.Lock()
			order = append(order, merchantOf(r.Params()))
			mu.Unlock()
			return nil, nil
		}}}}
	var ids []string
	for i := 0; i < 10; i++ {
		ids = append(ids, fmt.Sprintf("noisy-%d", i))
		if _, err := q.Submit(ctx, ids[i], "turn", []byte(`{"merchant":"noisy"}`)); err != nil {
			t.Fatal(err)
		}
	}
	ids = append(ids, "quiet")
	// Due last of all (the others have no time set): by due time alone,
	// it would run last.
	if _, err := q.Submit(ctx, "quiet", "turn", []byte(`{"merchant":"quiet"}`), RunAt(time.Now())); err != nil {
		t.Fatal(err)
	}
	// One job at a time: the worker's slots, not the limit, are scarce.
	newWorker(t, q, []Kind{k}, Concurrency(1))
	for _, id := range ids {
		if j := waitJob(t, q, id); j.State != Succeeded {
			t.Fatalf("%s: %s", id, j.State)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if i := slices.Index(order, "quiet"); i < 0 || i > 1 {
		t.Fatalf("the quiet merchant's job ran %d-th of %d: %v", i+1, len(order), order)
	}
}
