package idemgrpc_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/etcdstore/etcdstoretest"
	"github.com/idem-dev/idem/idemgrpc"
	pb "github.com/idem-dev/idem/idemgrpc/internal/paymentpb"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/testcerts"
)

// Two callers of a multi-tenant service, told apart by their client
// certificates (or bearer tokens), never share a key: the same key and
// request from the other runs again, and neither gets the other's replay.
// Without credentials a call is refused. Over TLS on a loopback socket.
func TestTenantsFromCertificatesAndTokens(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "idem-test")
	if err != nil {
		t.Fatal(err)
	}
	srvFiles, err := ca.Issue("server", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	srvCert, err := tls.LoadX509KeyPair(srvFiles.CertFile, srvFiles.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pem, err := os.ReadFile(ca.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	pool.AppendCertsFromPEM(pem)
	tokens, err := idemhttp.ParseTokens([]byte("carol carol-token-0123456789abcdef\n"))
	if err != nil {
		t.Fatal(err)
	}
	icp, err := idemgrpc.New(idemgrpc.Config{
		Store:  etcdstoretest.New(t),
		Tenant: idemgrpc.CertTenant(idemgrpc.BearerTenant(tokens, idemgrpc.Unauthenticated())),
	})
	if err != nil {
		t.Fatal(err)
	}
	svc := &payments{charges: map[string]int{}}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{srvCert}, ClientCAs: pool, ClientAuth: tls.VerifyClientCertIfGiven,
	})), grpc.ChainUnaryInterceptor(icp.Unary()))
	pb.RegisterPaymentsServer(srv, svc)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)

	client := func(cn string) pb.PaymentsClient {
		cfg := &tls.Config{RootCAs: pool, ServerName: "localhost"}
		if cn != "" {
			f, err := ca.Issue(cn, testcerts.Options{})
			if err != nil {
				t.Fatal(err)
			}
			c, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Certificates = []tls.Certificate{c}
		}
		cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cc.Close() })
		return pb.NewPaymentsClient(cc)
	}
	alice, bob, anon := client("alice"), client("bob"), client("")
	req := &pb.ChargeRequest{Account: "shared", Amount: 5}
	ids := map[string]string{}
	for _, c := range []struct {
		name   string
		client pb.PaymentsClient
		ctx    context.Context
	}{
		{"alice", alice, withKey("order-1")},
		{"bob", bob, withKey("order-1")},
		{"carol", anon, metadata.AppendToOutgoingContext(withKey("order-1"), "authorization", "Bearer carol-token-0123456789abcdef")},
	} {
		var h metadata.MD
		reply, err := c.client.Charge(c.ctx, req, grpc.Header(&h))
		if err != nil || idemgrpc.Replayed(h) {
			t.Fatalf("%s's first call with order-1: %v replayed=%v, want a run of its own", c.name, err, idemgrpc.Replayed(h))
		}
		ids[c.name] = reply.Id
		again, err := c.client.Charge(c.ctx, req, grpc.Header(&h))
		if err != nil || !idemgrpc.Replayed(h) || again.Id != reply.Id {
			t.Fatalf("%s's retry: %v %v replayed=%v, want its own answer %s", c.name, again, err, idemgrpc.Replayed(h), reply.Id)
		}
	}
	if ids["alice"] == ids["bob"] || ids["bob"] == ids["carol"] || ids["alice"] == ids["carol"] {
		t.Fatalf("answers %v: tenants shared a key", ids)
	}
	if n := svc.count("shared"); n != 3 {
		t.Fatalf("charged %d times, want 3 (one per tenant)", n)
	}
	for name, ctx := range map[string]context.Context{
		"no credentials": withKey("order-2"),
		"unknown token":  metadata.AppendToOutgoingContext(withKey("order-2"), "authorization", "Bearer not-a-known-token-0000"),
	} {
		if _, err := anon.Charge(ctx, req); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("%s: %v, want UNAUTHENTICATED", name, err)
		}
	}
	if n := svc.count("shared"); n != 3 {
		t.Fatalf("a refused call charged: %d charges", n)
	}
}
