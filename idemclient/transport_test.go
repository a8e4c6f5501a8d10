package idemclient_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/idemclient"
)

// script is a server that answers attempt i with statuses[i] (the last
// one from then on), recording each attempt's key and body.
type script struct {
	*httptest.Server
	mu     sync.Mutex
	keys   []string
	bodies []string
}

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
		w.WriteHeader(statuses[min(n, len(statuses))-1])
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
	for _, status := range []int{400, 401, 403, 404, 413, 422, 429, 500, 502, 504} {
		s := newScript(t, []int{status, 201}, nil)
		resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, s.URL, "POST", context.Background())
		if err != nil || resp.StatusCode != status || rep.Attempts != 1 {
			t.Fatalf("%d: got %v after %d attempts (%v), want it returned after 1", status, resp.StatusCode, rep.Attempts, err)
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

// A replayed 409 or 503 is the upstream's own answer, saved: final. So is a
// 409 saying the claim was taken over.
func TestFinalConflictsNotRetried(t *testing.T) {
	replayed := newScript(t, []int{409, 201}, http.Header{idemclient.HeaderReplayed: {"true"}})
	resp, rep, err := post(t, &idemclient.Transport{BaseDelay: time.Millisecond}, replayed.URL, "POST", context.Background())
	if err != nil || resp.StatusCode != 409 || rep.Attempts != 1 || !rep.Replayed {
		t.Fatalf("a replayed 409: %v after %d attempts (%v), replayed=%v", resp.StatusCode, rep.Attempts, err, rep.Replayed)
	}
	fenced := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusConflict)
		io.WriteString(w, `{"type":"urn:idem:problem:fenced","title":"Claim lost to a newer owner","status":409}`)
	}))
	t.Cleanup(fenced.Close)
	var rep2 idemclient.Report
	req, _ := http.NewRequestWithContext(idemclient.WithReport(context.Background(), &rep2), "POST", fenced.URL, strings.NewReader(`{}`))
	resp, err = (&http.Client{Transport: &idemclient.Transport{BaseDelay: time.Millisecond}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 409 || rep2.Attempts != 1 || !strings.Contains(string(body), `"type"`) {
		t.Fatalf("a fenced 409: %d after %d attempts, body %q (want it whole)", resp.StatusCode, rep2.Attempts, body)
	}
}
