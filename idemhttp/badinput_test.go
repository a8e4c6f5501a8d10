package idemhttp

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

// rawReply is what came back for bytes written on a socket.
type rawReply struct {
	status int
	ctype  string
	body   string
}

// sendRaw writes req as it is (no client library cleans it up) and reads
// one response.
func sendRaw(t *testing.T, addr, req string) rawReply {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the response to %q: %v", req, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return rawReply{resp.StatusCode, resp.Header.Get("Content-Type"), string(b)}
}

// Every bad input at the HTTP edge, proxy and worker API, is refused with a
// clear error before anything is written: the etcd revision does not move
// and the upstream is never called. The cluster is this test's own, so
// nothing else moves the revision.
func TestBadInputAtTheHTTPEdge(t *testing.T) {
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := c.MustClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix("/bad/"))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()

	up := newUpstream(t)
	trusted := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	mw, err := New(Config{
		Store:          store,
		MaxRequestBody: 1024,
		RequireKey:     func(r *http.Request) bool { return strings.HasPrefix(r.URL.Path, "/charge") },
		Tenant:         TrustedHeaderTenant("X-Tenant", trusted, FixedTenant("default")),
	})
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(up.URL)
	proxy, err := NewProxy(u, mw, ProxyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	untrusting, err := New(Config{Store: store, Tenant: TrustedHeaderTenant("X-Tenant", []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, FixedTenant("default"))})
	if err != nil {
		t.Fatal(err)
	}
	untrustingProxy, err := NewProxy(u, untrusting, ProxyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	front2 := httptest.NewServer(untrustingProxy)
	defer front2.Close()
	api, err := NewAPI(APIConfig{Store: store, MaxBody: 1024})
	if err != nil {
		t.Fatal(err)
	}
	apiSrv := httptest.NewServer(api)
	defer apiSrv.Close()

	// A held claim through the API, for the cases that need a handle.
	cr := do(t, "POST", apiSrv.URL+"/v1/claim", "", `{"key":"held","params":{"a":1}}`)
	if cr.status != 201 {
		t.Fatalf("claim = %d %q", cr.status, cr.body)
	}
	handle := cr.body[strings.Index(cr.body, `"handle":`)+len(`"handle":`):]
	handle = handle[:strings.Index(handle, "}")+1]
	forged := strings.Replace(handle, `"token":`, `"token":1`, 1) // a token prefixed with 1: not ours

	post := func(path, hdrs, body string) string {
		return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: idem\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\nConnection: close\r\n\r\n%s", path, hdrs, len(body), body)
	}
	key := func(k string) string { return "Idempotency-Key: " + k + "\r\n" }
	big := `{"pad":"` + strings.Repeat("x", 2000) + `"}`
	cases := []struct {
		name   string
		srv    *httptest.Server
		req    string
		status int
		kind   string // "" when net/http itself refuses (plain text)
	}{
		// Keys.
		{"missing key on a route that needs one", front, post("/charge", "", `{}`), 400, KindMissingKey},
		{"empty key", front, post("/charge", key(""), `{}`), 400, KindInvalidKey},
		{"key of 256 bytes", front, post("/charge", key(strings.Repeat("k", 256)), `{}`), 400, KindInvalidKey},
		{"key with a space", front, post("/charge", key(`"a b"`), `{}`), 400, KindInvalidKey},
		{"non-ASCII key", front, post("/charge", key("clé"), `{}`), 400, KindInvalidKey},
		{"invalid UTF-8 key", front, post("/charge", key("k\xff\xfe"), `{}`), 400, KindInvalidKey},
		{"key with a NUL", front, post("/charge", key("k\x00x"), `{}`), 400, ""},
		{"key with a control byte", front, post("/charge", key("k\x01x"), `{}`), 400, ""},
		{"key with a slash", front, post("/charge", key("../other/k"), `{}`), 400, KindInvalidKey},
		{"key ..", front, post("/charge", key(".."), `{}`), 400, KindInvalidKey},
		{"key .", front, post("/charge", key("."), `{}`), 400, KindInvalidKey},
		{"key reaching into another tenant's prefix", front, post("/charge", key("x/../../k/acme/order-1"), `{}`), 400, KindInvalidKey},
		{"two Idempotency-Key headers", front, post("/charge", key("k1")+key("k2"), `{}`), 400, KindInvalidKey},
		{"a list of keys in one header", front, post("/charge", key(`"a", "b"`), `{}`), 400, KindInvalidKey},
		{"unterminated quoted key", front, post("/charge", key(`"abc`), `{}`), 400, KindInvalidKey},
		// Tenants.
		{"tenant with a slash", front, post("/charge", key("k")+"X-Tenant: acme/../globex\r\n", `{}`), 400, KindInvalidTenant},
		{"tenant of 65 characters", front, post("/charge", key("k")+"X-Tenant: "+strings.Repeat("t", 65)+"\r\n", `{}`), 400, KindInvalidTenant},
		{"two tenant headers", front, post("/charge", key("k")+"X-Tenant: a\r\nX-Tenant: b\r\n", `{}`), 400, KindInvalidTenant},
		{"tenant header from an untrusted peer", front2, post("/charge", key("k")+"X-Tenant: acme\r\n", `{}`), 403, KindUntrustedTenant},
		// Bodies.
		{"body over the limit", front, post("/charge", key("k"), big), 413, KindRequestTooLarge},
		{"chunked body over the limit", front, "POST /charge HTTP/1.1\r\nHost: idem\r\nContent-Type: application/json\r\nIdempotency-Key: k\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" +
			fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(big), big), 413, KindRequestTooLarge},
		{"malformed JSON", front, post("/charge", key("k"), `{"a":`), 400, KindInvalidJSON},
		{"JSON with a repeated member", front, post("/charge", key("k"), `{"a":1,"a":2}`), 400, KindInvalidJSON},
		{"JSON number that overflows", front, post("/charge", key("k"), `{"a":1e999}`), 400, KindInvalidJSON},
		{"JSON number past float64 precision", front, post("/charge", key("k"), `{"a":0.10000000000000000000001}`), 400, KindInvalidJSON},
		{"JSON string that is not UTF-8", front, post("/charge", key("k"), "{\"a\":\"\xff\"}"), 400, KindInvalidJSON},
		{"JSON with a lone surrogate escape", front, post("/charge", key("k"), `{"a":"\ud800"}`), 400, KindInvalidJSON},
		// Methods and header injection.
		{"a method that is not a token", front, "P@ST /charge HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: k\r\nConnection: close\r\n\r\n", 400, ""},
		{"an unknown method on the worker API", apiSrv, "BREW /v1/claim HTTP/1.1\r\nHost: idem\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", 405, KindMethodNotAllowed},
		{"a forged fencing token", front, post("/charge", key("k")+"Idempotency-Fence: 999999\r\n", `{}`), 400, KindInvalidRequest},
		{"a bare CR smuggling a header", front, post("/charge", key("k")+"X-Note: a\rIdempotency-Fence: 1\r\n", `{}`), 400, ""},
		{"a header name with a space", front, post("/charge", key("k")+"Idempotency Fence: 1\r\n", `{}`), 400, ""},
		// The worker API.
		{"claim with malformed JSON", apiSrv, post("/v1/claim", "", `{"key":`), 400, KindInvalidRequest},
		{"claim with an unknown field", apiSrv, post("/v1/claim", "", `{"key":"k","tenant":"acme"}`), 400, KindInvalidRequest},
		{"claim with a bad key", apiSrv, post("/v1/claim", "", `{"key":"a/b"}`), 400, KindInvalidKey},
		{"claim over the body limit", apiSrv, post("/v1/claim", "", `{"key":"k","params":`+big+`}`), 413, KindRequestTooLarge},
		{"complete with an outcome over the size limit", apiSrv, post("/v1/complete", "", `{"handle":`+handle+`,"outcome":{"body":"`+strings.Repeat("QUFB", 400)+`"}}`), 413, KindRequestTooLarge},
		{"complete with a forged handle", apiSrv, post("/v1/complete", "", `{"handle":`+forged+`,"outcome":{"body":""}}`), 409, KindFenced},
		{"get with a bad key", apiSrv, "GET /v1/keys/%2E%2E HTTP/1.1\r\nHost: idem\r\nConnection: close\r\n\r\n", 400, KindInvalidKey},
	}
	rev := func() int64 {
		t.Helper()
		r, err := cli.Get(ctx, "/bad/")
		if err != nil {
			t.Fatal(err)
		}
		return r.Header.Revision
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := rev()
			r := sendRaw(t, tc.srv.Listener.Addr().String(), tc.req)
			if r.status != tc.status {
				t.Fatalf("status %d %q; want %d", r.status, r.body, tc.status)
			}
			if tc.kind != "" {
				if r.ctype != "application/problem+json" || !strings.Contains(r.body, `"type":"`+ProblemTypePrefix+tc.kind+`"`) || !strings.Contains(r.body, `"detail":"`) {
					t.Fatalf("%s %q; want a problem of kind %s with a detail", r.ctype, r.body, tc.kind)
				}
			} else if r.body == "" {
				t.Fatal("refused without saying why")
			}
			if after := rev(); after != before {
				t.Fatalf("etcd revision moved %d -> %d: a refused request wrote", before, after)
			}
		})
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the upstream was called %d times by refused requests", n)
	}
	// The held claim is still held, untouched by the forged handle.
	if r := do(t, "GET", apiSrv.URL+"/v1/keys/held", "", ""); r.status != 200 || !strings.Contains(r.body, `"in_flight"`) {
		t.Fatalf("held key after the bad requests = %d %q", r.status, r.body)
	}
}
