package etcdstore

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdtest"
)

// sessionLeaseID returns the current session's lease, for tests that kill
// it.
func (s *Store) sessionLeaseID() clientv3.LeaseID {
	_, id, _ := s.sessionLease()
	return id
}

// shiftClock is the real clock moved forward by a shift a test may change
// at any time (record expiry, deadlines); its timers stay real.
type shiftClock struct {
	clock.Clock
	shift atomic.Int64
}

func newShiftClock() *shiftClock { return &shiftClock{Clock: clock.Real} }

func (c *shiftClock) Now() time.Time { return time.Now().Add(time.Duration(c.shift.Load())) }

// Shift moves the clock's time d ahead of real time.
func (c *shiftClock) Shift(d time.Duration) { c.shift.Store(int64(d)) }

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
		t.Fatalf("background writes still pending after 30 s: %d", s.Metrics().Pending)
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

// withSweepPace makes the sweeper sweep a bucket margin after its records
// expired, within window (a test's retention is seconds, not hours), and
// call listed, when set, with each sweep's listed records before its
// deletes.
func withSweepPace(margin, window time.Duration, listed func([]string)) Option {
	return option(func(c *config) error {
		c.sweepMargin, c.sweepWindow, c.sweepListed = margin, window, listed
		return nil
	})
}

// withDictionaryRefresh makes dictionaries due for a successor after d
// (default a day).
func withDictionaryRefresh(d time.Duration) Option {
	return option(func(c *config) error { c.dictRefresh = d; return nil })
}

func (m DictionaryMetrics) add(o DictionaryMetrics) DictionaryMetrics {
	return Metrics{Dictionaries: m}.Add(Metrics{Dictionaries: o}).Dictionaries
}

// SingleCluster is the package's shared single-member cluster, for the
// external tests (the conformance suite).
func SingleCluster() *etcdtest.Cluster { return single }
