package idemclient_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/idemclient"
)

// script is a server that answers attempt i with statuses[i] (the last
// one from then on), recording each attempt's key and body. A status
// idem answers itself is given as idem would (problem+json, its kind),
// unless the test sets a Content-Type.
type script struct {
	*httptest.Server
	mu     sync.Mutex
	keys   []string
	bodies []string
}

// idemKinds are the problems idem answers a retry may change.
var idemKinds = map[int]string{409: "conflict", 429: "rate-limited", 502: "upstream-unavailable", 503: "unavailable"}

func newScript(t *testing.T, statuses []int, header http.Header) *script {
	s := &script{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.keys = append(s.keys, r.Header.Get(idemclient.HeaderKey))
		s.bodies = append(s.bodies, string(b))
		n := len(s.keys)
		s.mu.Unlock()
		for k, v := range header {
			w.Header()[k] = v
		}
		st := statuses[min(n, len(statuses))-1]
		if kind, ok := idemKinds[st]; ok && header.Get("Content-Type") == "" && header.Get(idemclient.HeaderReplayed) == "" {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(st)
			fmt.Fprintf(w, `{"type":"urn:idem:problem:%s","status":%d}`, kind, st)
			return
		}
		w.WriteHeader(st)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *script) attempts() ([]string, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...), append([]string(nil), s.bodies...)
}

func post(t *testing.T, tr *idemclient.Transport, url, method string, ctx context.Context) (*http.Response, idemclient.Report, error) {
	t.Helper()
	var rep idemclient.Report
	req, _ := http.NewRequestWithContext(idemclient.WithReport(ctx, &rep), method, url, strings.NewReader(`{"amount":1}`))
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if resp != nil {
		resp.Body.Close()
	}
	return resp, rep, err
}

func TestOneKeyAndBodyAcrossRetries(t *testing.T) {
	s := newScript(t, []int{503, 409, 201}, nil)
	var waits []time.Duration
	tr := &idemclient.Transport{BaseDelay: time.Millisecond, OnRetry: func(ri idemclient.RetryInfo) { waits = append(waits, ri.Wait) }}
	resp, rep, err := post(t, tr, s.URL, "POST", context.Background())
	if err != nil || resp.StatusCode != 201 || rep.Attempts != 3 {
		t.Fatalf("%v %+v %v: want 201 after 3 attempts", resp, rep, err)
	}
	keys, bodies := s.attempts()
	for i := range keys {
		if keys[i] != rep.Key || keys[i] == "" || bodies[i] != `{"amount":1}` {
			t.Fatalf("attempt %d sent key %q body %q; the report's key is %q", i, keys[i], bodies[i], rep.Key)
		}
	}
	if len(waits) != 2 || waits[0] <= 0 || waits[0] > 2*time.Millisecond || waits[1] > 4*time.Millisecond {
		t.Fatalf("waits %v: want full jitter under 2 and 4 ms", waits)
	}
	// A caller's key is kept.
	ctx := idemclient.WithKey(context.Background(), "order-9")
	if _, rep, err := post(t, tr, s.URL, "POST", ctx); err != nil || rep.Key != "order-9" {
		t.Fatalf("%+v %v", rep, err)
	}
}

func TestNeverRetried(t *testing.T) {
	// The upstream's own answers, through idem's claim (which says its
	// retention): final, whatever the status, the first time too.
	upstream := http.Header{idemclient.HeaderRetention: {"86400"}, "Content-Type": {"application/json"}}
	for _, status := range []int{400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503, 504} {
		s := newScript(t, []int{status, 201}, upstream)
		resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, s.URL, "POST", context.Background())
		if err != nil || resp.StatusCode != status || rep.Attempts != 1 {
			t.Fatalf("the upstream's %d: got %v after %d attempts (%v), want it returned after 1", status, resp.StatusCode, rep.Attempts, err)
		}
	}
	// idem's own refusals that a retry would get again.
	for _, kind := range []string{"mismatch", "invalid-key", "response-not-saved", "upstream-outcome-unknown"} {
		s := newScript(t, []int{422, 201}, http.Header{"Content-Type": {"application/problem+json"}})
		s.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(422)
			fmt.Fprintf(w, `{"type":"urn:idem:problem:%s","status":422}`, kind)
		})
		resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, s.URL, "POST", context.Background())
		if err != nil || rep.Attempts != 1 {
			t.Fatalf("idem's %s: got %v after %d attempts (%v), want it returned after 1", kind, resp, rep.Attempts, err)
		}
	}
	// Methods not covered pass through once, without a key.
	s := newScript(t, []int{503, 200}, nil)
	resp, _, err := post(t, &idemclient.Transport{}, s.URL, "PUT", context.Background())
	if keys, _ := s.attempts(); err != nil || resp.StatusCode != 503 || len(keys) != 1 || keys[0] != "" {
		t.Fatalf("PUT: %v %v keys %q", resp, err, keys)
	}
}

