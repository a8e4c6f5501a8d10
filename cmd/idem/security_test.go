package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/internal/embedded"
	"github.com/idem-dev/idem/internal/testcerts"
	"github.com/idem-dev/idem/internal/tlsfiles"
)

// startEtcd starts a one-member embedded etcd on free ports, with clients
// over TLS when tlsCfg has a certificate, and returns its client URL.
func startEtcd(t *testing.T, tlsCfg embedded.TLS) string {
	t.Helper()
	ports, err := etcdtest.FreePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	scheme := "http"
	if tlsCfg.CertFile != "" {
		scheme = "https"
	}
	cfg := embedded.Config{
		Name:      "sec",
		Dir:       filepath.Join(t.TempDir(), "etcd"),
		ClientURL: fmt.Sprintf("%s://127.0.0.1:%d", scheme, ports[0]),
		PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		NoFsync:   true,
		ClientTLS: tlsCfg,
	}
	ctx, cancel := context.WithTimeout(context.Background(), embedded.ReadyTimeout)
	defer cancel()
	e, err := embedded.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return cfg.ClientURL
}

// idem talks to etcd over mutual TLS with the etcdctl-style flags; etcd
// refuses a client with no certificate, one from another CA, or an expired
// one, and idem refuses an etcd whose certificate its --cacert did not sign.
func TestEtcdMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "etcd")
	if err != nil {
		t.Fatal(err)
	}
	server, err := ca.Issue("etcd", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	good, err := ca.Issue("idem", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	expired, err := ca.Issue("idem", testcerts.Options{Expired: true})
	if err != nil {
		t.Fatal(err)
	}
	other, err := testcerts.NewCA(dir, "other")
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := other.Issue("idem", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ep := startEtcd(t, embedded.TLS{CertFile: server.CertFile, KeyFile: server.KeyFile, TrustedCAFile: ca.CertFile, ClientCertAuth: true})

	status := func(extra ...string) (string, error) {
		args := []string{"status", "--command-timeout", "1500ms", "--dial-timeout", "1s"}
		if !slices.Contains(extra, "--endpoints") {
			args = append(args, "--endpoints", ep)
		}
		return runCmd(t, append(args, extra...)...)
	}
	if out, err := status("--cacert", ca.CertFile, "--cert", good.CertFile, "--key", good.KeyFile); err != nil || !strings.Contains(out, "leader=true") {
		t.Fatalf("with a good client certificate: %q, %v", out, err)
	}
	for _, tc := range []struct {
		name  string
		flags []string
		why   string // what the error must say
	}{
		{"no client certificate", []string{"--cacert", ca.CertFile}, "certificate required"},
		{"a client certificate from another CA", []string{"--cacert", ca.CertFile, "--cert", foreign.CertFile, "--key", foreign.KeyFile}, "tls: "},
		{"an expired client certificate", []string{"--cacert", ca.CertFile, "--cert", expired.CertFile, "--key", expired.KeyFile}, "tls: "},
		{"etcd's certificate not signed by --cacert", []string{"--cacert", other.CertFile, "--cert", good.CertFile, "--key", good.KeyFile}, "unknown authority"},
		{"plain text to a TLS port", []string{"--endpoints", strings.Replace(ep, "https://", "http://", 1)}, "speaks TLS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each waits out --command-timeout
			out, err := status(tc.flags...)
			if err == nil {
				t.Fatalf("status succeeded: %q", out)
			}
			if !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("refused with %q; want it to say %q", err, tc.why)
			}
		})
	}

	// The store itself, through idem serve, works over mutual TLS.
	idem := startIdem(t, tempDir(t), "--endpoints", ep, "--cacert", ca.CertFile, "--cert", good.CertFile, "--key", good.KeyFile)
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"tls-1"}`); r.status != 201 {
		t.Fatalf("claim over mutual TLS = %d %q", r.status, r.body)
	}
	// Without a certificate, serve refuses to start rather than serve 503s.
	var out strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--endpoints", ep,
		"--cacert", ca.CertFile, "--dial-timeout", "1s", "--request-timeout", "1s", "--session-ttl", "2s"}, io.Discard, &out)
	if err == nil || !strings.Contains(err.Error(), "certificate required") {
		t.Fatalf("serve against an mTLS etcd without a client certificate: %v; want a refusal saying a certificate is required", err)
	}
}

// idem runs as an etcd user whose role covers its prefix only: it can do
// everything it needs (range, put, txn, watch, leases, the admin commands)
// and nothing outside the prefix.
func TestEtcdLeastPrivilege(t *testing.T) {
	ep := startEtcd(t, embedded.TLS{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	root, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	// The setup docs/SECURITY.md gives as etcdctl commands.
	steps := []func() error{
		func() error { _, err := root.UserAdd(ctx, "root", "root-pw"); return err },
		func() error { _, err := root.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := root.RoleAdd(ctx, "idem"); return err },
		func() error {
			_, err := root.RoleGrantPermission(ctx, "idem", "/idem/", clientv3.GetPrefixRangeEnd("/idem/"), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := root.UserAdd(ctx, "idem", "idem-pw"); return err },
		func() error { _, err := root.UserGrantRole(ctx, "idem", "idem"); return err },
		func() error { _, err := root.Put(ctx, "/other/secret", "not idem's"); return err },
		func() error { _, err := root.AuthEnable(ctx); return err },
	}
	for i, s := range steps {
		if err := s(); err != nil {
			t.Fatalf("auth setup step %d: %v", i, err)
		}
	}

	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Username: "idem", Password: "idem-pw", Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	// Everything idem does: a store with its cache (a Watch), sessions and
	// retention leases, claims, completes, replays, waits, lists, evicts.
	s, err := etcdstore.New(ctx, cli, etcdstore.WithCache(1<<20), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatalf("store as the idem user: %v", err)
	}
	defer s.Close()
	work := func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("ok"), nil }
	if _, err := s.Do(ctx, etcdstore.Key{ID: "k1"}, []byte("p"), work); err != nil {
		t.Fatalf("Do as the idem user: %v", err)
	}
	if res, err := s.Do(ctx, etcdstore.Key{ID: "k1"}, []byte("p"), work); err != nil || !res.Replayed {
		t.Fatalf("replay as the idem user: %v, %v", res, err)
	}
	if _, err := s.Wait(ctx, etcdstore.Key{ID: "k1"}); err != nil {
		t.Fatalf("Wait as the idem user: %v", err)
	}
	// Group commit: concurrent writes go as one Txn of Txns, each checked
	// against the role.
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Do(ctx, etcdstore.Key{ID: fmt.Sprintf("b%d", i)}, []byte("p"), work); err != nil {
				t.Errorf("batched Do as the idem user: %v", err)
			}
		}()
	}
	wg.Wait()
	if st := s.Metrics().Batch; st.Members <= st.Batches {
		t.Fatalf("batch stats %+v: no batch was sent as the idem user", st)
	}
	creds := []string{"--endpoints", ep, "--user", "idem:idem-pw", "--command-timeout", "5s"}
	for _, args := range [][]string{{"get", "k1"}, {"ls"}, {"status"}, {"evict", "k1"}} {
		if out, err := runCmd(t, append(append([]string{args[0]}, creds...), args[1:]...)...); err != nil {
			t.Fatalf("idem %s as the idem user: %v\n%s", args[0], err, out)
		}
	}

	// Nothing outside the prefix.
	denied := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Errorf("%s outside the prefix: %v; want permission denied", what, err)
		}
	}
	_, err = cli.Get(ctx, "/other/secret")
	denied("range", err)
	_, err = cli.Get(ctx, "/", clientv3.WithPrefix())
	denied("range over everything", err)
	_, err = cli.Put(ctx, "/other/x", "v")
	denied("put", err)
	_, err = cli.Delete(ctx, "/other/secret")
	denied("delete", err)
	_, err = cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision("/other/secret"), "=", 0)).
		Then(clientv3.OpPut("/idem/k/default/x", "v")).Commit()
	denied("txn comparing outside", err)
	_, err = cli.Txn(ctx).If().Then(clientv3.OpPut("/idem/k/default/y", "v"), clientv3.OpPut("/other/y", "v")).Commit()
	denied("txn writing outside", err)
	_, err = cli.Txn(ctx).If().Then(clientv3.OpGet("/idem0")).Commit()
	denied("txn reading just past the prefix", err)
	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatalf("lease grant as the idem user: %v", err)
	}
	_, err = cli.Put(ctx, "/other/leased", "v", clientv3.WithLease(lease.ID))
	denied("lease attach", err)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	wr, ok := <-cli.Watch(wctx, "/other/", clientv3.WithPrefix())
	if !ok || !wr.Canceled || !strings.Contains(wr.Err().Error(), "permission denied") {
		t.Errorf("watch outside the prefix: ok=%v canceled=%v err=%v; want cancelled, permission denied", ok, wr.Canceled, wr.Err())
	}
	// The secret is untouched.
	if r, err := root.Get(ctx, "/other/secret"); err == nil {
		t.Fatal("root's unauthenticated client still reads: auth is not on")
	} else if !errors.Is(err, rpctypes.ErrUserEmpty) && !strings.Contains(err.Error(), "user name is empty") {
		t.Logf("unauthenticated read: %v (%v)", err, r)
	}
	admin, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, Username: "root", Password: "root-pw", DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	r, err := admin.Get(ctx, "/other/", clientv3.WithPrefix())
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "not idem's" {
		t.Fatalf("outside the prefix after the attempts: %v, %v; want only the untouched secret", r, err)
	}
}

// idem serves its clients over TLS: the tenant comes from a client
// certificate or a bearer token, and no tenant reads, replays, evicts or
// collides with another's keys, over HTTP or through the admin commands.
func TestServeTLSAndTenantIsolation(t *testing.T) {
	dir := tempDir(t)
	ca, err := testcerts.NewCA(dir, "clients")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ca.Issue("idem", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	acme, err := ca.Issue("acme", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	tokens := filepath.Join(dir, "tokens")
	if err := os.WriteFile(tokens, []byte("globex tok-globex-0123456789\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	flags := append(embeddedFlags(t, filepath.Join(dir, "data")),
		"--tls-cert-file", srv.CertFile, "--tls-key-file", srv.KeyFile, "--tls-client-ca-file", ca.CertFile,
		"--admin-tls-cert-file", srv.CertFile, "--admin-tls-key-file", srv.KeyFile, "--admin-tls-client-ca-file", ca.CertFile,
		"--tokens-file", tokens)
	// A tokens file others can read is refused.
	if out, err := runCmd(t, append([]string{"serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"}, flags...)...); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("serve with a world-readable tokens file: %v\n%s", err, out)
	}
	if err := os.Chmod(tokens, 0o600); err != nil {
		t.Fatal(err)
	}
	idem := startIdem(t, dir, flags...)
	base := strings.Replace(idem.listen, "http://", "https://", 1)
	adminURL := strings.Replace(idem.admin, "http://", "https://", 1)

	roots, err := tlsfiles.LoadCAs(ca.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.LoadX509KeyPair(acme.CertFile, acme.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	withCert := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}}}}
	noCert := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	call := func(c *http.Client, method, url, body string, hdr ...string) reply {
		t.Helper()
		req, err := http.NewRequest(method, url, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, url, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return reply{resp.StatusCode, resp.Header, string(b)}
	}
	globex := []string{"Authorization", "Bearer tok-globex-0123456789"}

	// Plain HTTP to the TLS port gets nothing done.
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"k"}`); r.status != 400 {
		t.Fatalf("plain HTTP to the TLS listener = %d %q", r.status, r.body)
	}
	// No credentials: 401.
	if r := call(noCert, "POST", base+"/v1/claim", `{"key":"k"}`); r.status != 401 || r.header.Get("WWW-Authenticate") == "" {
		t.Fatalf("no credentials = %d %q", r.status, r.body)
	}

	// acme (certificate) runs "order-1" to completion.
	claimAndComplete := func(c *http.Client, body string, hdr ...string) {
		t.Helper()
		r := call(c, "POST", base+"/v1/claim", `{"key":"order-1","params":{"n":1}}`, hdr...)
		var cl struct {
			State  string
			Handle json.RawMessage
		}
		if r.status != 201 || json.Unmarshal([]byte(r.body), &cl) != nil || cl.State != "claimed" {
			t.Fatalf("claim = %d %q; want a fresh claim", r.status, r.body)
		}
		if r := call(c, "POST", base+"/v1/complete", `{"handle":`+string(cl.Handle)+`,"outcome":{"body":"`+body+`"}}`, hdr...); r.status != 200 {
			t.Fatalf("complete = %d %q", r.status, r.body)
		}
	}
	claimAndComplete(withCert, "YWNtZQ==") // "acme"
	// globex (token) cannot read it...
	if r := call(noCert, "GET", base+"/v1/keys/order-1", "", globex...); r.status != 404 {
		t.Fatalf("globex reading acme's key = %d %q; want 404", r.status, r.body)
	}
	// ...and the same key is globex's own operation, not a replay of acme's.
	claimAndComplete(noCert, "Z2xvYmV4", globex...) // "globex"
	if r := call(withCert, "POST", base+"/v1/claim", `{"key":"order-1","params":{"n":1}}`); r.status != 200 || !strings.Contains(r.body, `"YWNtZQ=="`) {
		t.Fatalf("acme's replay = %d %q; want acme's outcome", r.status, r.body)
	}
	if r := call(noCert, "POST", base+"/v1/claim", `{"key":"order-1","params":{"n":1}}`, globex...); r.status != 200 || !strings.Contains(r.body, `"Z2xvYmV4"`) {
		t.Fatalf("globex's replay = %d %q; want globex's outcome", r.status, r.body)
	}
	// Without --tenant-header, a header naming another tenant changes nothing.
	if r := call(withCert, "GET", base+"/v1/keys/order-1", "", "X-Idem-Tenant", "globex"); r.status != 200 || !strings.Contains(r.body, `"YWNtZQ=="`) {
		t.Fatalf("acme naming another tenant in a header it is not trusted for = %d %q; want its own record", r.status, r.body)
	}

	// The admin commands are scoped by --tenant the same way.
	ep := etcdEndpoint(flags)
	out, err := runCmd(t, "get", "--endpoints", ep, "--tenant", "globex", "-w", "json", "order-1")
	if err != nil || !strings.Contains(out, `"tenant":"globex"`) || strings.Contains(out, "acme") {
		t.Fatalf("idem get --tenant globex = %q, %v", out, err)
	}
	out, err = runCmd(t, "ls", "--endpoints", ep, "--tenant", "acme", "-w", "json")
	if err != nil || strings.Count(out, `"key":"order-1"`) != 1 || strings.Contains(out, "globex") {
		t.Fatalf("idem ls --tenant acme = %q, %v; want acme's one key", out, err)
	}
	if out, err := runCmd(t, "evict", "--endpoints", ep, "--tenant", "globex", "order-1"); err != nil {
		t.Fatalf("idem evict --tenant globex: %v\n%s", err, out)
	}
	if r := call(withCert, "GET", base+"/v1/keys/order-1", ""); r.status != 200 || !strings.Contains(r.body, `"YWNtZQ=="`) {
		t.Fatalf("acme's key after globex's was evicted = %d %q", r.status, r.body)
	}
	if r := call(noCert, "GET", base+"/v1/keys/order-1", "", globex...); r.status != 404 {
		t.Fatalf("globex's evicted key = %d %q; want 404", r.status, r.body)
	}

	// The admin port requires a client certificate too.
	if r := call(withCert, "GET", adminURL+"/readyz", ""); r.status != 200 {
		t.Fatalf("/readyz with a certificate = %d %q", r.status, r.body)
	}
	if _, err := noCert.Get(adminURL + "/metrics"); err == nil {
		t.Fatal("/metrics without a client certificate was served")
	}
}

// A client that sends its headers a byte at a time, or never finishes them,
// is cut off after --read-header-timeout instead of holding a connection.
func TestSlowClientIsCutOff(t *testing.T) {
	dir := tempDir(t)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")), "--read-header-timeout", "1s")...)
	addr := strings.TrimPrefix(idem.listen, "http://")
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Far longer than the server's timeout: only the server can end this.
	c.SetDeadline(time.Now().Add(45 * time.Second)) // under --read-timeout (1m)
	if _, err := io.WriteString(c, "POST /v1/claim HTTP/1.1\r\nHost: idem\r\nX-Slow: "); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(c) // returns when the server closes the connection
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("the server kept a connection with unfinished headers open for 45 s")
	}
	if len(b) > 0 && !strings.HasPrefix(string(b), "HTTP/1.1 408") && !strings.HasPrefix(string(b), "HTTP/1.1 400") {
		t.Fatalf("the server answered unfinished headers with %q", b)
	}
	// The server still serves others.
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"after-slow"}`); r.status != 201 {
		t.Fatalf("claim after the slow client = %d %q", r.status, r.body)
	}
}
