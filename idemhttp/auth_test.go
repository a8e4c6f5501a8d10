package idemhttp

import (
	"crypto/tls"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/idem-dev/idem/internal/testcerts"
	"github.com/idem-dev/idem/internal/tlsfiles"
)

func TestParseTokens(t *testing.T) {
	good := "# tenants and their tokens\n\nacme  tok-acme-0123456789\nacme tok-acme-rotated-0123\nglobex tok-globex-012345678\n"
	toks, err := ParseTokens([]byte(good))
	if err != nil || toks.Len() != 3 {
		t.Fatalf("ParseTokens = %v, %v; want 3 tokens", toks, err)
	}
	for _, tc := range []struct{ name, file, want string }{
		{"empty", "# nothing\n", "no tokens"},
		{"one field", "acme\n", "line 1"},
		{"three fields", "acme tok-acme-0123456789 extra\n", "line 1"},
		{"bad tenant", "acme\nx/y tok-0123456789abcdef\n", "line 1"},
		{"bad tenant on line 2", "acme tok-acme-0123456789\n../b tok-0123456789abcdef\n", "line 2"},
		{"short token", "acme short\n", "at least 16"},
		{"token with a quote", "acme tok-0123456789abc\"ef\n", "token68"},
		{"padding inside a token", "acme tok-0123=456789abcdef\n", "token68"},
		{"token for two tenants", "acme tok-shared-0123456789\nglobex tok-shared-0123456789\n", "already given to tenant acme"},
	} {
		if _, err := ParseTokens([]byte(tc.file)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: ParseTokens = %v; want an error with %q", tc.name, err, tc.want)
		}
	}
}

// Bearer tokens and client certificates name the tenant, over real TLS
// sockets; a request without credentials, or with wrong ones, is refused
// with 401 and reaches neither the store nor the upstream.
func TestAuthenticatedTenants(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "clients")
	if err != nil {
		t.Fatal(err)
	}
	srvCert, err := ca.Issue("idem", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	acmeCert, err := ca.Issue("acme", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	badCN, err := ca.Issue("not/a/tenant", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	toks, err := ParseTokens([]byte("globex tok-globex-0123456789\n"))
	if err != nil {
		t.Fatal(err)
	}
	up := newUpstream(t)
	store := newStore(t, "")
	tenant := CertTenant(BearerTenant(toks, Unauthenticated()))
	mw, err := New(Config{Store: store, Tenant: tenant})
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(up.URL)
	h, err := NewProxy(u, mw, ProxyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tlsCfg, err := tlsfiles.ServerConfig(srvCert.CertFile, srvCert.KeyFile, ca.CertFile, tlsfiles.VerifyClientCertIfGiven)
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, h, tlsCfg)

	roots, err := tlsfiles.LoadCAs(ca.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	client := func(cert *testcerts.Files) *http.Client {
		cfg := &tls.Config{RootCAs: roots}
		if cert != nil {
			pair, err := tls.LoadX509KeyPair(cert.CertFile, cert.KeyFile)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Certificates = []tls.Certificate{pair}
		}
		return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}}
	}
	send := func(c *http.Client, key string, hdr ...string) reply {
		t.Helper()
		req, _ := http.NewRequest("POST", srv.URL+"/charge", strings.NewReader(`{"amount":1}`))
		req.Header.Set(HeaderKey, key)
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Add(hdr[i], hdr[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("POST: %v", err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return reply{resp.StatusCode, resp.Header, string(b)}
	}

	// The same key under a certificate (acme) and a token (globex): two
	// operations, each replayed only to its own tenant.
	a := send(client(&acmeCert), "k1")
	g := send(client(nil), "k1", "Authorization", "Bearer tok-globex-0123456789")
	if a.status != 201 || g.status != 201 || a.header.Get(HeaderReplayed) != "" || g.header.Get(HeaderReplayed) != "" || a.body == g.body {
		t.Fatalf("acme %d %q, globex %d %q: want two first runs", a.status, a.body, g.status, g.body)
	}
	if r := send(client(&acmeCert), "k1"); r.body != a.body || r.header.Get(HeaderReplayed) != "true" {
		t.Fatalf("acme's retry = %q; want acme's replay %q", r.body, a.body)
	}
	if r := send(client(nil), "k1", "Authorization", "bearer tok-globex-0123456789"); r.body != g.body || r.header.Get(HeaderReplayed) != "true" {
		t.Fatalf("globex's retry = %q; want globex's replay %q", r.body, g.body)
	}
	calls := up.calls.Load()

	for _, tc := range []struct {
		name string
		c    *http.Client
		hdr  []string
	}{
		{"no credentials", client(nil), nil},
		{"unknown token", client(nil), []string{"Authorization", "Bearer tok-unknown-0123456789"}},
		{"basic auth", client(nil), []string{"Authorization", "Basic Z2xvYmV4OnB3"}},
		{"two Authorization headers", client(nil), []string{"Authorization", "Bearer tok-globex-0123456789", "Authorization", "Bearer tok-globex-0123456789"}},
		{"certificate common name that is not a tenant", client(&badCN), nil},
	} {
		r := send(tc.c, "k1", tc.hdr...)
		if r.status != 401 || problemType(t, r) != KindUnauthorized || !strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("%s: %d %q (WWW-Authenticate %q); want 401 unauthorized with a Bearer challenge", tc.name, r.status, r.body, r.header.Get("WWW-Authenticate"))
		}
	}
	if c := up.calls.Load(); c != calls {
		t.Fatalf("refused requests reached the upstream (%d calls, want %d)", c, calls)
	}

	// A certificate from another CA does not get past the handshake.
	other, err := testcerts.NewCA(dir, "other")
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := other.Issue("acme", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// Go's client offers no certificate the server's CA list does not
	// name, so the request arrives without one: 401.
	if r := send(client(&foreign), "k1"); r.status != 401 {
		t.Fatalf("a certificate from another CA (not offered) = %d; want 401", r.status)
	}
	// Offered regardless, it fails verification in the handshake.
	pair, err := tls.LoadX509KeyPair(foreign.CertFile, foreign.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	pushy := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &pair, nil }}}}
	req, _ := http.NewRequest("POST", srv.URL+"/charge", strings.NewReader(`{}`))
	req.Header.Set(HeaderKey, "k1")
	resp, err := pushy.Do(req)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("a certificate from another CA got %d; want the handshake refused", resp.StatusCode)
	}
	if !strings.Contains(err.Error(), "tls") {
		t.Fatalf("a certificate from another CA: %v; want a TLS error", err)
	}
	if c := up.calls.Load(); c != calls {
		t.Fatalf("refused requests reached the upstream (%d calls, want %d)", c, calls)
	}
}

// serveTLS serves h over TLS with cfg exactly (httptest's StartTLS would add
// a certificate of its own) on a port the kernel picks.
func serveTLS(t *testing.T, h http.Handler, cfg *tls.Config) (srv struct{ URL string }) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &http.Server{Handler: h, TLSConfig: cfg, ErrorLog: log.New(io.Discard, "", 0)}
	done := make(chan struct{})
	go func() { defer close(done); s.ServeTLS(ln, "", "") }()
	t.Cleanup(func() { s.Close(); <-done })
	srv.URL = "https://" + ln.Addr().String()
	return srv
}
