package main

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// edgeShop is an upstream that records the Idempotency-Key of every call
// and answers by path: /pay charges (with a session cookie), /busy and
// /maint say "try later" (429, 503 with Retry-After) to the first call of
// a key and then charge, /fail fails with 500.
type edgeShop struct {
	*httptest.Server
	mu    sync.Mutex
	keys  []string       // the key header of every call, as received
	calls map[string]int // per path and key
}

func newEdgeShop(t *testing.T) *edgeShop {
	s := &edgeShop{calls: map[string]int{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		s.mu.Lock()
		s.keys = append(s.keys, key)
		s.calls[r.URL.Path+" "+key]++
		n := s.calls[r.URL.Path+" "+key]
		s.mu.Unlock()
		switch {
		case r.URL.Path == "/busy" && n == 1:
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		case r.URL.Path == "/maint" && n == 1:
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusServiceUnavailable)
		case r.URL.Path == "/fail":
			w.WriteHeader(http.StatusInternalServerError)
		default:
			w.Header().Set("Set-Cookie", fmt.Sprintf("session=s%d", n))
			w.Header().Set("X-Kept", "yes")
			w.WriteHeader(http.StatusCreated)
		}
		fmt.Fprintf(w, `{"path":%q,"call":%d}`, r.URL.Path, n)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *edgeShop) count(path, key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[path+" "+key]
}

func (s *edgeShop) total() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.keys)
}

// The HTTP edge's rules, over real sockets against idem serve: key syntax,
// one forwarded form per key, what a replay carries, the per-status
// policy, problem links, and the admin commands' key forms.
func TestServeEdgePolicy(t *testing.T) {
	dir := tempDir(t)
	up := newEdgeShop(t)
	flags := embeddedFlags(t, filepath.Join(dir, "data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL, "--problem-docs-url", "https://docs.example/idem")...)

	// An empty key, quoted or bare, is refused and reaches nothing.
	for _, k := range []string{`""`, `" "`, `"k";p=1`} {
		r := send(t, "POST", idem.listen+"/pay", k, `{}`)
		if r.status != 400 || !strings.Contains(r.body, "invalid-key") {
			t.Fatalf("Idempotency-Key: %s = %d %q; want 400 invalid-key", k, r.status, r.body)
		}
		if r.header.Get("Link") != `<https://docs.example/idem>; rel="describedby"` {
			t.Fatalf("a problem's Link = %q", r.header.Get("Link"))
		}
	}
	if n := up.total(); n != 0 {
		t.Fatalf("refused keys reached the upstream %d times", n)
	}

	// Quoted, then bare: one operation; the upstream saw one form.
	first := send(t, "POST", idem.listen+"/pay", `"order-1"`, `{"a":1}`)
	again := send(t, "POST", idem.listen+"/pay", `order-1`, `{"a":1}`)
	if first.status != 201 || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("quoted then bare: %d %q then %d %q", first.status, first.body, again.status, again.body)
	}
	if n := up.count("/pay", "order-1"); n != 1 {
		t.Fatalf("upstream calls for key order-1: %d (keys seen %q); want 1, bare", n, up.keys)
	}
	// The replay has no cookie; the first caller had one.
	if first.header.Get("Set-Cookie") != "session=s1" || again.header.Get("Set-Cookie") != "" || again.header.Get("X-Kept") != "yes" {
		t.Fatalf("Set-Cookie first %q, replayed %q (X-Kept %q); want it only on the first answer",
			first.header.Get("Set-Cookie"), again.header.Get("Set-Cookie"), again.header.Get("X-Kept"))
	}

	// 429 and 503 with Retry-After: the client gets them, the retry
	// reaches the upstream. 500: saved and replayed.
	for _, path := range []string{"/busy", "/maint"} {
		r1 := send(t, "POST", idem.listen+path, "later-"+path[1:], `{}`)
		r2 := send(t, "POST", idem.listen+path, "later-"+path[1:], `{}`)
		if r1.status == 201 || r1.header.Get("Retry-After") == "" || r2.status != 201 || r2.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("%s: %d (Retry-After %q) then %d replayed=%q; want try-later then a fresh run",
				path, r1.status, r1.header.Get("Retry-After"), r2.status, r2.header.Get("Idempotent-Replayed"))
		}
		if n := up.count(path, "later-"+path[1:]); n != 2 {
			t.Fatalf("%s: the upstream was called %d times; want 2", path, n)
		}
	}
	f1 := send(t, "POST", idem.listen+"/fail", "fail-1", `{}`)
	f2 := send(t, "POST", idem.listen+"/fail", "fail-1", `{}`)
	if f1.status != 500 || f2.status != 500 || f2.header.Get("Idempotent-Replayed") != "true" || up.count("/fail", "fail-1") != 1 {
		t.Fatalf("500: %d then %d replayed=%q, %d upstream calls; want it saved and replayed", f1.status, f2.status, f2.header.Get("Idempotent-Replayed"), up.count("/fail", "fail-1"))
	}

	// The admin commands take the key in either form.
	ep := etcdEndpoint(flags)
	for _, k := range []string{`order-1`, `"order-1"`} {
		if out, err := runCmd(t, "get", "--endpoints", ep, k); err != nil || !strings.Contains(out, "default/order-1 state=done") {
			t.Fatalf("idem get %s = %q, %v", k, out, err)
		}
	}
	if out, err := runCmd(t, "get", "--endpoints", ep, `""`); exitCode(err) != 2 || !strings.Contains(out+err.Error(), "empty") {
		t.Fatalf(`idem get "" = %q, %v; want a usage error`, out, err)
	}
	if out, err := runCmd(t, "evict", "--endpoints", ep, `"order-1"`); err != nil || !strings.Contains(out, "evicted") {
		t.Fatalf(`idem evict "order-1" = %q, %v`, out, err)
	}
	if err := idem.terminate(); err != nil {
		t.Fatalf("exit: %v", err)
	}
}

