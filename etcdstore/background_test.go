package etcdstore

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/clock"
)

// waitHook is the real clock, with a hook run once a wait on one channel
// has returned: a window opened on purpose, between a wait and what
// follows it.
type waitHook struct {
	clock.Clock
	mu sync.Mutex
	on <-chan struct{}
	f  func()
}

func (c *waitHook) Wait(ctx context.Context, ready <-chan struct{}) error {
	err := c.Clock.Wait(ctx, ready)
	c.mu.Lock()
	var f func()
	if ready == c.on {
		f, c.f = c.f, nil
	}
	c.mu.Unlock()
	if f != nil {
		f()
	}
	return err
}

// A final write that starts while Close waits for the others (a work that
// finished meanwhile, its Complete unanswered) is flushed within Close's
// bound too: Close used to give it up the moment the writes before it were
// done, and its key was then taken over and the work run again. (Found by
// the explorer's invariant 20.)
func TestCloseFlushesAFinalWriteStartedWhileItWaits(t *testing.T) {
	hc := &waitHook{Clock: clock.Real}
	b := newBackground(hc, slog.New(slog.NewTextHandler(io.Discard, nil)))
	var tried atomic.Bool
	if !b.start("first", time.Hour, func(context.Context) bool { return true }) {
		t.Fatal("the first task was refused")
	}
	b.mu.Lock()
	hc.on = b.idle // Close's wait for the tasks pending when it began
	b.mu.Unlock()
	hc.f = func() {
		// The first task is done; a second starts before Close goes on.
		if !b.start("second", time.Hour, func(context.Context) bool { tried.Store(true); return true }) {
			t.Error("the second task was refused while Close still waited")
		}
	}
	if left := b.close(context.Background(), time.Minute); left != 0 || !tried.Load() {
		t.Fatalf("close left %d tasks, the second tried: %v; want it flushed within the bound", left, tried.Load())
	}
}
