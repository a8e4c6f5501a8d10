package clock

import (
	"context"
	"sync"
	"testing"
	"time"
)

// jumpClock's time jumps when a timer is set: as a test's clock moved by
// another goroutine between the reading of the time and the timer.
type jumpClock struct {
	mu     sync.Mutex
	now    time.Time
	jumpTo time.Time
	timers []time.Time
}

func (c *jumpClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *jumpClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.jumpTo.IsZero() {
		c.now, c.jumpTo = c.jumpTo, time.Time{}
	}
	c.timers = append(c.timers, c.now.Add(d)) // never fires: time moves only by the jump
	return func() bool { return true }
}
func (c *jumpClock) WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithCancel(ctx)
}
func (c *jumpClock) Go(ctx context.Context, _ string, f func(context.Context)) { go f(ctx) }
func (c *jumpClock) Wait(ctx context.Context, ready <-chan struct{}) error {
	select {
	case <-ready:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// SleepUntil returns once its instant has passed, even when the clock
// jumped past it while the timer was being set (Sleep of the interval
// read before would wait the whole interval again from there).
func TestSleepUntilAcrossAJump(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	c := &jumpClock{now: t0, jumpTo: t0.Add(2 * time.Minute)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := SleepUntil(c, ctx, t0.Add(time.Minute)); err != nil {
		t.Fatalf("SleepUntil across a jump past its instant = %v; want it to return at once", err)
	}
}
