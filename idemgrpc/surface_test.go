package idemgrpc_test

// Regression tests for the gRPC paths a black-box attack found (issue 25):
// each fails with its fix reverted.

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdstore/etcdstoretest"
	"github.com/idem-dev/idem/idemgrpc"
	pb "github.com/idem-dev/idem/idemgrpc/internal/paymentpb"
)

// chargeStreams is a server-streaming method whose request carries an
// AIP-155 request_id: it charges once per call that reaches it.
var chargeStreams = grpc.ServiceDesc{
	ServiceName: "idem.test.Streams",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName:    "Charges",
		ServerStreams: true,
		Handler: func(srv any, stream grpc.ServerStream) error {
			req := new(pb.ChargeRequest)
			if err := stream.RecvMsg(req); err != nil {
				return err
			}
			p := srv.(*payments)
			p.mu.Lock()
			p.charges[req.Account]++
			p.mu.Unlock()
			return stream.SendMsg(&pb.ChargeReply{Account: req.Account})
		},
	}},
}

func callStream(cc *grpc.ClientConn, ctx context.Context, req *pb.ChargeRequest) error {
	s, err := cc.NewStream(ctx, &chargeStreams.Streams[0], "/idem.test.Streams/Charges")
	if err != nil {
		return err
	}
	if err := s.SendMsg(req); err != nil {
		return err
	}
	if err := s.CloseSend(); err != nil {
		return err
	}
	return s.RecvMsg(new(pb.ChargeReply))
}

// A keyed server stream with its key only in the request's request_id is
// refused before its handler acts, as one keyed in the metadata is.
func TestKeyedStreamInRequestIDIsRefused(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	cc := r.conn(t)
	for range 2 {
		err := callStream(cc, context.Background(), &pb.ChargeRequest{RequestId: "op-1", Account: "streamed", Amount: 1})
		if status.Code(err) != codes.Unimplemented || !strings.Contains(status.Convert(err).Message(), "request_id") {
			t.Fatalf("a stream keyed by request_id: %v, want UNIMPLEMENTED naming the field", err)
		}
	}
	if err := callStream(cc, withKey("op-2"), &pb.ChargeRequest{Account: "streamed", Amount: 1}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("a stream keyed by metadata: %v, want UNIMPLEMENTED", err)
	}
	if n := r.svc.count("streamed"); n != 0 {
		t.Fatalf("keyed streams charged %d times, want 0", n)
	}
	if err := callStream(cc, context.Background(), &pb.ChargeRequest{Account: "unkeyed", Amount: 1}); err != nil {
		t.Fatalf("an unkeyed stream: %v", err)
	}
	if n := r.svc.count("unkeyed"); n != 1 {
		t.Fatalf("an unkeyed stream charged %d times, want 1", n)
	}
}

// A ClaimDeadline that a handler could outlive is refused, naming both
// values.
func TestClaimDeadlineShorterThanTheHandlerIsRefused(t *testing.T) {
	_, err := idemgrpc.New(idemgrpc.Config{Store: etcdstoretest.New(t), ClaimDeadline: 500 * time.Millisecond})
	if !errors.Is(err, etcdstore.ErrInvalidArgument) || !strings.Contains(err.Error(), "500ms") || !strings.Contains(err.Error(), "30s") {
		t.Fatalf("ClaimDeadline 500ms with the default HandlerTimeout: %v, want an error naming both", err)
	}
	if _, err := idemgrpc.New(idemgrpc.Config{Store: etcdstoretest.New(t), ClaimDeadline: time.Minute, HandlerTimeout: 40 * time.Second}); err != nil {
		t.Fatalf("ClaimDeadline 1m, HandlerTimeout 40s: %v", err)
	}
}

// A handler that honours its context has ended, and its answer is saved,
// before its claim's deadline lets a retry take the key over, even when
// the caller's deadline is later than the claim's.
func TestHandlerEndsBeforeItsClaimDeadline(t *testing.T) {
	const claimDeadline = 2 * time.Second
	r := start(t, idemgrpc.Config{ClaimDeadline: claimDeadline, HandlerTimeout: time.Second})
	started := make(chan struct{}, 2)
	r.svc.hook = func(ctx context.Context, _ *pb.ChargeRequest) error {
		started <- struct{}{}
		<-ctx.Done() // a slow bank, which gives up when asked to
		return status.FromContextError(ctx.Err()).Err()
	}
	c := r.client(t)
	req := &pb.ChargeRequest{Account: "slow", Amount: 1}
	ctx, cancel := context.WithTimeout(withKey("op-slow"), 20*time.Second)
	defer cancel()
	first := make(chan error, 1)
	go func() {
		_, err := c.Charge(ctx, req)
		first <- err
	}()
	<-started
	begun := time.Now()
	// Retries until one is not refused as in flight: past the claim's
	// deadline, a handler still running would be run again.
	var err error
	for time.Since(begun) < 15*time.Second {
		var h metadata.MD
		_, err = c.Charge(withKey("op-slow"), req, grpc.Header(&h))
		if status.Code(err) != codes.Aborted {
			if !idemgrpc.Replayed(h) {
				t.Fatalf("the retry after %v: %v, not a replay", time.Since(begun), err)
			}
			break
		}
		time.Sleep(100 * time.Millisecond) // a client's retry backoff
	}
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("the retry: %v, want the first run's DEADLINE_EXCEEDED replayed", err)
	}
	if err := <-first; status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("the first call: %v", err)
	}
	if n := r.svc.count("slow"); n != 1 {
		t.Fatalf("charged %d times, want 1: a retry took the key over while the handler ran", n)
	}
}

