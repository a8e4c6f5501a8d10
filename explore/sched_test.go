package explore

import (
	"container/heap"
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"time"
)

// sched runs actors one at a time. An actor runs until it yields (between
// its steps, or inside an etcd call the injector holds) or finishes; the
// driver then picks the next one with the schedule's random source. Nothing
// an actor does runs concurrently with another actor, so a seed replays a
// schedule exactly.
type sched struct {
	rng *rand.Rand // the driver's choices

	mu     sync.Mutex
	actors []*actor // in creation order

	yielded chan *actor // an actor stopped running: it yielded or finished

	// The simulated clock and its timers (deadlines of claims, waits).
	now    time.Time
	timers timerHeap
	seq    int
}

// actor is one thread of the simulation: a worker, a client, a store's
// background write.
type actor struct {
	name string
	proc *process // the process it lives in, nil for external clients
	wake chan bool

	inProc *process // the process whose etcd call it is held in, if any

	// Set while the actor holds the turn, read by the driver after.
	started, finished bool
	dead              bool // killed with its process: it must not run again
}

func newSched(seed uint64, start time.Time) *sched {
	return &sched{
		rng:     rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		yielded: make(chan *actor),
		now:     start,
	}
}

// spawn adds an actor that runs body when the driver first picks it.
func (s *sched) spawn(name string, proc *process, body func(a *actor)) *actor {
	a := &actor{name: name, proc: proc, wake: make(chan bool)}
	s.mu.Lock()
	s.actors = append(s.actors, a)
	s.mu.Unlock()
	go func() {
		defer func() {
			a.finished = true
			s.yielded <- a
		}()
		if <-a.wake {
			body(a)
		}
	}()
	return a
}

// yield hands the turn back to the driver and waits to be picked again. It
// reports false when the actor was killed meanwhile.
func (s *sched) yield(a *actor) bool {
	s.yielded <- a
	return <-a.wake
}

// step yields between two steps of an actor's own code, and ends the
// actor's goroutine if it was killed meanwhile (its process crashed).
func (s *sched) step(a *actor) {
	if !s.yield(a) {
		runtime.Goexit()
	}
}

// errStuck is returned by run when an actor holds the turn too long.
type errStuck struct{ name string }

func (e errStuck) Error() string {
	return fmt.Sprintf("actor %s held the turn for %v: a deadlock or a hung call", e.name, stuckAfter)
}

const stuckAfter = 60 * time.Second

// resume gives a the turn and waits until it yields or finishes.
func (s *sched) resume(a *actor, run bool) error {
	a.started = true
	a.wake <- run
	t := time.NewTimer(stuckAfter)
	defer t.Stop()
	select {
	case got := <-s.yielded:
		if got != a {
			return fmt.Errorf("actor %s yielded while %s held the turn", got.name, a.name)
		}
		return nil
	case <-t.C:
		return errStuck{a.name}
	}
}

// runnable returns the actors that can be picked, in creation order.
func (s *sched) runnable() []*actor {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*actor
	for _, a := range s.actors {
		if !a.finished && !a.dead {
			out = append(out, a)
		}
	}
	return out
}

// Simulated time.

type timer struct {
	at      time.Time
	seq     int
	f       func()
	stopped bool
	idx     int
}

type timerHeap []*timer

func (h timerHeap) Len() int { return len(h) }
func (h timerHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}
func (h timerHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i]; h[i].idx = i; h[j].idx = j }
func (h *timerHeap) Push(x any)   { t := x.(*timer); t.idx = len(*h); *h = append(*h, t) }
func (h *timerHeap) Pop() any     { old := *h; t := old[len(old)-1]; *h = old[:len(old)-1]; return t }
func (s *sched) Now() time.Time   { s.mu.Lock(); defer s.mu.Unlock(); return s.now }
func (s *sched) afterFunc(d time.Duration, f func()) func() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	t := &timer{at: s.now.Add(d), seq: s.seq, f: f}
	heap.Push(&s.timers, t)
	return func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		was := !t.stopped
		t.stopped = true
		return was
	}
}

// advance moves the clock by d and fires the timers that come due, in
// order, on the driver's goroutine.
func (s *sched) advance(d time.Duration) {
	s.mu.Lock()
	s.now = s.now.Add(d)
	var due []*timer
	for len(s.timers) > 0 && !s.timers[0].at.After(s.now) {
		t := heap.Pop(&s.timers).(*timer)
		if !t.stopped {
			t.stopped = true
			due = append(due, t)
		}
	}
	s.mu.Unlock()
	for _, t := range due {
		t.f()
	}
}

// actorKey carries the running actor in the contexts of its etcd calls.
type actorKey struct{}

func withActor(ctx context.Context, a *actor) context.Context {
	return context.WithValue(ctx, actorKey{}, a)
}

func actorOf(ctx context.Context) *actor {
	a, _ := ctx.Value(actorKey{}).(*actor)
	return a
}
