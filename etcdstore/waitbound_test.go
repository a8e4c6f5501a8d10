package etcdstore

import (
	"context"
	"testing"
	"time"
)

// Issue 38: a claim that waits for a held key (the worker API's wait_ms,
// Prefer: wait) gave up at the store's request timeout, not at the wait
// the caller asked for. The caller's context bounds the wait.
func TestWaitingClaimOutlastsTheRequestTimeout(t *testing.T) {
	const requestTimeout = 500 * time.Millisecond
	s := newStore(t, client(t), testPrefix(t), WithRequestTimeout(requestTimeout))
	ctx := testCtx(t)
	held, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	// The holder ends after several request timeouts: real time passes.
	time.AfterFunc(4*requestTimeout, func() { held.Complete(context.Background(), Outcome{Body: []byte("first")}) })
	wctx, cancel := context.WithTimeout(ctx, 30*requestTimeout)
	defer cancel()
	start := time.Now()
	c, done, err := s.Claim(wctx, Key{ID: "k"}, fpOf(t, "p"), WithWait())
	if err != nil || c != nil || done == nil || string(done.Outcome.Body) != "first" {
		t.Fatalf("waiting claim after %v = %v, %v, %v; want the holder's outcome once it ended", time.Since(start).Round(time.Millisecond), c, done, err)
	}
}