// One operation is one fingerprint, whether its key travels in the
// metadata or (as the client interceptor's WithKey also sends it) in the
// request's request_id field.
func TestKeyInMetadataOrFieldIsOneOperation(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	plain := r.client(t)
	keyed := r.client(t, grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor()))
	req := &pb.ChargeRequest{Account: "one-op", Amount: 7}
	first, err := plain.Charge(withKey("op-1"), req)
	if err != nil {
		t.Fatal(err)
	}
	var h metadata.MD
	again, err := keyed.Charge(idemgrpc.WithKey(context.Background(), "op-1"), req, grpc.Header(&h))
	if err != nil || !idemgrpc.Replayed(h) || again.Id != first.Id {
		t.Fatalf("the same operation with its key in request_id: %v %v replayed=%v, want %v replayed", again, err, idemgrpc.Replayed(h), first)
	}
	// And the other way round: first in the field only.
	if _, err := plain.Charge(context.Background(), &pb.ChargeRequest{RequestId: "op-2", Account: "one-op", Amount: 7}); err != nil {
		t.Fatal(err)
	}
	if _, err := plain.Charge(withKey("op-2"), &pb.ChargeRequest{Account: "one-op", Amount: 7}, grpc.Header(&h)); err != nil || !idemgrpc.Replayed(h) {
		t.Fatalf("op-2 again with its key in the metadata: %v replayed=%v", err, idemgrpc.Replayed(h))
	}
	if n := r.svc.count("one-op"); n != 2 {
		t.Fatalf("charged %d times, want 2 (one per operation)", n)
	}
}

// The client interceptor never writes into the caller's message: a request
// object reused for three operations is three charges.
func TestClientInterceptorLeavesTheRequestAlone(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	c := r.client(t, grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor()))
	req := &pb.ChargeRequest{Account: "reused", Amount: 3}
	for i := range 3 {
		var h metadata.MD
		if _, err := c.Charge(context.Background(), req, grpc.Header(&h)); err != nil || idemgrpc.Replayed(h) {
			t.Fatalf("operation %d: %v replayed=%v, want a fresh run", i, err, idemgrpc.Replayed(h))
		}
		if req.RequestId != "" {
			t.Fatalf("operation %d: the interceptor wrote %q into the caller's request", i, req.RequestId)
		}
	}
	if n := r.svc.count("reused"); n != 3 {
		t.Fatalf("charged %d times, want 3", n)
	}
}

// A saved error status is marked replayed on every replay, and grpc-go's
// retry policy (the documented one, which retries UNAVAILABLE and
// ABORTED) sends neither the first answer nor a replay again.
func TestSavedStatusIsNotResentByARetryPolicy(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	r.svc.hook = func(context.Context, *pb.ChargeRequest) error {
		return status.Error(codes.Unavailable, "the ledger timed out after the debit")
	}
	c := r.client(t, grpc.WithDefaultServiceConfig(retryPolicy))
	var attempts atomic.Int32
	count := func() int {
		for {
			select {
			case <-r.answered:
				attempts.Add(1)
			default:
				return int(attempts.Swap(0))
			}
		}
	}
	req := &pb.ChargeRequest{Account: "saved", Amount: 1}
	var h metadata.MD
	_, err := c.Charge(withKey("op-u"), req, grpc.Header(&h))
	if status.Code(err) != codes.Unavailable || idemgrpc.Replayed(h) {
		t.Fatalf("the first call: %v replayed=%v", err, idemgrpc.Replayed(h))
	}
	if n := count(); n != 1 {
		t.Fatalf("the first call was sent %d times, want 1: a saved status is final", n)
	}
	_, err = c.Charge(withKey("op-u"), req, grpc.Header(&h))
	if status.Code(err) != codes.Unavailable || !idemgrpc.Replayed(h) {
		t.Fatalf("the retry: %v replayed=%v, want the saved UNAVAILABLE marked replayed", err, idemgrpc.Replayed(h))
	}
	if n := count(); n != 1 {
		t.Fatalf("the replay was sent %d times, want 1", n)
	}
	if n := r.svc.count("saved"); n != 1 {
		t.Fatalf("charged %d times, want 1", n)
	}
}
