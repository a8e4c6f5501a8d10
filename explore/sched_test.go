package explore

import (
	"bytes"
	"container/heap"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idem-dev/idem/clock"
)

// sched runs actors one at a time. An actor runs until it yields (between
// its steps, inside an etcd call the injector holds, or in a Wait of its
// clock) or finishes; the driver then picks the next one with the
// schedule's random source. Nothing an actor does runs concurrently with
// another actor, so a seed replays a schedule exactly.
//
// Actors are the explorer's workers and clients, and every piece of
// background work a store, a session or a jobs worker starts on its clock
// (clock.Clock.Go): batches, sweeps, dictionary publishes, the cache's
// feed, session renewals and retried final writes all run as actors, and
// every one of their waits is a Wait the driver resumes when its condition
// holds. The time is simulated: it moves when the nemesis moves it, or,
// when no actor can run, to the next timer.
type sched struct {
	rng *rand.Rand // the driver's choices

	mu     sync.Mutex
	actors []*actor          // in creation order
	byG    map[uint64]*actor // by goroutine id: who is calling

	yielded chan *actor // an actor stopped running: it yielded or finished

	now    time.Time // the simulated time: etcd's, and every clock's before skew
	timers timerHeap
	seq    int
	checks atomic.Int64
}

// actor is one thread of the simulation.
type actor struct {
	ctx  context.Context // carries the actor, for the calls it makes
	name string
	proc *process // the process it lives in, nil for external clients
	bg   bool     // background work of a process's store (clock Go)
	wake chan bool

	// While waiting in its clock's Wait: runnable once ready is closed or
	// ctx has ended.
	waiting bool
	ready   <-chan struct{}
	wctx    context.Context

	inProc *process // the process whose etcd call it is held in, if any
	waitIn *process // the process whose clock it waits on, if any: a
	// client's request served inside a process dies with it

	// Set while the actor holds the turn, read by the driver after.
	started, finished bool
	dead              bool        // killed with its process: it must not run again
	exited            atomic.Bool // its goroutine has returned
}

func newSched(seed uint64, start time.Time) *sched {
	return &sched{
		rng:     rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		byG:     make(map[uint64]*actor),
		yielded: make(chan *actor),
		now:     start,
	}
}

// goid returns the calling goroutine's id, from its stack's header line.
func goid() uint64 {
	var b [64]byte
	n := runtime.Stack(b[:], false)
	f := bytes.Fields(b[:n])
	if len(f) < 2 {
		panic("explore: no goroutine id")
	}
	id, err := strconv.ParseUint(string(f[1]), 10, 64)
	if err != nil {
		panic("explore: goroutine id: " + err.Error())
	}
	return id
}

// actorKey carries an actor in the contexts of its calls.
type actorKey struct{}

func withActor(ctx context.Context, a *actor) context.Context {
	return context.WithValue(ctx, actorKey{}, a)
}

// currentCtx returns the actor a call is made by: the one its context
// carries, or else the one running on the calling goroutine, or nil.
func (s *sched) currentCtx(ctx context.Context) *actor {
	if a, ok := ctx.Value(actorKey{}).(*actor); ok {
		// A context is a hint: one captured by another piece of work
		// would name the wrong actor. Checked at one call in 16 (the
		// goroutine's id is dear), and at every one with IDEM_EXPLORE_DEBUG.
		if s.checks.Add(1)%16 == 0 || debugSched {
			if g := s.current(); g != a {
				name := "none"
				if g != nil {
					name = g.name
				}
				panic(fmt.Sprintf("a context of actor %s used by %s", a.name, name))
			}
		}
		return a
	}
	return s.current()
}

// current returns the actor running on the calling goroutine, or nil.
func (s *sched) current() *actor {
	g := goid()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byG[g]
}

