package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/idemclient"
	"github.com/idem-dev/idem/idemhttp"
)

// ledger is an upstream that charges on every request it gets, with no
// deduplication of its own: only idem stands between a retry and a second
// charge. onCharge runs after the charge, before the answer.
type ledger struct {
	*httptest.Server
	mu       sync.Mutex
	charges  map[string]int
	onCharge func(order string, first bool)
}

func newLedger(t *testing.T) *ledger {
	l := &ledger{charges: map[string]int{}}
	l.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Order string }
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		l.mu.Lock()
		l.charges[req.Order]++
		n := l.charges[req.Order]
		hook := l.onCharge
		l.mu.Unlock()
		if hook != nil {
			hook(req.Order, n == 1)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%q,"charge":"ch_%s_%d"}`, req.Order, req.Order, n)
	}))
	t.Cleanup(l.Close)
	return l
}

func (l *ledger) count(order string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.charges[order]
}

// The retrying client against idem serve, with the reply of every order's
// first attempt lost after the upstream charged: N orders, each charged
// once, each answered with the first charge (replayed).
func TestRetryingClientLostReplies(t *testing.T) {
	dir := tempDir(t)
	up := newLedger(t)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL)...)
	lossy, err := etcdtest.NewProxy(strings.TrimPrefix(idem.listen, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(lossy.Close)
	up.onCharge = func(_ string, first bool) {
		if first {
			lossy.DropConnections() // the client's connection breaks; idem's request to the upstream goes on
		}
	}
	var retries sync.Map // key -> statuses seen
	client := &http.Client{Transport: &idemclient.Transport{
		BaseDelay: 20 * time.Millisecond, MaxAttempts: 30, Budget: 30 * time.Second,
		OnRetry: func(ri idemclient.RetryInfo) {
			v, _ := retries.LoadOrStore(ri.Key, new([]int))
			*v.(*[]int) = append(*v.(*[]int), ri.Status)
		},
	}}
	const n, parallel = 30, 5
	sem := make(chan struct{}, parallel)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			order := fmt.Sprint("o", i)
			var rep idemclient.Report
			ctx := idemclient.WithReport(context.Background(), &rep)
			req, _ := http.NewRequestWithContext(ctx, "POST", lossy.URL()+"/charges", strings.NewReader(`{"order":"`+order+`"}`))
			resp, err := client.Do(req)
			if err != nil {
				t.Errorf("%s: %v", order, err)
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusCreated || !strings.Contains(string(body), `"charge":"ch_`+order+`_1"`) {
				t.Errorf("%s: %d %s, want 201 with the first charge", order, resp.StatusCode, body)
			}
			// Its first reply was lost, so its answer came from a retry:
			// the saved one. (The retry may be net/http's own: it resends a
			// request with an Idempotency-Key on a broken reused connection,
			// within one attempt of the Transport's.)
			if !rep.Replayed || !idemclient.Replayed(resp) || rep.Key == "" || rep.Attempts < 1 {
				t.Errorf("%s: report %+v, replayed header %v: want a replay", order, rep, idemclient.Replayed(resp))
			}
		})
	}
	wg.Wait()
	double := 0
	for i := range n {
		if c := up.count(fmt.Sprint("o", i)); c != 1 {
			double++
			t.Errorf("o%d charged %d times", i, c)
		}
	}
	seen409 := false
	retries.Range(func(_, v any) bool {
		for _, s := range *v.(*[]int) {
			seen409 = seen409 || s == http.StatusConflict
			if s != 0 && s != http.StatusConflict && s != http.StatusServiceUnavailable {
				t.Errorf("retried a %d", s)
			}
		}
		return true
	})
	t.Logf("%d orders, %d charged more than once; a 409 retried: %v", n, double, seen409)
}

// What a retry would get again is not retried: 422 (a key reused with other
// parameters) and 400. A 409 is retried, waiting Retry-After, until the
// budget, capped by the server's retention.
func TestRetryingClientStopsWhereItMust(t *testing.T) {
	dir := tempDir(t)
	up := newLedger(t)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL)...)
	var waits []time.Duration
	var statuses []int
	client := &http.Client{Transport: &idemclient.Transport{
		BaseDelay: 10 * time.Millisecond, Budget: 2500 * time.Millisecond,
		OnRetry: func(ri idemclient.RetryInfo) { waits, statuses = append(waits, ri.Wait), append(statuses, ri.Status) },
	}}
	post := func(key, body string) (*http.Response, idemclient.Report) {
		t.Helper()
		var rep idemclient.Report
		ctx := idemclient.WithReport(idemclient.WithKey(context.Background(), key), &rep)
		req, _ := http.NewRequestWithContext(ctx, "POST", idem.listen+"/charges", strings.NewReader(body))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp, rep
	}
	if resp, rep := post("k1", `{"order":"a"}`); resp.StatusCode != 201 || rep.Attempts != 1 || rep.Key != "k1" {
		t.Fatalf("first: %d %+v", resp.StatusCode, rep)
	}
	if resp, rep := post("k1", `{"order":"b"}`); resp.StatusCode != 422 || rep.Attempts != 1 {
		t.Fatalf("reused key: %d after %d attempts, want 422 after 1", resp.StatusCode, rep.Attempts)
	}
	if resp, rep := post(strings.Repeat("x", 300), `{"order":"c"}`); resp.StatusCode != 400 || rep.Attempts != 1 {
		t.Fatalf("bad key: %d after %d attempts, want 400 after 1", resp.StatusCode, rep.Attempts)
	}
	if len(statuses) != 0 {
		t.Fatalf("retried %v", statuses)
	}

	// A key held in flight by a request whose upstream does not answer.
	hold := make(chan struct{})
	held := make(chan struct{})
	up.onCharge = func(order string, _ bool) {
		if order == "slow" {
			close(held)
			<-hold
		}
	}
	defer close(hold)
	go func() {
		req, _ := http.NewRequest("POST", idem.listen+"/charges", strings.NewReader(`{"order":"slow"}`))
		req.Header.Set("Idempotency-Key", "k-slow")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	<-held
	resp, rep := post("k-slow", `{"order":"slow"}`)
	if resp.StatusCode != http.StatusConflict || rep.Attempts < 2 {
		t.Fatalf("in flight: %d after %d attempts, want 409 after retries", resp.StatusCode, rep.Attempts)
	}
	ra := resp.Header.Get("Retry-After")
	for i, w := range waits {
		if statuses[i] != http.StatusConflict || ra == "" || w != mustSeconds(t, ra) {
			t.Fatalf("retry %d: status %d waited %v; Retry-After was %q", i, statuses[i], w, ra)
		}
	}
	if up.count("slow") != 1 {
		t.Fatalf("the held order was charged %d times", up.count("slow"))
	}
}

func mustSeconds(t *testing.T, s string) time.Duration {
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil {
		t.Fatalf("Retry-After %q: %v", s, err)
	}
	return time.Duration(n) * time.Second
}

// The worker API client: claim, conflict, complete, replay, mismatch, get.
func TestWorkerClient(t *testing.T) {
	dir := tempDir(t)
	idem := startIdem(t, dir, embeddedFlags(t, filepath.Join(dir, "data"))...)
	w, err := idemclient.NewWorker(idem.listen, &idemclient.Transport{MaxAttempts: 2, BaseDelay: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idemclient.NewWorker("idem:8080", nil); err == nil {
		t.Fatal("a URL without a scheme was accepted")
	}
	ctx := context.Background()
	params := json.RawMessage(`{"amount":100}`)
	c, err := w.Claim(ctx, "job-1", params, idemclient.ClaimOptions{Deadline: 30 * time.Second})
	if err != nil || c.State != "claimed" || c.Handle == nil || c.Token <= 0 {
		t.Fatalf("claim: %+v %v", c, err)
	}
	if _, err := w.Claim(ctx, "job-1", params, idemclient.ClaimOptions{}); !errors.Is(err, idemclient.ErrInFlight) {
		t.Fatalf("a second claim while the first holds: %v, want ErrInFlight", err)
	}
	cp, err := w.Checkpoint(ctx, *c.Handle, []byte("step-1"), time.Minute)
	if err != nil || cp.Handle == nil {
		t.Fatalf("checkpoint: %+v %v", cp, err)
	}
	rec, err := w.Get(ctx, "job-1")
	if err != nil || string(rec.Checkpoint) != "step-1" || rec.State != "in_flight" {
		t.Fatalf("get: %+v %v", rec, err)
	}
	if done, err := w.Complete(ctx, *cp.Handle, idemhttp.OutcomeJSON{Status: 200, Body: []byte("ok")}); err != nil || done.State != "done" {
		t.Fatalf("complete: %+v %v", done, err)
	}
	again, err := w.Claim(ctx, "job-1", params, idemclient.ClaimOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if again.State != "done" || again.Outcome == nil || string(again.Outcome.Body) != "ok" {
		t.Fatalf("claim after complete: %+v, want the saved outcome", again)
	}
	if _, err := w.Claim(ctx, "job-1", json.RawMessage(`{"amount":200}`), idemclient.ClaimOptions{}); !errors.Is(err, idemclient.ErrKeyReused) {
		t.Fatalf("other params: %v, want ErrKeyReused", err)
	}
	if _, err := w.Get(ctx, "nope"); !errors.Is(err, idemclient.ErrNotFound) {
		t.Fatalf("get of an unknown key: %v, want ErrNotFound", err)
	}
}
