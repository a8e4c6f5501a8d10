package idemgrpc_test

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemgrpc"
	pb "github.com/idem-dev/idem/idemgrpc/internal/paymentpb"
)

// Issue 38: a server whose process died while its handler ran (its session
// lease gone) left a claim that the next server took over and ran again:
// a second charge. Under the default policy the takeover answers that the
// outcome is unknown and never calls the handler; with
// OnUnknownOutcome: EndRelease it runs it again, with a greater token.
func TestTakeoverAfterACrashDoesNotRunTheHandlerAgain(t *testing.T) {
	for _, policy := range []etcdstore.End{etcdstore.EndSave, etcdstore.EndRelease} {
		t.Run(policy.String(), func(t *testing.T) {
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
			storeB, err := etcdstore.New(ctx, a.store.Client(), etcdstore.WithPrefix(a.store.Prefix()))
			if err != nil {
				t.Fatal(err)
			}
			defer storeB.Close()
			b := start(t, idemgrpc.Config{Store: storeB, OnUnknownOutcome: policy})
			req := &pb.ChargeRequest{Account: "acct", Amount: 5}
			go a.client(t).Charge(withKey("order-1"), req) // its answer never comes: its process "dies"
			<-entered
			// A's process dies: its session lease ends, so its claim may be
			// taken over at once.
			owner := a.store.Owner()
			resp, err := a.store.Client().Get(ctx, a.store.Prefix()+"o/"+owner)
			if err != nil || len(resp.Kvs) != 1 {
				t.Fatalf("A's owner key: %v, %v", resp, err)
			}
			if _, err := a.store.Client().Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
				t.Fatal(err)
			}
			_, err = b.client(t).Charge(withKey("order-1"), req)
			switch policy {
			case etcdstore.EndSave:
				if status.Code(err) != codes.Unknown || reason(err) != idemgrpc.ReasonOutcomeUnknown || b.svc.count("acct") != 0 {
					t.Fatalf("retry through B after A died = %v (reason %q), B's charges %d; want UNKNOWN %s and no second charge", err, reason(err), b.svc.count("acct"), idemgrpc.ReasonOutcomeUnknown)
				}
				if _, again := b.client(t).Charge(withKey("order-1"), req); status.Code(again) != codes.Unknown || b.svc.count("acct") != 0 {
					t.Fatalf("a later retry = %v; want the saved UNKNOWN replayed", again)
				}
			default:
				if err != nil || b.svc.count("acct") != 1 {
					t.Fatalf("retry through B after A died = %v, B's charges %d; want the handler run again", err, b.svc.count("acct"))
				}
			}
		})
	}
}
