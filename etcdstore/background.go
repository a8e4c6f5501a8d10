package etcdstore

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/idem-dev/idem/internal/sim"
)

// background runs the store's writes that must outlive the call that
// started them, retrying each until it is done:
//
//   - the final write of a claim whose work finished while etcd did not
//     answer (finishLater): the outcome exists only in this process;
//   - the abandon of a claim whose own claim write had an unknown outcome
//     (abandonIfOurs): nobody here runs it, and others would see a live
//     owner until this process dies.
//
// Close flushes them (tries at once, without backoff) for up to a bound
// before the session is revoked: dropping a pending final write and then
// revoking the session would let a retry anywhere take the key over and run
// the work again. Tasks started after the flush gave up are refused.
type background struct {
	sim *sim.Hooks // nil: real goroutines and timers
	log *slog.Logger

	mu      sync.Mutex
	stopped bool
	pending int
	idle    chan struct{} // closed when pending drops to zero; nil while zero

	flush chan struct{} // closed by close: try at once
	stop  chan struct{} // closed when close gives up: stop trying
	wg    sync.WaitGroup
}

func newBackground(h *sim.Hooks, log *slog.Logger) *background {
	return &background{sim: h, log: log, flush: make(chan struct{}), stop: make(chan struct{})}
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
	if b.sim != nil {
		b.sim.Spawn(name, func(ctx context.Context) bool {
			done := try(ctx)
			if done {
				b.done()
			}
			return done
		})
		return true
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		defer b.done()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-b.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		for n := 0; ; n++ {
			wait := first << min(n, 6)
			select {
			case <-b.flush:
				wait = min(wait, 20*time.Millisecond) // closing: keep trying, quickly
			default:
			}
			t := time.NewTimer(wait)
			select {
			case <-b.stop:
				t.Stop()
				return
			case <-t.C:
			}
			if try(ctx) {
				return
			}
		}
	}()
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
func (b *background) close(bound time.Duration) int {
	b.mu.Lock()
	if b.stopped {
		b.mu.Unlock()
		return 0
	}
	close(b.flush)
	idle := b.idle
	b.mu.Unlock()
	switch {
	case b.sim != nil:
		b.sim.Flush()
	case idle != nil:
		t := time.NewTimer(bound)
		select {
		case <-idle:
		case <-t.C:
		}
		t.Stop()
	}
	b.mu.Lock()
	b.stopped = true
	left := b.pending
	close(b.stop)
	b.mu.Unlock()
	b.wg.Wait()
	return left
}