func TestRetryAfterAndRetentionBudget(t *testing.T) {
	// Retry-After as a date, in the past: retry at once.
	past := http.Header{"Retry-After": {time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat)}}
	var waits []time.Duration
	tr := &idemclient.Transport{BaseDelay: time.Hour, OnRetry: func(ri idemclient.RetryInfo) { waits = append(waits, ri.Wait) }}
	s := newScript(t, []int{409, 201}, past)
	if resp, _, err := post(t, tr, s.URL, "POST", context.Background()); err != nil || resp.StatusCode != 201 || len(waits) != 1 || waits[0] != 0 {
		t.Fatalf("%v %v waits %v: want one retry without waiting", resp, err, waits)
	}
	// A server that keeps its keys 8 s caps the budget at 2 s: a 503 with
	// Retry-After 3 is returned, not waited for.
	hdr := http.Header{"Retry-After": {"3"}, idemclient.HeaderRetention: {"8"}}
	s = newScript(t, []int{503}, hdr)
	resp, rep, err := post(t, &idemclient.Transport{Budget: time.Hour}, s.URL, "POST", context.Background())
	if err != nil || resp.StatusCode != 503 || rep.Attempts != 1 {
		t.Fatalf("%v after %d attempts (%v): want the 503 back at once", resp, rep.Attempts, err)
	}
}

func TestNetworkErrorsSpendTheBudget(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	accepted := 0
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			accepted++
			mu.Unlock()
			c.Close() // the request may have arrived; no answer
		}
	}()
	t.Cleanup(func() { ln.Close() })
	_, rep, err := post(t, &idemclient.Transport{MaxAttempts: 4, BaseDelay: time.Millisecond}, "http://"+ln.Addr().String(), "POST", context.Background())
	if !errors.Is(err, idemclient.ErrBudget) || rep.Attempts != 4 || !strings.Contains(err.Error(), rep.Key) {
		t.Fatalf("%v after %d attempts: want ErrBudget naming the key after 4", err, rep.Attempts)
	}
	mu.Lock()
	defer mu.Unlock()
	if accepted < 4 {
		t.Fatalf("%d connections for 4 attempts", accepted)
	}
}

func TestContextEndsTheWait(t *testing.T) {
	s := newScript(t, []int{409}, http.Header{"Retry-After": {"60"}})
	ctx, cancel := context.WithCancel(context.Background())
	tr := &idemclient.Transport{Budget: time.Hour, OnRetry: func(idemclient.RetryInfo) { cancel() }}
	_, _, err := post(t, tr, s.URL, "POST", ctx)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("%v: want the context's error", err)
	}
}

// A replayed 409 or 503 is the upstream's own answer, saved: final.
func TestFinalConflictsNotRetried(t *testing.T) {
	for _, status := range []int{409, 503} {
		replayed := newScript(t, []int{status, 201}, http.Header{idemclient.HeaderReplayed: {"true"}})
		resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, replayed.URL, "POST", context.Background())
		if err != nil || resp.StatusCode != status || rep.Attempts != 1 || !rep.Replayed {
			t.Fatalf("a replayed %d: %v after %d attempts (%v), replayed=%v", status, resp.StatusCode, rep.Attempts, err, rep.Replayed)
		}
	}
}

