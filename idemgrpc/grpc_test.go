package idemgrpc_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	retry "github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	otelcodes "go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdstore/etcdstoretest"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/idemgrpc"
	pb "github.com/idem-dev/idem/idemgrpc/internal/paymentpb"
)

// payments is a service with a non-idempotent effect: every Charge that
// runs is counted per account.
type payments struct {
	pb.UnimplementedPaymentsServer
	mu      sync.Mutex
	charges map[string]int // by account
	seq     int
	// hook, when set, runs inside Charge after the effect, before the reply.
	hook func(ctx context.Context, req *pb.ChargeRequest) error
}

func (p *payments) Charge(ctx context.Context, req *pb.ChargeRequest) (*pb.ChargeReply, error) {
	// The claim's token, in the context and in the metadata of the calls
	// this handler would make downstream; none without a claim.
	tok, claimed := fencing.FromContext(ctx)
	md, _ := metadata.FromOutgoingContext(ctx)
	if got := md.Get(idemgrpc.MetadataFencing); claimed && (len(got) != 1 || got[0] != tok.String()) || !claimed && len(got) != 0 {
		return nil, status.Errorf(codes.Internal, "outgoing fencing metadata %v, token %v", got, tok)
	}
	if in, ok, _ := idemgrpc.TokenFromIncoming(ctx); claimed && (!ok || in != tok) {
		return nil, status.Errorf(codes.Internal, "incoming fencing metadata %v, the claim's token %v", in, tok)
	}
	p.mu.Lock()
	p.charges[req.Account]++
	p.seq++
	id := fmt.Sprintf("ch_%d", p.seq)
	p.mu.Unlock()
	if p.hook != nil {
		if err := p.hook(ctx, req); err != nil {
			return nil, err
		}
	}
	return &pb.ChargeReply{Id: id, Account: req.Account, Amount: req.Amount, FencingToken: int64(tok)}, nil
}

func (p *payments) Watch(req *pb.WatchRequest, s grpc.ServerStreamingServer[pb.ChargeReply]) error {
	return s.Send(&pb.ChargeReply{Account: req.Account})
}

func (p *payments) count(account string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.charges[account]
}

type rig struct {
	store    *etcdstore.Store
	svc      *payments
	proxy    *etcdtest.Proxy // between clients and the server
	answered chan codes.Code // the code of every call the server answered
}

// start serves payments behind the interceptor on a loopback port, with a
// TCP proxy in front that a test can cut.
func start(t *testing.T, cfg idemgrpc.Config) *rig {
	t.Helper()
	r := &rig{store: etcdstoretest.New(t), svc: &payments{charges: map[string]int{}}, answered: make(chan codes.Code, 1000)}
	if cfg.Store == nil {
		cfg.Store = r.store
	}
	icp, err := idemgrpc.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	observe := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		select {
		case r.answered <- status.Code(err):
		default:
		}
		return resp, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(observe, icp.Unary()), grpc.ChainStreamInterceptor(icp.Stream()))
	pb.RegisterPaymentsServer(srv, r.svc)
	srv.RegisterService(&chargeStreams, r.svc)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	r.proxy, err = etcdtest.NewProxy(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.proxy.Close)
	return r
}

func (r *rig) client(t *testing.T, opts ...grpc.DialOption) pb.PaymentsClient {
	t.Helper()
	return pb.NewPaymentsClient(r.conn(t, opts...))
}

func (r *rig) conn(t *testing.T, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(r.proxy.Addr(), append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func withKey(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), idemgrpc.MetadataKey, key)
}

func reason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.Reason
		}
	}
	return ""
}

func retryDelay(err error) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.RetryDelay.AsDuration()
		}
	}
	return -1
}