// etcd cannot be reached when idem starts: it serves all the same. Keyed
// requests get 503 without reaching the upstream, keyless ones pass, and
// /readyz says why it is not ready; once etcd answers, keyed requests are
// claimed and /readyz is 200.
func TestServeStartsBeforeEtcdAnswers(t *testing.T) {
	dir := tempDir(t)
	proxy := etcdBehindProxy(t, filepath.Join(dir, "etcd"))
	proxy.Blackhole()
	up := newEdgeShop(t)
	start := time.Now()
	idem := startIdem(t, filepath.Join(dir, "work"), "--endpoints", proxy.URL(), "--upstream", up.URL, "--dial-timeout", "1s")
	t.Logf("listening %v after start with etcd cut off (--dial-timeout 1s)", time.Since(start).Round(time.Millisecond))
	if !idem.hasLog("etcd cannot be reached") {
		t.Fatalf("no log line says etcd cannot be reached:\n%s", idem.logs)
	}
	if r := send(t, "POST", idem.listen+"/pay", "k-1", `{}`); r.status != 503 || !strings.Contains(r.body, "unavailable") || r.header.Get("Retry-After") == "" {
		t.Fatalf("keyed request before etcd = %d %q; want 503 unavailable with Retry-After", r.status, r.body)
	}
	if n := up.total(); n != 0 {
		t.Fatalf("a keyed request reached the upstream (%d calls) with no claim", n)
	}
	if r := send(t, "POST", idem.listen+"/pay", "", `{}`); r.status != 201 {
		t.Fatalf("keyless request before etcd = %d %q; want it passed through", r.status, r.body)
	}
	if r := send(t, "GET", idem.admin+"/readyz", "", ""); r.status != 503 || !strings.Contains(r.body, "etcd") {
		t.Fatalf("/readyz before etcd = %d %q; want 503 naming etcd", r.status, r.body)
	}
	if r := send(t, "GET", idem.admin+"/livez", "", ""); r.status != 200 {
		t.Fatalf("/livez = %d", r.status)
	}

	proxy.Heal()
	healed := time.Now()
	deadline := time.Now().Add(60 * time.Second)
	for {
		r := send(t, "GET", idem.admin+"/readyz", "", "")
		if r.status == 200 {
			t.Logf("ready %v after etcd came back", time.Since(healed).Round(time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz still %d %q a minute after etcd came back:\n%s", r.status, r.body, idem.logs)
		}
		time.Sleep(100 * time.Millisecond) // polling a condition; the connect loop backs off on its own
	}
	r1 := send(t, "POST", idem.listen+"/pay", "k-1", `{}`)
	r2 := send(t, "POST", idem.listen+"/pay", "k-1", `{}`)
	if r1.status != 201 || r2.header.Get("Idempotent-Replayed") != "true" || up.count("/pay", "k-1") != 1 {
		t.Fatalf("after etcd came back: %d, then %d replayed=%q; %d upstream calls", r1.status, r2.status, r2.header.Get("Idempotent-Replayed"), up.count("/pay", "k-1"))
	}
	if err := idem.terminate(); err != nil {
		t.Fatalf("exit: %v\n%s", err, idem.logs)
	}
}
