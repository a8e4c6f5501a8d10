package etcdstore

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// sessionLease returns the current session's lease, for tests that kill it.
func (s *Store) sessionLease() clientv3.LeaseID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sess.Lease()
}

// setClock replaces the store's clock. The store must have no sweeper
// (WithExpirySweep(false)): it reads the clock from its own goroutine.
func (s *Store) setClock(now func() time.Time) {
	if s.sweep != nil {
		panic("setClock on a store with a sweeper")
	}
	s.now = now
}

// settle waits until the store's background writes (final writes retried
// later, abandons of ambiguous claims) have all finished.
func settle(t testing.TB, s *Store) {
	t.Helper()
	s.bg.mu.Lock()
	idle := s.bg.idle
	s.bg.mu.Unlock()
	if idle == nil {
		return
	}
	select {
	case <-idle:
	case <-time.After(30 * time.Second):
		t.Fatalf("background writes still pending after 30 s: %d", s.Pending())
	}
}

// interceptor sees every unary etcd call of a hookedClient: it may call
// invoke (which sends the call to etcd) or not, and returns the call's
// error as the store will see it.
type interceptor func(method string, req any, invoke func() error) error

// hookedClient returns a client of the single-member cluster whose unary
// calls go through hook.
func hookedClient(t testing.TB, hook interceptor) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   single.Endpoints(),
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				return hook(method, req, func() error { return invoker(ctx, method, req, reply, cc, opts...) })
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// errLost is what a hookedClient's caller sees for a call whose reply was
// lost, or that failed before it reached etcd.
var errLost = status.Error(codes.Unavailable, "test: connection lost")

// setSweepPace makes the sweeper sweep a bucket margin after its records
// expired, within window: a test's retention is seconds, not hours.
func (s *Store) setSweepPace(margin, window time.Duration) { s.setSweepHook(margin, window, nil) }

// setSweepHook is setSweepPace with a hook called with each sweep's listed
// records, before its deletes. Call it right after New: the sweeper reads
// these from its goroutine under the store's mutex.
func (s *Store) setSweepHook(margin, window time.Duration, listed func([]string)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepMargin, s.sweepWindow, s.sweepListed = margin, window, listed
}