func TestReplayCarriesTheFirstResponse(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	c := r.client(t)
	req := &pb.ChargeRequest{Account: "acct-1", Amount: 500, Labels: map[string]string{"a": "1", "b": "2", "c": "3"}}
	var h1, h2, tr1 metadata.MD
	first, err := c.Charge(withKey("order-1"), req, grpc.Header(&h1), grpc.Trailer(&tr1))
	if err != nil {
		t.Fatal(err)
	}
	if idemgrpc.Replayed(h1) || len(tr1.Get(idemgrpc.MetadataRetention)) != 1 {
		t.Fatalf("first call's header %v, trailer %v: want no replay mark and a retention", h1, tr1)
	}
	if first.FencingToken <= 0 {
		t.Fatalf("the handler saw no fencing token: %v", first)
	}
	// The same request again (a map: its encoding must be deterministic).
	again := proto.Clone(req).(*pb.ChargeRequest)
	second, err := c.Charge(withKey("order-1"), again, grpc.Header(&h2))
	if err != nil {
		t.Fatal(err)
	}
	if !idemgrpc.Replayed(h2) || !proto.Equal(first, second) {
		t.Fatalf("second call: replayed=%v %v, want the first response %v", idemgrpc.Replayed(h2), second, first)
	}
	if n := r.svc.count("acct-1"); n != 1 {
		t.Fatalf("charged %d times, want 1", n)
	}
	// Without a key, calls pass through and each one runs.
	for range 2 {
		reply, err := c.Charge(context.Background(), &pb.ChargeRequest{Account: "acct-2", Amount: 1}, grpc.Header(&h2))
		if err != nil || reply.FencingToken != 0 || idemgrpc.Replayed(h2) {
			t.Fatalf("an unkeyed call: %v %v replayed=%v, want a run without a token", reply, err, idemgrpc.Replayed(h2))
		}
	}
	if n := r.svc.count("acct-2"); n != 2 {
		t.Fatalf("unkeyed calls ran %d times, want 2", n)
	}
}

func TestKeyFromRequestIDField(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	c := r.client(t)
	req := &pb.ChargeRequest{RequestId: "7d3c2f0e-aaaa-4bbb-8ccc-000000000001", Account: "acct-1", Amount: 5}
	for range 3 {
		if _, err := c.Charge(context.Background(), req); err != nil {
			t.Fatal(err)
		}
	}
	if n := r.svc.count("acct-1"); n != 1 {
		t.Fatalf("charged %d times, want 1", n)
	}
	// The metadata and the field must agree.
	_, err := c.Charge(withKey("another"), req)
	if status.Code(err) != codes.InvalidArgument || reason(err) != idemgrpc.ReasonInvalidKey {
		t.Fatalf("metadata and field differ: %v, want INVALID_ARGUMENT %s", err, idemgrpc.ReasonInvalidKey)
	}
	// Agreeing is fine, and replays.
	if _, err := c.Charge(withKey(req.RequestId), req); err != nil {
		t.Fatal(err)
	}
	if n := r.svc.count("acct-1"); n != 1 {
		t.Fatalf("charged %d times, want 1", n)
	}
}

func TestMismatchAndBadInput(t *testing.T) {
	r := start(t, idemgrpc.Config{RequireKey: func(m string) bool { return m == pb.Payments_Charge_FullMethodName }})
	c := r.client(t)
	if _, err := c.Charge(withKey("k1"), &pb.ChargeRequest{Account: "a", Amount: 1}); err != nil {
		t.Fatal(err)
	}
	_, err := c.Charge(withKey("k1"), &pb.ChargeRequest{Account: "a", Amount: 2})
	if status.Code(err) != codes.FailedPrecondition || reason(err) != idemgrpc.ReasonKeyReused {
		t.Fatalf("key reused with another amount: %v, want FAILED_PRECONDITION %s", err, idemgrpc.ReasonKeyReused)
	}
	_, err = c.Charge(context.Background(), &pb.ChargeRequest{Account: "a", Amount: 1})
	if status.Code(err) != codes.InvalidArgument || reason(err) != idemgrpc.ReasonMissingKey {
		t.Fatalf("no key on a method that requires one: %v", err)
	}
	long := make([]byte, etcdstore.MaxKeyLen+1)
	for i := range long {
		long[i] = 'x'
	}
	_, err = c.Charge(withKey(string(long)), &pb.ChargeRequest{Account: "a", Amount: 1})
	if status.Code(err) != codes.InvalidArgument || reason(err) != idemgrpc.ReasonInvalidKey {
		t.Fatalf("a key over the length limit: %v", err)
	}
	if n := r.svc.count("a"); n != 1 {
		t.Fatalf("bad input ran the handler: %d charges, want 1", n)
	}
	// A fencing token the client sends is replaced by the claim's: the
	// handler checks it sees its claim's token, incoming and outgoing.
	forged := metadata.AppendToOutgoingContext(withKey("k2"), idemgrpc.MetadataFencing, "999999999")
	if reply, err := c.Charge(forged, &pb.ChargeRequest{Account: "b", Amount: 1}); err != nil || reply.FencingToken == 999999999 {
		t.Fatalf("a client-sent fencing token: %v %v", reply, err)
	}
	// A keyed stream is refused; an unkeyed one passes.
	s, err := c.Watch(withKey("k3"), &pb.WatchRequest{Account: "a"})
	if err == nil {
		_, err = s.Recv()
	}
	if status.Code(err) != codes.Unimplemented {
		t.Fatalf("a keyed stream: %v, want UNIMPLEMENTED", err)
	}
	s, err = c.Watch(context.Background(), &pb.WatchRequest{Account: "a"})
	if err == nil {
		_, err = s.Recv()
	}
	if err != nil {
		t.Fatalf("an unkeyed stream: %v", err)
	}
}

