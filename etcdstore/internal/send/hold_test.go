package send

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/clock"
)

// stopClock records each timer's delay and whether it was stopped.
type stopClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*stopTimer
}

type stopTimer struct {
	d       time.Duration
	stopped bool
}

func (c *stopClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *stopClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &stopTimer{d: d}
	c.timers = append(c.timers, t)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		was := t.stopped
		t.stopped = true
		return !was
	}
}
func (c *stopClock) WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}
func (c *stopClock) Go(ctx context.Context, _ string, f func(context.Context)) { go f(ctx) }
func (c *stopClock) Wait(ctx context.Context, ready <-chan struct{}) error {
	return clock.Real.Wait(ctx, ready)
}

// A hold that shrinks replaces a timer armed for a longer one (or a write
// would wait the old, longer hold); a hold that grows keeps the armed one
// (the write it wakes looks again and arms what is left).
func TestHoldTimerFollowsAShrinkingHold(t *testing.T) {
	clk := &stopClock{now: time.Unix(1000, 0)}
	s := New(Config{Clock: clk, Batching: true})
	s.mu.Lock()
	defer s.mu.Unlock()
	s.queue = []*member{{ctx: context.Background(), wake: make(chan struct{})}}
	s.inflight, s.lastSent = 1, clk.now
	s.pace.observe(time.Millisecond, true, clk.now) // base 1 ms
	for i := 0; i < 40; i++ {
		s.pace.observe(9*time.Millisecond, false, clk.now) // srtt towards 9 ms: etcd queues
	}
	long, _ := s.pace.hold()
	if why := s.mayLaunchLocked(); why != wait || len(clk.timers) != 1 || clk.timers[0].d != long {
		t.Fatalf("hold %v: %d, timers %+v; want a wait and one timer of the hold", long, why, clk.timers)
	}
	for i := 0; i < 8; i++ {
		s.pace.observe(time.Millisecond, false, clk.now) // etcd stops queueing
	}
	short, _ := s.pace.hold()
	if short >= long {
		t.Fatalf("the hold did not shrink: %v then %v", long, short)
	}
	if why := s.mayLaunchLocked(); why != wait || len(clk.timers) != 2 || !clk.timers[0].stopped || clk.timers[1].d != short {
		t.Fatalf("after the hold shrank to %v: %d, timers %+v; want the first stopped and a second of the new hold", short, why, clk.timers)
	}
	for i := 0; i < 40; i++ {
		s.pace.observe(9*time.Millisecond, false, clk.now)
	}
	if why := s.mayLaunchLocked(); why != wait || len(clk.timers) != 2 || clk.timers[1].stopped {
		t.Fatalf("after the hold grew: %d, timers %+v; want the armed timer kept", why, clk.timers)
	}
}
