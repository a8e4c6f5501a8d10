package jobs

import (
	"context"
	"sync"
	"time"

	"github.com/idem-dev/idem/clock"
)

// setClock makes q (and the workers and schedulers made on it afterwards)
// go by c.
func (q *Queue) setClock(c clock.Clock) { q.clock = c }

// fakeView is a fakeClock as one machine sees it: its time (off by skew)
// and its timers are the fake clock's; its goroutines and waits real, and
// its request timeouts real time.
type fakeView struct {
	c    *fakeClock
	skew time.Duration
}

func (v fakeView) Now() time.Time {
	v.c.mu.Lock()
	defer v.c.mu.Unlock()
	return v.c.t.Add(v.skew)
}

func (v fakeView) AfterFunc(d time.Duration, f func()) func() bool {
	c := v.c
	c.mu.Lock()
	defer c.mu.Unlock()
	ft := &fakeTimer{at: c.t.Add(d), f: f}
	if d <= 0 {
		go f()
		return func() bool { return false }
	}
	c.timers = append(c.timers, ft)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		was := !ft.stopped
		ft.stopped = true
		return was
	}
}

func (fakeView) WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}

func (fakeView) Go(ctx context.Context, name string, f func(context.Context)) { go f(ctx) }

func (fakeView) Wait(ctx context.Context, ready <-chan struct{}) error {
	return clock.Real.Wait(ctx, ready)
}

// fakeClock is a clock the test moves by hand; its views may be skewed.
type fakeClock struct {
	mu     sync.Mutex
	t      time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	at      time.Time
	f       func()
	stopped bool
}

func newFakeClock(t time.Time) *fakeClock { return &fakeClock{t: t} }

// view returns the clock as a machine whose clock is off by skew sees it.
func (c *fakeClock) view(skew time.Duration) clock.Clock { return fakeView{c: c, skew: skew} }

// set moves the clock to t and fires the timers due by then.
func (c *fakeClock) set(t time.Time) {
	c.mu.Lock()
	c.t = t
	var keep []*fakeTimer
	var fire []func()
	for _, ft := range c.timers {
		switch {
		case ft.stopped:
		case !ft.at.After(t):
			ft.stopped = true
			fire = append(fire, ft.f)
		default:
			keep = append(keep, ft)
		}
	}
	c.timers = keep
	c.mu.Unlock()
	for _, f := range fire {
		go f()
	}
}
