// Package clock is the time idem's long-lived parts run on, and the runner
// of their background work: etcdstore.Store, lease.Session and
// lease.Buckets, and package jobs' workers and schedulers take a Clock and
// do every wait, timer, deadline and goroutine of theirs through it.
//
// Production uses Real, the runtime's own clock and goroutines. A
// simulation hands in a Clock of its own (idem's fault-schedule explorer
// does), which decides when time passes, when a timer fires, when a piece
// of background work runs and when a waiting call resumes, so that a run
// can be repeated exactly from its seed. The code is the same in both: no
// part of idem asks which Clock it was given.
//
// A Clock given to a store must be the one given to everything the store
// is built with (its session, its buckets), and its Wait must be used for
// every wait on another goroutine's progress: a simulation that runs one
// piece of work at a time can only resume a waiting one it was told of.
package clock

import (
	"context"
	"sync"
	"time"
)

// Clock is a source of time, timers and background work.
//
// A context passed to Wait, WithTimeout or Go says, to a simulation, which
// of its pieces of work is calling; Real ignores that. Contexts derived
// from it (context.WithoutCancel included) say the same.
type Clock interface {
	// Now returns the current time.
	Now() time.Time

	// AfterFunc calls f once d has passed, and returns a function that
	// cancels the call and reports whether it did. f must not block: it
	// closes a channel or cancels a context, as time.AfterFunc's callers
	// usually do.
	AfterFunc(d time.Duration, f func()) (stop func() bool)

	// WithTimeout returns a context derived from ctx that ends when d has
	// passed on this clock (context.DeadlineExceeded), or when ctx does.
	WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc)

	// Go runs f(ctx) as a piece of background work, concurrently with its
	// caller; name says what it is (for a simulation's traces).
	Go(ctx context.Context, name string, f func(ctx context.Context))

	// Wait blocks until ready is closed, and returns nil; or until ctx
	// ends first, and returns its cause.
	Wait(ctx context.Context, ready <-chan struct{}) error
}

// Real is the runtime's clock: time.Now, time.AfterFunc,
// context.WithTimeout (a deadline that gRPC sends along with a request) and
// goroutines.
var Real Clock = realClock{}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }

func (realClock) WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}

func (realClock) Go(ctx context.Context, _ string, f func(context.Context)) { go f(ctx) }

func (realClock) Wait(ctx context.Context, ready <-chan struct{}) error {
	select {
	case <-ready:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// Sleep waits d on c, or until ctx ends (its cause then). A d of zero or
// less returns at once, with ctx's cause if it has ended.
func Sleep(c Clock, ctx context.Context, d time.Duration) error {
	if d <= 0 {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		return nil
	}
	ch := make(chan struct{})
	stop := c.AfterFunc(d, func() { close(ch) })
	defer stop()
	return c.Wait(ctx, ch)
}

// SleepUntil waits until t on c, or until ctx ends (its cause then). A
// clock that jumps past t between the reading of its time and the setting
// of the timer (a test's clock, a suspended machine) does not make it
// sleep the whole interval again from there: the time is read again once
// the timer is set.
func SleepUntil(c Clock, ctx context.Context, t time.Time) error {
	d := t.Sub(c.Now())
	if d <= 0 {
		return Sleep(c, ctx, 0)
	}
	ch := make(chan struct{})
	stop := c.AfterFunc(d, func() { close(ch) })
	defer stop()
	if !c.Now().Before(t) {
		return Sleep(c, ctx, 0)
	}
	return c.Wait(ctx, ch)
}

// Since returns how long ago t was on c.
func Since(c Clock, t time.Time) time.Duration { return c.Now().Sub(t) }

// Group counts pieces of background work, as a sync.WaitGroup does, but
// is waited for through a Clock: Close waits with Group.Wait, so that a
// simulation can run the work it waits for. The zero Group is ready to use.
type Group struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed while n is zero; nil means closed
}

// Go runs f through c as one more piece of the group's work.
func (g *Group) Go(c Clock, ctx context.Context, name string, f func(ctx context.Context)) {
	g.Add(1)
	c.Go(ctx, name, func(ctx context.Context) {
		defer g.Done()
		f(ctx)
	})
}

// Add counts d more pieces of work (d may be negative), as
// sync.WaitGroup.Add does.
func (g *Group) Add(d int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n == 0 && d > 0 {
		g.idle = make(chan struct{})
	}
	g.n += d
	if g.n < 0 {
		panic("clock: negative Group count")
	}
	if g.n == 0 && g.idle != nil {
		close(g.idle)
		g.idle = nil
	}
}

// Done counts one piece of work less.
func (g *Group) Done() { g.Add(-1) }

// Wait waits through c until every piece of the group's work has ended,
// or ctx has.
func (g *Group) Wait(c Clock, ctx context.Context) error {
	g.mu.Lock()
	idle := g.idle
	g.mu.Unlock()
	if idle == nil {
		return nil
	}
	return c.Wait(ctx, idle)
}
