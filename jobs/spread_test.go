package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/storex"
)

// runLog records which worker (by name) ran each job.
type runLog struct {
	mu  sync.Mutex
	ran map[string]string
}

func (l *runLog) kind(worker string, block <-chan struct{}) Kind {
	return Kind{Name: "spread", Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		l.mu.Lock()
		l.ran[r.Key().ID] = worker
		l.mu.Unlock()
		if block != nil && r.Key().ID == "blocker" {
			<-block
		}
		return nil, nil
	}}}}
}

// waitAdverts waits until n workers have advertised themselves.
func waitAdverts(t *testing.T, q *Queue, n int) map[string]bool {
	t.Helper()
	var owners map[string]bool
	waitFor(t, func() bool {
		vals, err := storex.Values(q.store, context.Background(), advertPrefix(q.tenant))
		owners = map[string]bool{}
		for _, v := range vals {
			owners[v.Name[len(advertPrefix(q.tenant)):]] = true
		}
		return err == nil && len(vals) == n
	})
	return owners
}

// Each job runs on its preferred worker (rendezvous hashing over the
// workers of its kind), not on whichever wins a race.
func TestJobsRunOnTheirPreferredWorker(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	log := &runLog{ran: map[string]string{}}
	var q *Queue
	var workers []*Worker
	byOwner := map[string]string{}
	for _, name := range []string{"w0", "w1", "w2"} {
		st := newStore(t, prefix)
		wq := newQueue(t, st)
		w := newWorker(t, wq, []Kind{log.kind(name, nil)})
		q = wq
		workers = append(workers, w)
		waitFor(t, func() bool { return st.Owner() != "" })
		byOwner[st.Owner()+"/"+w.idName()] = name // its advert's name
	}
	owners := waitAdverts(t, q, 3)
	for o := range byOwner {
		if !owners[o] {
			t.Fatalf("worker %s did not advertise itself: %v", o, owners)
		}
	}
	// Every completer knows every advert (its watch has caught up).
	for _, w := range workers {
		waitFor(t, func() bool { w.comp.mu.Lock(); defer w.comp.mu.Unlock(); return len(w.comp.workers) == 3 })
	}
	var ids []string
	for i := 0; i < 30; i++ {
		ids = append(ids, fmt.Sprintf("s-%d", i))
		if _, err := q.Submit(ctx, ids[i], "spread", nil); err != nil {
			t.Fatal(err)
		}
	}
	counts := map[string]int{}
	for _, id := range ids {
		if j := waitJob(t, q, id); j.State != Succeeded {
			t.Fatalf("%s: %s", id, j.State)
		}
		var best string
		var bestHash uint64
		for o := range byOwner {
			if h := rendezvous(id, o); best == "" || h > bestHash || h == bestHash && o > best {
				best, bestHash = o, h
			}
		}
		log.mu.Lock()
		ran := log.ran[id]
		log.mu.Unlock()
		if ran != byOwner[best] {
			t.Errorf("%s ran on %s; its preferred worker is %s", id, ran, byOwner[best])
		}
		counts[ran]++
	}
	t.Logf("jobs per worker: %v", counts)
}

// A job submitted in a zone runs there while the zone has a worker; a job
// whose preferred worker is busy is taken by another after the fallback.
func TestJobsStayInTheirZoneAndFallBack(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	log := &runLog{ran: map[string]string{}}
	block := make(chan struct{})
	defer close(block)
	queues := map[string]*Queue{}
	var workers []*Worker
	for _, zone := range []string{"dc-a", "dc-b"} {
		q := newQueue(t, newStore(t, prefix), WithZone(zone))
		// One job at a time: the blocker holds dc-a's worker.
		workers = append(workers, newWorker(t, q, []Kind{log.kind(zone, block)}, Concurrency(1)))
		queues[zone] = q
	}
	waitAdverts(t, queues["dc-a"], 2)
	for _, w := range workers {
		waitFor(t, func() bool { w.comp.mu.Lock(); defer w.comp.mu.Unlock(); return len(w.comp.workers) == 2 })
	}
	var ids []string
	for i := 0; i < 10; i++ {
		for zone, q := range queues {
			id := fmt.Sprintf("%s-%d", zone, i)
			ids = append(ids, id)
			if _, err := q.Submit(ctx, id, "spread", nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, id := range ids {
		j := waitJob(t, queues["dc-a"], id)
		log.mu.Lock()
		ran := log.ran[id]
		log.mu.Unlock()
		if j.State != Succeeded || j.Zone != id[:4] || ran != j.Zone {
			t.Errorf("%s (submitted in %s): %s, ran in %q", id, j.Zone, j.State, ran)
		}
	}
	// dc-a's only worker is busy: dc-a's next job is taken by dc-b's,
	// after twice the fallback.
	if _, err := queues["dc-a"].Submit(ctx, "blocker", "spread", nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { log.mu.Lock(); defer log.mu.Unlock(); return log.ran["blocker"] == "dc-a" })
	start := time.Now()
	if _, err := queues["dc-a"].Submit(ctx, "late", "spread", nil); err != nil {
		t.Fatal(err)
	}
	if j := waitJob(t, queues["dc-a"], "late"); j.State != Succeeded {
		t.Fatalf("late: %s", j.State)
	}
	log.mu.Lock()
	ran := log.ran["late"]
	log.mu.Unlock()
	if ran != "dc-b" || time.Since(start) < 2*DefaultFallbackAfter {
		t.Fatalf("a dc-a job while dc-a's worker was busy ran in %s after %v; want dc-b, after %v", ran, time.Since(start), 2*DefaultFallbackAfter)
	}
}

// A worker's name is checked when it starts.
func TestWorkerNameChecked(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	k := (&runLog{ran: map[string]string{}}).kind("w", nil)
	for _, name := range []string{"", "pod one", strings.Repeat("x", 129)} {
		if _, err := NewWorker(q, []Kind{k}, WorkerName(name)); !errors.Is(err, ErrInvalid) {
			t.Errorf("WorkerName(%q): %v, want ErrInvalid", name, err)
		}
	}
}

// Queued jobs start first come, first served, not by id: a job a stream
// of later jobs with smaller ids keeps overtaking could wait for ever
// (found by the 3-DC scenario: a refund queued for a minute behind the
// schedule's reports).
func TestQueuedJobsStartInTheirOrder(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	var mu sync.Mutex
	var order []string
	k := Kind{Name: "fifo", Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		mu.Lock()
		order = append(order, r.Key().ID)
		mu.Unlock()
		return nil, nil
	}}}}
	ids := []string{"z-first"}
	for i := 0; i < 8; i++ {
		ids = append(ids, fmt.Sprintf("a-%d", i))
	}
	for _, id := range ids {
		if _, err := q.Submit(ctx, id, "fifo", nil); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // created a millisecond apart at least (record times are in ms), not synchronisation
	}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	for _, id := range ids {
		waitJob(t, q, id)
	}
	mu.Lock()
	defer mu.Unlock()
	if order[0] != "z-first" {
		t.Fatalf("jobs ran in the order %v; the first submitted (z-first) should run first", order)
	}
}
