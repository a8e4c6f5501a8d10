package idemhttp

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
)

var cluster *etcdtest.Cluster

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m, 1, etcdtest.Options{}, &cluster)) }

var prefixSeq atomic.Int64

// newStore returns a store under a prefix of its own (or the given one).
func newStore(t *testing.T, prefix string, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	if prefix == "" {
		prefix = fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.New(ctx, cluster.MustClient(t), append([]etcdstore.Option{etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// upstream is a test service that counts its effects per idempotency key.
type upstream struct {
	*httptest.Server
	calls     atomic.Int64
	mu        sync.Mutex
	effects   map[string]int
	fences    []fencing.Token
	hold      chan struct{} // /slow waits on it
	entered   chan string   // /slow and /hang report arrival (with the key)
	cancelled chan struct{} // /slow reports that its request was cancelled
}

func newUpstream(t *testing.T) *upstream {
	u := &upstream{effects: make(map[string]int), hold: make(chan struct{}), entered: make(chan string, 100), cancelled: make(chan struct{}, 100)}
	mux := http.NewServeMux()
	mux.HandleFunc("/charge", u.charge)
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body) // so the server watches the connection
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		u.entered <- r.Header.Get(HeaderKey)
		select {
		case <-u.hold:
			u.charge(w, r)
		case <-r.Context().Done():
			u.cancelled <- struct{}{}
		}
	})
	mux.HandleFunc("/fail", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		http.Error(w, "upstream broke", http.StatusInternalServerError)
	})
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		w.Write([]byte(strings.Repeat("x", n)))
	})
	mux.HandleFunc("/hang", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		// Read the body first: only then does the server watch the
		// connection and cancel r's context when the proxy gives up.
		io.Copy(io.Discard, r.Body)
		u.entered <- r.Header.Get(HeaderKey)
		<-r.Context().Done()
	})
	mux.HandleFunc("/drop", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close() // no response at all
		}
	})
	mux.HandleFunc("/cut", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		io.Copy(io.Discard, r.Body)
		// A status and part of the body, then the connection breaks.
		w.Header().Set("Content-Length", "1000")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"charge":`))
		rc := http.NewResponseController(w)
		rc.Flush()
		if conn, _, err := rc.Hijack(); err == nil {
			conn.Close()
		}
	})
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		chunk := []byte(strings.Repeat("x", 32<<10))
		for sent := 0; sent < n; sent += len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
			http.NewResponseController(w).Flush()
		}
	})
	mux.HandleFunc("/close-after-read", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		io.Copy(io.Discard, r.Body)
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close() // the request arrived; no answer
		}
	})
	mux.HandleFunc("/status", func(w http.ResponseWriter, r *http.Request) {
		// The first request with a key answers ?code= (with Retry-After
		// when ?retry-after= is set), every later one 201: an upstream
		// that was busy, then did the work.
		u.calls.Add(1)
		key := r.Header.Get(HeaderKey)
		u.mu.Lock()
		u.effects[key]++
		n := u.effects[key]
		u.mu.Unlock()
		code, _ := strconv.Atoi(r.URL.Query().Get("code"))
		if n > 1 || code == 0 {
			code = http.StatusCreated
		} else if ra := r.URL.Query().Get("retry-after"); ra != "" {
			w.Header().Set("Retry-After", ra)
		}
		w.WriteHeader(code)
		fmt.Fprintf(w, `{"call":%d}`, n)
	})
	mux.HandleFunc("/headers", func(w http.ResponseWriter, r *http.Request) {
		// A login-like answer: a session cookie for its caller, a header
		// worth replaying, and a trailer.
		n := u.calls.Add(1)
		w.Header().Set("Set-Cookie", fmt.Sprintf("session=secret-%d; HttpOnly", n))
		w.Header().Set("X-Kept", "yes")
		w.Header().Set("X-Request-Id", fmt.Sprintf("req-%d", n))
		w.Header().Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"login":%d}`, n)
		w.Header().Set("X-Checksum", "abc")
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(r.Header)
	})
	u.Server = httptest.NewServer(mux)
	t.Cleanup(u.Close)
	return u
}

// charge has an effect per call, and answers with a fresh charge id.
func (u *upstream) charge(w http.ResponseWriter, r *http.Request) {
	n := u.calls.Add(1)
	key := r.Header.Get(HeaderKey)
	tok, _, _ := fencing.FromHeader(r.Header)
	u.mu.Lock()
	u.effects[key]++
	u.fences = append(u.fences, tok)
	u.mu.Unlock()
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Charge-Id", fmt.Sprintf("ch_%d", n))
	w.Header().Set("Connection", "close") // hop-by-hop: never replayed
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charge":"ch_%d","request":%q}`, n, body)
}

func (u *upstream) effectsOf(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.effects[key]
}

// newFront puts idem's proxy, configured by cfg, in front of up.
func newFront(t *testing.T, cfg Config, up *upstream, po ProxyOptions) *httptest.Server {
	t.Helper()
	if cfg.Store == nil {
		cfg.Store = newStore(t, "")
	}
	mw, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(up.URL)
	h, err := NewProxy(u, mw, po)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// call sends a request through idem and returns status, headers and body.
type reply struct {
	status int
	header http.Header
	body   string
}

func do(t *testing.T, method, url, key, body string, hdr ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set(HeaderKey, key)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header, string(b)}
}

// problemType returns the type of a problem+json reply, failing the test if
// the reply is not one.
func problemType(t *testing.T, r reply) string {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("status %d with Content-Type %q, body %q; want application/problem+json", r.status, ct, r.body)
	}
	var p Problem
	if err := json.Unmarshal([]byte(r.body), &p); err != nil {
		t.Fatalf("problem body %q: %v", r.body, err)
	}
	if p.Status != r.status {
		t.Fatalf("problem status %d in a %d reply", p.Status, r.status)
	}
	return strings.TrimPrefix(p.Type, ProblemTypePrefix)
}

// freeAddr returns a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// etcdtestProxy puts a fault-injecting proxy in front of the test cluster.
func etcdtestProxy(t *testing.T) (*etcdtest.Proxy, error) {
	p, err := etcdtest.NewProxy(strings.TrimPrefix(cluster.Members[0].ClientURL, "http://"))
	if err == nil {
		t.Cleanup(p.Close)
	}
	return p, err
}

// newStoreOn returns a store that talks to etcd through endpoint.
func newStoreOn(t *testing.T, endpoint string, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	prefix := fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
	s, err := etcdstore.New(ctx, cluster.MustClient(t, endpoint), append([]etcdstore.Option{etcdstore.WithPrefix(prefix)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
