package idemgrpc_test

import (
	"context"
	"net"
	"testing"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdstore/etcdstoretest"
	"github.com/idem-dev/idem/idemgrpc"
	pb "github.com/idem-dev/idem/idemgrpc/internal/paymentpb"
)

// Spans of a traced service: the client's span, the server's (otelgrpc)
// as its child across the wire, and idem's claim and complete under the
// server's; a retry's replay under its own server span. Keys appear as a
// digest only.
func TestSpans(t *testing.T) {
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	prop := propagation.TraceContext{}
	store := etcdstoretest.New(t, etcdstore.WithTracerProvider(tp))
	icp, err := idemgrpc.New(idemgrpc.Config{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(tp), otelgrpc.WithPropagators(prop))),
		grpc.ChainUnaryInterceptor(icp.Unary()))
	pb.RegisterPaymentsServer(srv, &payments{charges: map[string]int{}})
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp), otelgrpc.WithPropagators(prop))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	c := pb.NewPaymentsClient(cc)
	const key = "order-secret-42"
	for range 2 {
		if _, err := c.Charge(withKey(key), &pb.ChargeRequest{Account: "a", Amount: 1}); err != nil {
			t.Fatal(err)
		}
	}
	_ = tp.ForceFlush(context.Background())

	spans := sr.Ended()
	byName := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range spans {
		byName[s.Name()] = append(byName[s.Name()], s)
		for _, a := range s.Attributes() {
			if a.Value.Type() == attribute.STRING && a.Value.AsString() == key {
				t.Errorf("span %s records the raw key in %s", s.Name(), a.Key)
			}
		}
	}
	method := "idem.example.payments.v1.Payments/Charge"
	var servers, clients []sdktrace.ReadOnlySpan
	for _, s := range byName[method] {
		switch s.SpanKind() {
		case trace.SpanKindServer:
			servers = append(servers, s)
		case trace.SpanKindClient:
			clients = append(clients, s)
		}
	}
	if len(servers) != 2 || len(clients) != 2 {
		t.Fatalf("spans %v: want 2 client and 2 server spans of %s", names(spans), method)
	}
	for i := range 2 {
		if servers[i].Parent().SpanID() != clients[i].SpanContext().SpanID() {
			t.Errorf("call %d: the server span is not the client span's child", i)
		}
	}
	want := map[string]string{"idem.claim": "claimed", "idem.complete": "written", "idem.replay": "replayed"}
	for name, outcome := range want {
		got := byName[name]
		if len(got) != 1 {
			t.Fatalf("%d spans named %s in %v, want 1", len(got), name, names(spans))
		}
		s := got[0]
		attrs := map[attribute.Key]attribute.Value{}
		for _, a := range s.Attributes() {
			attrs[a.Key] = a.Value
		}
		if attrs[etcdstore.AttrOutcome].AsString() != outcome || attrs[etcdstore.AttrToken].AsInt64() <= 0 ||
			attrs[etcdstore.AttrTenant].AsString() != etcdstore.DefaultTenant || attrs[etcdstore.AttrKeyDigest].AsString() == "" {
			t.Errorf("%s attributes %v", name, s.Attributes())
		}
		parent := servers[0]
		if name == "idem.replay" {
			parent = servers[1]
		}
		if s.Parent().SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("%s is not a child of its call's server span", name)
		}
	}
}

func names(spans []sdktrace.ReadOnlySpan) []string {
	var n []string
	for _, s := range spans {
		n = append(n, s.Name())
	}
	return n
}
