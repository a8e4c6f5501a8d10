package idemgrpc_test

import (
	"bytes"
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	etcdpb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemgrpc"
	pb "github.com/idem-dev/idem/idemgrpc/internal/paymentpb"
)

// Promise (CHANGELOG 0.5.0, issue 38; GRPC.md): under the default
// OnUnknownOutcome (save), a takeover of a claim whose handler may have
// run saves UNKNOWN (IDEMPOTENT_OUTCOME_UNKNOWN) "without calling the
// handler". Here the takeover's claim Txn lands but its reply is lost (a
// network fault): the claim's own retry recognises its landed takeover and
// wins it without a Previous record, so the interceptor's check (TookOver
// and Previous) lets the handler run a second time.
func TestReview6ALostTakeoverReplyDoesNotRunTheHandlerAgain(t *testing.T) {
	a := start(t, idemgrpc.Config{})
	entered, release := make(chan struct{}), make(chan struct{})
	a.svc.hook = func(ctx context.Context, req *pb.ChargeRequest) error {
		close(entered)
		<-release
		return nil
	}
	defer close(release)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	prefix := a.store.Prefix()
	owners := []byte(prefix + "o/")
	var lose, lost atomic.Int32
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: a.store.Client().Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				err := invoker(ctx, method, req, reply, cc, opts...)
				tr, ok1 := req.(*etcdpb.TxnRequest)
				resp, ok2 := reply.(*etcdpb.TxnResponse)
				if err != nil || !strings.HasSuffix(method, "/Txn") || !ok1 || !ok2 || !resp.Succeeded {
					return err
				}
				claim := false
				for _, c := range tr.Compare {
					claim = claim || bytes.HasPrefix(c.Key, owners)
				}
				if claim && lose.Add(-1) >= 0 {
					lost.Add(1)
					return status.Error(codes.Unavailable, "test: reply lost after the txn was applied")
				}
				return err
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	storeB, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(prefix), etcdstore.WithBatching(false))
	if err != nil {
		t.Fatal(err)
	}
	defer storeB.Close()
	b := start(t, idemgrpc.Config{Store: storeB})
	req := &pb.ChargeRequest{Account: "acct", Amount: 5}
	go a.client(t).Charge(withKey("order-1"), req) // its answer never comes: its process "dies"
	<-entered
	owner := a.store.Owner()
	resp, err := a.store.Client().Get(ctx, prefix+"o/"+owner)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("A's owner key: %v, %v", resp, err)
	}
	if _, err := a.store.Client().Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	lose.Store(1) // the reply of B's takeover is lost
	_, err = b.client(t).Charge(withKey("order-1"), req)
	if lost.Load() == 0 {
		t.Fatalf("no claim reply was lost: the fault did not fire (answer %v)", err)
	}
	if status.Code(err) != codes.Unknown || reason(err) != idemgrpc.ReasonOutcomeUnknown || b.svc.count("acct") != 0 {
		t.Fatalf("retry through B after A died, B's takeover reply lost = %v (reason %q), B's charges %d; want UNKNOWN %s and no second charge",
			err, reason(err), b.svc.count("acct"), idemgrpc.ReasonOutcomeUnknown)
	}
}