func TestConflictIsAbortedWithRetryInfo(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	running, release := make(chan struct{}), make(chan struct{})
	r.svc.hook = func(context.Context, *pb.ChargeRequest) error {
		close(running)
		<-release
		return nil
	}
	c := r.client(t)
	req := &pb.ChargeRequest{Account: "a", Amount: 1}
	done := make(chan error, 1)
	go func() {
		_, err := c.Charge(withKey("k"), req)
		done <- err
	}()
	<-running
	_, err := c.Charge(withKey("k"), req)
	if status.Code(err) != codes.Aborted || reason(err) != idemgrpc.ReasonInFlight || retryDelay(err) <= 0 {
		t.Fatalf("a second call while the first runs: %v (retry delay %v), want ABORTED %s with RetryInfo", err, retryDelay(err), idemgrpc.ReasonInFlight)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var h metadata.MD
	if _, err := c.Charge(withKey("k"), req, grpc.Header(&h)); err != nil || !idemgrpc.Replayed(h) {
		t.Fatalf("after the first ended: %v replayed=%v", err, idemgrpc.Replayed(h))
	}
	if n := r.svc.count("a"); n != 1 {
		t.Fatalf("charged %d times, want 1", n)
	}
}

func TestHandlerStatusesSavedOrReleased(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	var fail atomic.Value // func() error
	r.svc.hook = func(context.Context, *pb.ChargeRequest) error {
		if f, _ := fail.Load().(func() error); f != nil {
			return f()
		}
		return nil
	}
	none := func() error { return nil }
	c := r.client(t)
	// A failure that may have acted is saved: a retry gets the same error,
	// whatever its code, RetryInfo or not.
	for i, f := range []func() error{
		func() error { return status.Error(codes.Internal, "declined by the bank") },
		func() error {
			st, _ := status.New(codes.Unavailable, "the ledger timed out").WithDetails(&errdetails.RetryInfo{})
			return st.Err()
		},
		func() error { return status.Error(codes.ResourceExhausted, "a downstream answer too large") },
	} {
		acct := fmt.Sprint("saved-", i)
		fail.Store(f)
		_, first := c.Charge(withKey("k-"+acct), &pb.ChargeRequest{Account: acct, Amount: 1})
		fail.Store(none) // the replay must not run the handler
		_, again := c.Charge(withKey("k-"+acct), &pb.ChargeRequest{Account: acct, Amount: 1})
		if first == nil || status.Code(again) != status.Code(first) || status.Convert(again).Message() != status.Convert(first).Message() {
			t.Fatalf("%s: %v then %v, want the saved error replayed", acct, first, again)
		}
		if n := r.svc.count(acct); n != 1 {
			t.Fatalf("%s: a saved error ran the handler %d times, want 1", acct, n)
		}
	}
	// NotExecuted releases the key: a retry runs the handler again.
	for _, code := range []codes.Code{codes.ResourceExhausted, codes.Unavailable} {
		acct := "released-" + code.String()
		fail.Store(func() error { return idemgrpc.NotExecuted(code, "try later", time.Second) })
		if _, err := c.Charge(withKey("k-"+acct), &pb.ChargeRequest{Account: acct, Amount: 1}); status.Code(err) != code || retryDelay(err) != time.Second {
			t.Fatalf("%v, want %v with a retry delay", err, code)
		}
		fail.Store(none)
		var h metadata.MD
		if _, err := c.Charge(withKey("k-"+acct), &pb.ChargeRequest{Account: acct, Amount: 1}, grpc.Header(&h)); err != nil || idemgrpc.Replayed(h) {
			t.Fatalf("after %v: %v replayed=%v, want a fresh run", code, err, idemgrpc.Replayed(h))
		}
		if n := r.svc.count(acct); n != 2 {
			t.Fatalf("%v: ran %d times, want 2 (released, then run again)", code, n)
		}
	}
}

// grpc-go's retry policy retries idem's ABORTED (the key in flight): the
// retry of a call whose first attempt still runs waits and gets its answer.
// It retries only trailers-only responses, so this fails if idem sets a
// header before refusing.
func TestRetryPolicyRetriesConflicts(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	running, release := make(chan struct{}), make(chan struct{})
	r.svc.hook = func(_ context.Context, req *pb.ChargeRequest) error {
		if req.Account == "slow" {
			close(running)
			<-release
		}
		return nil
	}
	plain := r.client(t)
	retrying := r.client(t, grpc.WithDefaultServiceConfig(`{"methodConfig": [{
  "name": [{"service": "idem.example.payments.v1.Payments"}],
  "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "1s", "backoffMultiplier": 2,
                  "retryableStatusCodes": ["ABORTED"]}}]}`))
	req := &pb.ChargeRequest{Account: "slow", Amount: 1}
	done := make(chan error, 1)
	go func() {
		_, err := plain.Charge(withKey("k-slow"), req)
		done <- err
	}()
	<-running
	go func() {
		// Once the retrying call's first attempt was refused, the first
		// call ends.
		for code := range r.answered {
			if code == codes.Aborted {
				close(release)
				return
			}
		}
	}()
	var h metadata.MD
	reply, err := retrying.Charge(withKey("k-slow"), req, grpc.Header(&h))
	if err != nil || !idemgrpc.Replayed(h) {
		t.Fatalf("the retried call: %v %v replayed=%v, want the first call's answer replayed", reply, err, idemgrpc.Replayed(h))
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := r.svc.count("slow"); n != 1 {
		t.Fatalf("charged %d times", n)
	}
}

// lostReplies drops the client's connections after the handler charged but
// before its reply left, on the first attempt of every order.
func lostReplies(r *rig) *sync.Map {
	var seen sync.Map
	r.svc.hook = func(_ context.Context, req *pb.ChargeRequest) error {
		if _, again := seen.LoadOrStore(req.Account, true); !again {
			r.proxy.DropConnections()
		}
		return nil
	}
	return &seen
}

const retryPolicy = `{"methodConfig": [{
  "name": [{"service": "idem.example.payments.v1.Payments"}],
  "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                  "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}}]}`

func TestLostRepliesWithGRPCRetryPolicy(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	lostReplies(r)
	c := r.client(t, grpc.WithDefaultServiceConfig(retryPolicy), grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(idemgrpc.RequestIDField("-"))))
	chargeOrders(t, r, c, 20, 1) // grpc-go allows at most 5 attempts: one call at a time, so no drop cuts another's
}

func TestLostRepliesWithMiddlewareRetry(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	lostReplies(r)
	c := r.client(t, grpc.WithChainUnaryInterceptor(
		idemgrpc.UnaryClientInterceptor(idemgrpc.RequestIDField("-")),
		retry.UnaryClientInterceptor(retry.WithMax(30), retry.WithCodes(codes.Unavailable, codes.Aborted),
			retry.WithBackoff(retry.BackoffExponentialWithJitter(20*time.Millisecond, 0.2)))))
	// Each drop cuts every call in flight: 20 orders make 20 drops, so an
	// order may lose up to 20 attempts.
	chargeOrders(t, r, c, 20, 20)
}

// The request_id field (AIP-155) filled in by the client interceptor
// survives retries too: it lives in the message.
func TestLostRepliesWithRequestIDField(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	lostReplies(r)
	c := r.client(t, grpc.WithChainUnaryInterceptor(
		idemgrpc.UnaryClientInterceptor(),
		retry.UnaryClientInterceptor(retry.WithMax(20), retry.WithCodes(codes.Unavailable, codes.Aborted),
			retry.WithBackoff(retry.BackoffLinear(20*time.Millisecond)))))
	chargeOrders(t, r, c, 10, 10)
}

// The interceptor placed inside the retry interceptor gets a new key per
// attempt: every lost reply is a second charge. This is the mistake the
// docs warn of, and proof that the tests above can fail.
func TestKeyPerAttemptChargesTwice(t *testing.T) {
	r := start(t, idemgrpc.Config{})
	lostReplies(r)
	c := r.client(t, grpc.WithChainUnaryInterceptor(
		retry.UnaryClientInterceptor(retry.WithMax(8), retry.WithCodes(codes.Unavailable, codes.Aborted),
			retry.WithBackoff(retry.BackoffLinear(20*time.Millisecond))),
		idemgrpc.UnaryClientInterceptor(idemgrpc.RequestIDField("-"))))
	const n = 5
	for i := range n {
		if _, err := c.Charge(context.Background(), &pb.ChargeRequest{Account: fmt.Sprint("order-", i), Amount: 100}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		if got := r.svc.count(fmt.Sprint("order-", i)); got != 2 {
			t.Fatalf("order-%d charged %d times; a key per attempt should charge a lost reply twice", i, got)
		}
	}
}

// chargeOrders charges n orders, parallel at a time, each once through a
// client that retries, and checks each was charged exactly once.
func chargeOrders(t *testing.T, r *rig, c pb.PaymentsClient, n, parallel int) {
	t.Helper()
	sem := make(chan struct{}, parallel)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			acct := fmt.Sprint("order-", i)
			reply, err := c.Charge(ctx, &pb.ChargeRequest{Account: acct, Amount: 100})
			if err == nil && (reply.Account != acct || reply.FencingToken <= 0) {
				err = fmt.Errorf("%s: reply %v", acct, reply)
			}
			if err != nil {
				errs <- fmt.Errorf("%s: %w", acct, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i := range n {
		if got := r.svc.count(fmt.Sprint("order-", i)); got != 1 {
			t.Errorf("order-%d charged %d times, want 1", i, got)
		}
	}
}

func TestStoreUnavailable(t *testing.T) {
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	sr := tracetest.NewSpanRecorder()
	store := etcdstoretest.NewOn(t, c, etcdstore.WithRequestTimeout(300*time.Millisecond),
		etcdstore.WithTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))))
	r := start(t, idemgrpc.Config{Store: store})
	client := r.client(t)
	c.Members[0].Stop()
	const key = "order-secret-99"
	_, err := client.Charge(withKey(key), &pb.ChargeRequest{Account: "a", Amount: 1})
	if status.Code(err) != codes.Unavailable || reason(err) != idemgrpc.ReasonStoreUnavailable || retryDelay(err) <= 0 {
		t.Fatalf("store down: %v, want UNAVAILABLE %s with RetryInfo", err, idemgrpc.ReasonStoreUnavailable)
	}
	if n := r.svc.count("a"); n != 0 {
		t.Fatalf("the handler ran %d times without a claim", n)
	}
	// The failed claim's span says why without the key: errors name keys,
	// spans hold their digest.
	failed := 0
	for _, s := range sr.Ended() {
		text := fmt.Sprint(s.Name(), s.Status(), s.Attributes(), s.Events())
		if strings.Contains(text, key) {
			t.Errorf("span %s holds the raw key: %s", s.Name(), text)
		}
		if s.Status().Code == otelcodes.Error {
			failed++
		}
	}
	if failed == 0 {
		t.Error("no span recorded the failed claim")
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := idemgrpc.New(idemgrpc.Config{}); !errors.Is(err, etcdstore.ErrInvalidArgument) {
		t.Fatalf("no store: %v", err)
	}
	if _, err := idemgrpc.New(idemgrpc.Config{Store: etcdstoretest.New(t), RequestIDField: "not a name"}); !errors.Is(err, etcdstore.ErrInvalidArgument) {
		t.Fatalf("a bad field name: %v", err)
	}
}

// An answer too large to save (an error status here) is replaced by one
// saying the call ran: the first caller and every retry get it, and the
// handler runs once.
func TestUnsavableAnswer(t *testing.T) {
	store := etcdstoretest.New(t, etcdstore.WithMaxRecordSize(16<<10))
	r := start(t, idemgrpc.Config{Store: store})
	big := strings.Repeat("x", 32<<10)
	r.svc.hook = func(context.Context, *pb.ChargeRequest) error { return status.Error(codes.InvalidArgument, big) }
	c := r.client(t)
	for i := range 2 {
		_, err := c.Charge(withKey("k"), &pb.ChargeRequest{Account: "a", Amount: 1})
		if status.Code(err) != codes.Internal || reason(err) != idemgrpc.ReasonNotSaved || !strings.Contains(status.Convert(err).Message(), "ran once") {
			t.Fatalf("call %d: %v %s, want INTERNAL %s saying it ran", i, status.Code(err), reason(err), idemgrpc.ReasonNotSaved)
		}
	}
	if n := r.svc.count("a"); n != 1 {
		t.Fatalf("ran %d times", n)
	}
}