// spawn adds an actor that runs body when the driver first picks it.
func (s *sched) spawn(name string, proc *process, bg bool, body func(a *actor)) *actor {
	a := &actor{name: name, proc: proc, bg: bg, wake: make(chan bool)}
	a.ctx = withActor(context.Background(), a)
	s.mu.Lock()
	s.actors = append(s.actors, a)
	s.mu.Unlock()
	go func() {
		g := goid()
		s.mu.Lock()
		s.byG[g] = a
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			delete(s.byG, g)
			s.mu.Unlock()
			a.finished = true
			a.exited.Store(true)
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

// drain ends the goroutines of a world that is over: an actor killed
// while its deferred code yields again, or never started, is parked for
// good otherwise. Each is woken, told it was killed, until it exits; one
// blocked outside the schedule is left after a while.
func (s *sched) drain() {
	s.mu.Lock()
	actors := append([]*actor(nil), s.actors...)
	s.mu.Unlock()
	for _, a := range actors {
		for try := 0; try < 100 && !a.exited.Load(); try++ {
			t := time.NewTimer(time.Second)
			select {
			case a.wake <- false:
				select {
				case <-s.yielded:
				case <-t.C:
				}
			case <-t.C:
			}
			t.Stop()
		}
	}
}

// step yields between two steps of an actor's own code, and ends the
// actor's goroutine if it was killed meanwhile (its process crashed).
func (s *sched) step(a *actor) {
	if !s.yield(a) {
		runtime.Goexit()
	}
}

// errStuck is returned by resume when an actor holds the turn too long.
type errStuck struct{ name string }

func (e errStuck) Error() string {
	return fmt.Sprintf("actor %s held the turn for %v: a deadlock, a hung call, or a wait outside the clock", e.name, stuckAfter)
}

var stuckAfter = 60 * time.Second

var debugSched = os.Getenv("IDEM_EXPLORE_DEBUG") != ""

var slowFlag = os.Getenv("IDEM_EXPLORE_SLOW") != ""

var traceCalls = os.Getenv("IDEM_EXPLORE_CALLS") != ""

func init() {
	if debugSched {
		stuckAfter = 5 * time.Second
	}
}

// resume gives a the turn and waits until it yields or finishes.
func (s *sched) resume(a *actor, run bool) error {
	if debugSched {
		fmt.Printf("resume %s at %v (waiting %v)\n", a.name, s.Now().Format("15:04:05.000"), a.waiting)
	}
	a.started = true
	if slowFlag {
		t0 := time.Now()
		defer func() {
			if d := time.Since(t0); d > 100*time.Millisecond {
				fmt.Printf("slow turn: %s took %v\n", a.name, d)
			}
		}()
	}
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

// ready reports whether a can be given the turn.
func (a *actor) canRun() bool {
	if a.finished || a.dead {
		return false
	}
	if !a.waiting {
		return true
	}
	select {
	case <-a.ready:
		return true
	default:
	}
	return a.wctx.Err() != nil
}

// runnable returns the actors that can be picked, in creation order;
// with clients false, only background ones.
func (s *sched) runnable() []*actor {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*actor
	for _, a := range s.actors {
		if a.canRun() {
			out = append(out, a)
		}
	}
	return out
}

// live returns the actors that have not finished, waiting ones included.
func (s *sched) live(pred func(*actor) bool) []*actor {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*actor
	for _, a := range s.actors {
		if !a.finished && !a.dead && pred(a) {
			out = append(out, a)
		}
	}
	return out
}

// wait is clock.Clock's Wait for every simulated clock.
func (s *sched) wait(ctx context.Context, ready <-chan struct{}, in *process) error {
	a := s.currentCtx(ctx)
	if a == nil {
		// Not an actor (an observer outside the schedule): a real wait.
		return clock.Real.Wait(ctx, ready)
	}
	for {
		select {
		case <-ready:
			return nil
		default:
		}
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		a.ready, a.wctx, a.waiting, a.waitIn = ready, ctx, true, in
		if debugSched {
			pcs := make([]uintptr, 8)
			n := runtime.Callers(3, pcs)
			frames := runtime.CallersFrames(pcs[:n])
			var where []string
			for {
				f, more := frames.Next()
				if !strings.Contains(f.Function, "clock.") {
					where = append(where, f.Function[strings.LastIndexByte(f.Function, '/')+1:])
				}
				if !more || len(where) == 2 {
					break
				}
			}
			fmt.Printf("wait %s in %s\n", a.name, strings.Join(where, " < "))
		}
		ok := s.yield(a)
		a.waiting, a.ready, a.wctx, a.waitIn = false, nil, nil, nil
		if !ok {
			runtime.Goexit()
		}
	}
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

// Now returns the simulated time.
func (s *sched) Now() time.Time { s.mu.Lock(); defer s.mu.Unlock(); return s.now }

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

// next returns when the earliest live timer fires, or false.
func (s *sched) next() (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.timers) > 0 && s.timers[0].stopped {
		heap.Pop(&s.timers)
	}
	if len(s.timers) == 0 {
		return time.Time{}, false
	}
	return s.timers[0].at, true
}

// advance moves the clock by d and fires the timers that come due, in
// order, on the driver's goroutine, each at its own time.
func (s *sched) advance(d time.Duration) { s.advanceTo(s.Now().Add(d)) }

func (s *sched) advanceTo(to time.Time) {
	for {
		s.mu.Lock()
		for len(s.timers) > 0 && s.timers[0].stopped {
			heap.Pop(&s.timers)
		}
		if len(s.timers) == 0 || s.timers[0].at.After(to) {
			if to.After(s.now) {
				s.now = to
			}
			s.mu.Unlock()
			return
		}
		t := heap.Pop(&s.timers).(*timer)
		t.stopped = true
		if t.at.After(s.now) {
			s.now = t.at
		}
		s.mu.Unlock()
		t.f()
	}
}

// simClock is the clock.Clock of one process: the simulated time off by
// the process's skew, the simulated timers, deadlines that end on the
// simulated time, background work as actors of the process, and waits the
// driver resumes.
type simClock struct {
	w    *world
	p    *process
	skew time.Duration
}

func (c *simClock) Now() time.Time { return c.w.s.Now().Add(c.skew) }

func (c *simClock) AfterFunc(d time.Duration, f func()) func() bool { return c.w.s.afterFunc(d, f) }

func (c *simClock) WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := c.w.s.afterFunc(d, func() { cancel(context.DeadlineExceeded) })
	return ctx, func() {
		stop()
		cancel(context.Canceled)
	}
}

func (c *simClock) Go(ctx context.Context, name string, f func(context.Context)) {
	if c.p.dead {
		return // the process is gone
	}
	c.w.ledger.hit("background:" + bgClass(name))
	final := isFinalWrite("/" + name)
	if final {
		c.w.log(event{kind: evTaskStart, proc: c.p.name, task: name})
	}
	c.w.s.spawn(c.p.name+"/"+name, c.p, true, func(a *actor) {
		f(withActor(ctx, a))
		if final {
			c.w.log(event{kind: evTaskDone, proc: c.p.name, task: name})
		}
	})
}

func (c *simClock) Wait(ctx context.Context, ready <-chan struct{}) error {
	return c.w.s.wait(ctx, ready, c.p)
}

var _ clock.Clock = (*simClock)(nil)
