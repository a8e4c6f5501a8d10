package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/clock"
)

// namingClock is the real clock that records the names of the background
// work started on it.
type namingClock struct {
	clock.Clock
	mu    sync.Mutex
	names []string
}

func (c *namingClock) Go(ctx context.Context, name string, f func(ctx context.Context)) {
	c.mu.Lock()
	c.names = append(c.names, name)
	c.mu.Unlock()
	c.Clock.Go(ctx, name, f)
}

func (c *namingClock) started(prefix string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, s := range c.names {
		if strings.HasPrefix(s, prefix) {
			n++
		}
	}
	return n
}

// reap no longer returns early for a claim made WithoutSession: such a
// claim is "left to its deadline" (do.go) only by reapOnce's first try, so
// every WithoutSession claim whose write had an unknown outcome now starts
// a background task (a goroutine, backoff from 50 ms doubling to 3.2 s)
// that counts as a pending final write (Metrics.Pending, exported as
// idem_final_writes_pending, which an alert watches) and that, while the
// store's session is reconnecting (session() fails with ErrUnavailable,
// exactly when unknown outcomes are common), retries and piles up, one per
// lost claim, until a session is back. Before the change nothing was
// started for them.
func TestReview3WithoutSessionLostClaimStartsNoReaper(t *testing.T) {
	ctx := testCtx(t)
	var cancelClaim atomic.Pointer[context.CancelFunc]
	cli := hookedClient(t, func(method string, req any, invoke func() error) error {
		if !strings.HasSuffix(method, "/Txn") || !strings.Contains(fmt.Sprint(req), "/k/default/lost-") {
			return invoke()
		}
		err := invoke()
		if c := cancelClaim.Load(); c != nil {
			(*c)() // the caller leaves while the write flies: no retry
		}
		if err != nil {
			return err
		}
		return errLost // applied, its reply lost
	})
	clk := &namingClock{Clock: clock.Real}
	s := newStore(t, cli, testPrefix(t), WithClock(clk), WithBatching(false))
	const n = 5
	for i := range n {
		cctx, cancel := context.WithCancel(ctx)
		cancelClaim.Store(&cancel)
		_, _, err := s.Claim(cctx, Key{ID: fmt.Sprintf("lost-%d", i)}, fpOf(t, "p"), WithoutSession(), WithDeadline(time.Minute))
		cancel()
		if err == nil || !errors.Is(err, ErrUnavailable) {
			t.Fatalf("claim %d = %v; want an unknown outcome (ErrUnavailable)", i, err)
		}
	}
	pending, reapers := s.Metrics().Pending, clk.started("reap ")
	if reapers != 0 || pending != 0 {
		t.Errorf("%d WithoutSession claims with unknown outcomes: %d reaper tasks started, Metrics().Pending = %d; want none (left to their deadline)",
			n, reapers, pending)
	}
	settle(t, s)
}
