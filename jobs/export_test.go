package jobs

import (
	"sync"
	"time"
)

// setClock makes q (and the workers and schedulers made on it afterwards)
// go by c.
func (q *Queue) setClock(c clock) { q.clock = c }

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
func (c *fakeClock) view(skew time.Duration) clock {
	return clock{
		now: func() time.Time {
			c.mu.Lock()
			defer c.mu.Unlock()
			return c.t.Add(skew)
		},
		after: func(d time.Duration, f func()) func() bool {
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
		},
	}
}

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
