package jobs

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/kernel"
)

// Regression (explorer seed 1796417662002153091, L4): a rate slot is set
// from the time its worker read before writing it. When the write's reply
// came back late (held, or the worker paused), the attempt started that
// much into its slot's period, and the next attempt of the key took the
// slot 300 ms after it, against a rate of one per 2 s. An attempt whose
// slot's write came back past the slack (a twentieth of the period) now
// does not start: it waits for its slot's time, and the slot stays used.
func TestReviewRateSlotWrittenLateDoesNotStartTheAttempt(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base)
	var lateBy time.Duration // how late a rate slot's write comes back, on the fake clock
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   cluster.Endpoints(),
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				err := invoker(ctx, method, req, reply, cc, opts...)
				if tr, ok := req.(*pb.TxnRequest); ok && len(tr.Success) > 0 {
					if put := tr.Success[0].GetRequestPut(); put != nil && strings.Contains(string(put.Key), "/r/") {
						master.set(master.view(0).Now().Add(lateBy))
					}
				}
				return err
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	st := newStoreOn(t, cli, prefix, etcdstore.WithClock(master.view(0)), etcdstore.WithSessionTTL(time.Minute))
	q := newQueue(t, st)
	k := Kind{Name: "pay", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Rate: 0.5, Burst: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}}}
	if err := k.validate(st.Retention()); err != nil {
		t.Fatal(err)
	}
	lims, err := k.limitsOf([]byte(`{"merchant":"m1"}`))
	if err != nil {
		t.Fatal(err)
	}
	w := &Worker{q: q, log: slog.New(slog.DiscardHandler)}
	acquire := func(id string) error {
		var got error
		_, err := st.Run(ctx, q.Key(id), etcdstore.Fingerprint{1}, func(ctx context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
			var held []heldSlot
			got = w.acquire(ctx, c, lims, &held)
			return etcdstore.Outcome{}, etcdstore.EndRelease
		})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	// On time: the attempt starts.
	if err := acquire("a1"); err != nil {
		t.Fatalf("a rate slot taken on time: %v; want the attempt to start", err)
	}
	// The period (2 s) passes; the next slot's write comes back 1.7 s late.
	master.set(master.view(0).Now().Add(2200 * time.Millisecond))
	lateBy = 1700 * time.Millisecond
	var lim *errLimited
	if err := acquire("a2"); !errors.As(err, &lim) {
		t.Fatalf("a rate slot whose write came back %v late (period 2 s): acquire = %v; want the attempt held back (*errLimited)", lateBy, err)
	}
	// Its slot counts as used for its period from its taking: 1.8 s
	// after, another attempt waits too; once it passed, one starts.
	lateBy = 0
	master.set(master.view(0).Now().Add(100 * time.Millisecond))
	if err := acquire("a3"); !errors.As(err, &lim) {
		t.Fatalf("1.8 s after a slot was taken late: acquire = %v; want the slot still used (*errLimited)", err)
	}
	master.set(lim.retry)
	if err := acquire("a4"); err != nil {
		t.Fatalf("at the slot's time (%v): acquire = %v; want the attempt to start", lim.retry, err)
	}
}

// The slack a rate slot is set longer by, and an attempt may start within:
// a twentieth of the period, at least 100 ms (so a slot's write across
// data centres is not always late: a key whose every attempt is refused
// never runs), at most a second. A kind whose period and slack outlast
// the retention is refused.
func TestRateSlackBounds(t *testing.T) {
	for _, c := range []struct{ period, want time.Duration }{
		{time.Millisecond, 100 * time.Millisecond},
		{2 * time.Second, 100 * time.Millisecond},
		{10 * time.Second, 500 * time.Millisecond},
		{time.Hour, time.Second},
	} {
		if got := kernel.RateSlack(c.period); got != c.want {
			t.Errorf("kernel.RateSlack(%v) = %v; want %v", c.period, got, c.want)
		}
	}
	k := Kind{Name: "pay", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Rate: 1, Burst: 60}}, MaxBackoff: time.Second,
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}}}
	if err := k.validate(time.Minute); !errors.Is(err, ErrInvalid) {
		t.Errorf("a 60 s period (and 1 s of slack) under a 60 s retention: %v; want ErrInvalid", err)
	}
	if err := k.validate(time.Minute + time.Second); err != nil {
		t.Errorf("a 60 s period (and 1 s of slack) under a 61 s retention: %v; want it accepted", err)
	}
}
