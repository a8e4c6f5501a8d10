package send

import (
	"context"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
)

// lostBatchKV applies every batch (a Txn of Txns) and then loses its reply,
// as a connection cut after etcd committed the batch.
type lostBatchKV struct{ *gatedKV }

func (kv lostBatchKV) Txn(ctx context.Context, req *pb.TxnRequest, opts ...grpc.CallOption) (*pb.TxnResponse, error) {
	resp, err := kv.gatedKV.Txn(ctx, req, opts...)
	if err == nil && len(req.Success) >= 2 && req.Success[0].GetRequestTxn() != nil {
		return nil, status.Error(codes.Unavailable, "connection reset after the batch was applied")
	}
	return resp, err
}

// A batch applied whose reply is lost answers each of its writes with an
// error saying it may have landed, never with ErrNotSent: a caller told
// ErrNotSent takes its write for one that did not happen (a claim would
// not be reaped, a checkpoint not be read back), and it did.
func TestBatchLostReplyMayHaveLandedForEveryMember(t *testing.T) {
	gated := newGatedKV(t)
	kv := lostBatchKV{gated}
	s := New(Config{KV: kv, Clock: clock.Real, Batching: true, MaxMembers: 2,
		Try: func(ctx context.Context) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, time.Minute)
		}})
	ctx := context.Background()
	prefix := "/lost-batch-" + time.Now().Format("150405.000000") + "/"
	errs := make(chan error, 3)
	write := func(key string) {
		go func() {
			_, err := s.Txn(ctx, putReq(prefix+key), []string{prefix + key})
			errs <- err
		}()
	}
	defer func() {
		for _, g := range []string{prefix + "w1", prefix + "a," + prefix + "b"} {
			func() { defer func() { recover() }(); gated.open(g) }()
		}
	}()
	write("w1") // idle: sent at once, alone, held at etcd
	expectArrival(t, gated, prefix+"w1")
	write("a") // a write flies: [a] waits for company or the hold
	waitQueued(t, s, 1)
	write("b") // [a b] is full: sent as one batch beside w1
	expectArrival(t, gated, prefix+"a,"+prefix+"b")
	gated.open(prefix + "a," + prefix + "b")
	for range 2 {
		err := <-errs
		if err == nil || !MayHaveLanded(err) {
			t.Errorf("a member of an applied batch whose reply was lost answered %v; want an error that may have landed (not ErrNotSent)", err)
		}
	}
	// It did land: both keys are there.
	for _, k := range []string{"a", "b"} {
		r, err := gated.KVClient.Range(ctx, &pb.RangeRequest{Key: []byte(prefix + k)})
		if err != nil || len(r.Kvs) != 1 {
			t.Fatalf("%s after the batch: %v, %v; want it written", k, r, err)
		}
	}
	gated.open(prefix + "w1")
	if err := <-errs; err != nil {
		t.Fatalf("w1: %v", err)
	}
}
