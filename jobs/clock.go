package jobs

import (
	"context"
	"time"
)

// clock is the time a queue's workers and schedulers go by: the real one,
// or a simulation's (package internal/sim) when the store's etcd client
// has one.
type clock struct {
	now   func() time.Time
	after func(d time.Duration, f func()) (stop func() bool)
}

var realClock = clock{
	now:   time.Now,
	after: func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop },
}

// sleep waits d, or until ctx ends (its error then).
func (c clock) sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	ch := make(chan struct{})
	stop := c.after(d, func() { close(ch) })
	defer stop()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
