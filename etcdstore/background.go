package etcdstore

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/idem-dev/idem/clock"
)

// background runs the store's writes that must outlive the call that
// started them, retrying each until it is done, as background work of the
// store's clock:
//
//   - the final write of a claim whose work finished while etcd did not
//     answer (finishLater): the outcome exists only in this process;
//   - the fence of a claim whose own claim write had an unknown outcome
//     (reap): nobody here runs it, and others would see a live owner until
//     this process dies.
//
// Close flushes them (tries at once, without backoff) for up to a bound
// before the session is revoked: dropping a pending final write and then
// revoking the session would let a retry anywhere take the key over and run
// the work again. Tasks started after the flush gave up are refused.
type background struct {
	clk clock.Clock
	log *slog.Logger

	mu      sync.Mutex
	stopped bool
	pending int
	idle    chan struct{} // closed when pending drops to zero; nil while zero

	flushing context.Context // ends when close starts: try at once
	flushNow context.CancelFunc
	flushers []context.CancelFunc // the tasks' own flushing contexts, ended with it
	running  context.Context      // ends when close gives up: stop trying
	stopNow  context.CancelFunc
	group    clock.Group
}

func newBackground(clk clock.Clock, log *slog.Logger) *background {
	b := &background{clk: clk, log: log}
	b.flushing, b.flushNow = context.WithCancel(context.Background())
	b.running, b.stopNow = context.WithCancel(context.Background())
	return b
}

// start runs try until it reports done, waiting between tries with a
// backoff that starts at first. It reports false when the store has already
// given up on its background work (Close is over).
func (b *background) start(name string, first time.Duration, try func(ctx context.Context) bool) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped {
		return false
	}
	if b.pending == 0 {
		b.idle = make(chan struct{})
	}
	b.pending++
	b.group.Go(b.clk, b.running, name, func(ctx context.Context) {
		defer b.done()
		// Ends when Close starts to flush: a task sleeping through a long
		// backoff tries at once.
		fctx, fcancel := context.WithCancel(ctx)
		defer fcancel()
		b.mu.Lock()
		if b.flushing.Err() != nil {
			fcancel()
		} else {
			b.flushers = append(b.flushers, fcancel)
		}
		b.mu.Unlock()
		for n := 0; ; n++ {
			wait := first << min(n, 6)
			if b.flushing.Err() == nil {
				clock.Sleep(b.clk, fctx, wait)
			} else if clock.Sleep(b.clk, ctx, min(wait, 20*time.Millisecond)) != nil {
				return // closing: keep trying, quickly, until Close gives up
			}
			if ctx.Err() != nil || try(ctx) {
				return
			}
		}
	})
	return true
}

func (b *background) done() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.pending--
	if b.pending == 0 {
		close(b.idle)
		b.idle = nil
	}
}

// Pending returns how many background writes have not finished.
func (b *background) Pending() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pending
}

// close flushes the pending tasks for at most bound, then stops what is
// left, and reports how many were left unfinished.
func (b *background) close(ctx context.Context, bound time.Duration) int {
	b.mu.Lock()
	if b.stopped {
		b.mu.Unlock()
		return 0
	}
	b.flushNow()
	for _, f := range b.flushers {
		f()
	}
	b.flushers = nil
	b.mu.Unlock()
	// A task may start while Close waits (a work that finished meanwhile,
	// its final write unanswered): it is waited for within the same bound,
	// not given up the moment the tasks before it are done.
	wctx, cancel := b.clk.WithTimeout(ctx, bound)
	b.mu.Lock()
	for b.idle != nil && wctx.Err() == nil {
		idle := b.idle
		b.mu.Unlock()
		b.clk.Wait(wctx, idle)
		b.mu.Lock()
	}
	b.stopped = true
	left := b.pending
	b.mu.Unlock()
	cancel()
	b.stopNow()
	b.group.Wait(b.clk, ctx)
	return left
}
