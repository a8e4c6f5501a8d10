package idemhttp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

func reviewJobsServer(t *testing.T) (*jobs.Queue, string) {
	t.Helper()
	store := newStore(t, "")
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	api, err := NewAPI(APIConfig{Store: store, Jobs: &JobsConfig{
		Queue: func(tenant string) (*jobs.Queue, error) { return jobs.New(store, jobs.WithTenant(tenant)) },
	}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return q, srv.URL
}

func reviewPost(t *testing.T, url string, body any) (int, map[string]any) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var m map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&m)
	return resp.StatusCode, m
}

// DEFECT. api/openapi.yaml: dedup_window_ms is an integer, minimum 0, no
// maximum: "the id names one job for this long after it was submitted"; the
// brief's rule, bad input gets a clear error and changes nothing. A client
// asking for a window of ~584 years (18446744073710 ms) gets a window of
// 0.45 ms: api_jobs.go submitJob computes
// time.Duration(req.DedupWindowMS) * time.Millisecond, which overflows int64
// and wraps. The ended job is replaced at once by a job with other params
// (201) where the window promised 422 mismatch. (A value in
// [9223372036855, ...) wraps negative instead and is refused as a "negative
// dedup window" for a positive input.)
func TestReviewJobsDedupWindowOverflow(t *testing.T) {
	q, url := reviewJobsServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const window = 18446744073710 // ms: about 584 years; times 1e6 wraps to 448384 ns
	if st, r := reviewPost(t, url+"/v1/jobs", map[string]any{"id": "o-1", "kind": "k", "params": 1, "dedup_window_ms": window}); st != 400 {
		t.Fatalf("submit with a window past 100 years = %d %v; want 400", st, r)
	}
	if _, err := q.Get(ctx, "o-1"); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("a refused submit wrote the job: %v", err)
	}
	const longest = 3153600000000 // 100 years: the most the API takes
	if st, r := reviewPost(t, url+"/v1/jobs", map[string]any{"id": "o-1", "kind": "k", "params": 1, "dedup_window_ms": longest}); st != 201 {
		t.Fatalf("submit = %d %v", st, r)
	}
	if _, err := q.Cancel(ctx, "o-1", "ended"); err != nil {
		t.Fatal(err)
	}
	if j, err := q.Get(ctx, "o-1"); err != nil || j.State != jobs.Cancelled {
		t.Fatalf("job = %+v, %v; want cancelled", j, err)
	}
	st, r := reviewPost(t, url+"/v1/jobs", map[string]any{"id": "o-1", "kind": "k", "params": 2, "dedup_window_ms": longest})
	if st != 422 && st != 400 {
		t.Fatalf("submit of other params inside a 100-year dedup window = %d %v; want 422 mismatch (or 400 for a window out of range), not a new job", st, r)
	}
}

// Regression (passes): the signal route answers 202 for a retried signal with
// an absent payload, and a job that ended is 409 job-ended.
func TestReviewJobsSignalEmptyPayloadRetried(t *testing.T) {
	q, url := reviewJobsServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := q.Submit(ctx, "p-1", "k", nil); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if st, r := reviewPost(t, url+"/v1/jobs/p-1/signals/go", map[string]any{}); st != 202 {
			t.Fatalf("signal = %d %v; want 202", st, r)
		}
	}
	if _, err := q.Cancel(ctx, "p-1", ""); err != nil {
		t.Fatal(err)
	}
	if st, r := reviewPost(t, url+"/v1/jobs/p-1/signals/go", map[string]any{}); st != 409 || r["type"] != "urn:idem:problem:job-ended" {
		t.Fatalf("signal to a cancelled job = %d %v; want 409 job-ended", st, r)
	}
}