// What idem says to retry with the same key is retried: 429 rate-limited,
// 502 upstream-unavailable, 409 fenced (through the proxy: the retry gets
// the other owner's answer), and a gateway's 502/503/504 that never came
// through idem's claim.
func TestIdemsRetryableAnswersAreRetried(t *testing.T) {
	for _, status := range []int{409, 429, 502, 503} {
		s := newScript(t, []int{status, 201}, nil)
		resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, s.URL, "POST", context.Background())
		if err != nil || resp.StatusCode != 201 || rep.Attempts != 2 {
			t.Fatalf("idem's %d %s: %v after %d attempts (%v), want 201 after 2", status, idemKinds[status], resp, rep.Attempts, err)
		}
		if keys, _ := s.attempts(); keys[0] != keys[1] {
			t.Fatalf("idem's %d: keys %q, want one", status, keys)
		}
	}
	var n atomic.Int32
	fenced := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusConflict)
			io.WriteString(w, `{"type":"urn:idem:problem:fenced","title":"Claim lost to a newer owner","status":409}`)
			return
		}
		w.Header().Set(idemclient.HeaderReplayed, "true")
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(fenced.Close)
	if resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, fenced.URL, "POST", context.Background()); err != nil || resp.StatusCode != 201 || rep.Attempts != 2 || !rep.Replayed {
		t.Fatalf("a fenced 409: %v after %d attempts (%v), want the other owner's 201 after 2", resp, rep.Attempts, err)
	}
	for _, status := range []int{502, 503, 504} {
		s := newScript(t, []int{status, 201}, http.Header{"Content-Type": {"text/html"}})
		resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, s.URL, "POST", context.Background())
		if err != nil || resp.StatusCode != 201 || rep.Attempts != 2 {
			t.Fatalf("a gateway's %d: %v after %d attempts (%v), want 201 after 2", status, resp, rep.Attempts, err)
		}
	}
}

// cutServer answers the first cuts attempts with a 201 whose body is cut
// off after its headers, then the whole answer, marked replayed.
func cutServer(t *testing.T, cuts int32) (*httptest.Server, *atomic.Int32) {
	var n atomic.Int32
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) <= cuts {
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"id":"ch_1"`)
			w.(http.Flusher).Flush()
			c, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				c.Close()
			}
			return
		}
		w.Header().Set(idemclient.HeaderReplayed, "true")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"ch_1","amount":1}`)
	}))
	t.Cleanup(s.Close)
	return s, &n
}

// A reply cut off after its headers is retried with the same key, and the
// caller gets the whole (saved) answer; when every attempt is cut, the
// error names the key.
func TestBodyCutOffIsRetriedWithTheSameKey(t *testing.T) {
	s, n := cutServer(t, 1)
	var rep idemclient.Report
	req, _ := http.NewRequestWithContext(idemclient.WithReport(context.Background(), &rep), "POST", s.URL, strings.NewReader(`{"amount":1}`))
	resp, err := (&http.Client{Transport: &idemclient.Transport{BaseDelay: time.Millisecond}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 201 || string(body) != `{"id":"ch_1","amount":1}` || rep.Attempts != 2 || !rep.Replayed || n.Load() != 2 {
		t.Fatalf("%v %q %v after %d attempts (server saw %d), want the whole saved answer after 2", resp.StatusCode, body, err, rep.Attempts, n.Load())
	}

	s, _ = cutServer(t, 100)
	req, _ = http.NewRequestWithContext(idemclient.WithReport(context.Background(), &rep), "POST", s.URL, strings.NewReader(`{"amount":1}`))
	_, err = (&http.Client{Transport: &idemclient.Transport{BaseDelay: time.Millisecond, MaxAttempts: 3}}).Do(req)
	key, ok := idemclient.KeyOf(err)
	if !errors.Is(err, idemclient.ErrBudget) || !ok || key != rep.Key || !strings.Contains(err.Error(), rep.Key) {
		t.Fatalf("every reply cut: %v (key %q %v), want ErrBudget naming the key %s", err, key, ok, rep.Key)
	}
}
