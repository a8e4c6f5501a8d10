package api

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/routers/legacy"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/jobs"
)

// Jobs through the worker API, from a program that is not Go: submit
// (idempotent by id, refusing duplicates when asked), read, and signal the
// event a Go worker's job awaits; every exchange validated against the
// OpenAPI document, over a real socket.
func TestJobsAPIConformsToOpenAPI(t *testing.T) {
	c, vc, store := newJobsAPI(t)

	sub := map[string]any{"id": "refund-9", "kind": "refund", "params": map[string]any{"amount": 5}}
	if st, r := c.post("/v1/jobs", sub); st != 201 || r["state"] != "queued" || r["tenant"] != "jobs" {
		t.Fatalf("submit = %d %v; want 201 queued in tenant jobs", st, r)
	}
	if st, r := c.post("/v1/jobs", sub); st != 200 || r["id"] != "refund-9" {
		t.Fatalf("submit again = %d %v; want 200 and the job", st, r)
	}
	refuse := map[string]any{"id": "refund-9", "kind": "refund", "params": map[string]any{"amount": 5}, "if_exists": "refuse"}
	if st, r := c.post("/v1/jobs", refuse); st != 409 || r["type"] != "urn:idem:problem:duplicate-job" {
		t.Fatalf("submit with if_exists refuse = %d %v; want 409 duplicate-job", st, r)
	}
	if st, r := c.post("/v1/jobs", map[string]any{"id": "refund-9", "kind": "refund", "params": 7}); st != 422 {
		t.Fatalf("submit with other params = %d %v; want 422", st, r)
	}
	for name, body := range map[string]any{
		"no kind":         map[string]any{"id": "x"},
		"bad if_exists":   map[string]any{"id": "x", "kind": "k", "if_exists": "replace"},
		"unknown field":   map[string]any{"id": "x", "kind": "k", "colour": "red"},
		"bad id":          map[string]any{"id": "a b", "kind": "k"},
		"both params":     map[string]any{"id": "x", "kind": "k", "params": 1, "params_base64": "AQ=="},
		"negative window": map[string]any{"id": "x", "kind": "k", "dedup_window_ms": -1},
	} {
		if st, r := c.post("/v1/jobs", body); st != 400 {
			t.Errorf("submit, %s = %d %v; want 400", name, st, r)
		}
	}
	if st, r := c.get("/v1/jobs/x"); st != 404 {
		t.Fatalf("a refused submit wrote a job: %d %v", st, r)
	}
	if st, r := c.post("/v1/jobs/nobody/signals/approved", map[string]any{"payload": true}); st != 404 {
		t.Fatalf("signal to no job = %d %v; want 404", st, r)
	}
	for range 2 { // a retried signal
		if st, r := c.post("/v1/jobs/refund-9/signals/approved", map[string]any{"payload": map[string]any{"by": "ada"}}); st != 202 {
			t.Fatalf("signal = %d %v; want 202", st, r)
		}
	}
	if st, r := c.post("/v1/jobs/refund-9/signals/approved", map[string]any{"payload": map[string]any{"by": "bob"}}); st != 409 || r["type"] != "urn:idem:problem:signal-mismatch" {
		t.Fatalf("signal with another payload = %d %v; want 409 signal-mismatch", st, r)
	}
	if st, r := c.post("/v1/jobs/refund-9/signals/bad*name", map[string]any{}); st != 400 {
		t.Fatalf("signal with a bad event name = %d %v; want 400", st, r)
	}

	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	w, err := jobs.NewWorker(q, []jobs.Kind{{Name: "refund", Steps: []jobs.Step{jobs.AwaitStep("approval", "approved", time.Minute, jobs.Fail)}}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := q.Wait(ctx, "refund-9"); err != nil {
		t.Fatal(err)
	}
	st, r := c.get("/v1/jobs/refund-9")
	steps, _ := r["steps"].([]any)
	if st != 200 || r["state"] != "succeeded" || len(steps) != 1 || fmt.Sprint(steps[0].(map[string]any)["output"]) != "map[by:ada]" {
		t.Fatalf("get = %d %v; want succeeded with ada's approval as the step's output", st, r)
	}
	if st, r := c.post("/v1/jobs/refund-9/signals/late", map[string]any{"payload": 1}); st != 409 || r["type"] != "urn:idem:problem:job-ended" {
		t.Fatalf("signal to an ended job = %d %v; want 409 job-ended", st, r)
	}
	for _, want := range []string{"submitJob 201", "submitJob 200", "submitJob 409", "submitJob 422", "submitJob 400",
		"getJob 200", "getJob 404", "signalJob 202", "signalJob 404", "signalJob 409"} {
		if !vc.seen[want] {
			t.Errorf("no exchange covered %q", want)
		}
	}

	// An API without jobs (a shard set's) says so.
	noJobs := &apiClient{t, newAPIServer(t, store), c.http}
	if st, r := noJobs.post("/v1/jobs", sub); st != 404 || r["type"] != "urn:idem:problem:no-such-route" {
		t.Fatalf("submit where no jobs are served = %d %v; want 404 no-such-route", st, r)
	}
}

// The slots of the jobs' limits, read through the worker API while a
// limited job runs, validated against the OpenAPI document over a real
// socket.
func TestLimitsAPIConformsToOpenAPI(t *testing.T) {
	c, vc, store := newJobsAPI(t)

	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan string, 1), make(chan struct{})
	closeRelease := sync.OnceFunc(func() { close(release) })
	defer closeRelease() // a failure must not leave the step blocked
	w, err := jobs.NewWorker(q, []jobs.Kind{{Name: "payout",
		Limits: []jobs.Limit{{Name: "merchant", Key: jobs.ParamKey("merchant"), Concurrency: 1}},
		Steps: []jobs.Step{{Name: "pay", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			entered <- r.Key().ID
			<-release
			return nil, nil
		}}}}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if st, r := c.post("/v1/jobs", map[string]any{"id": "p-1", "kind": "payout", "params": map[string]any{"merchant": "acme/eu"}}); st != 201 {
		t.Fatalf("submit = %d %v", st, r)
	}
	<-entered
	st, r := c.get("/v1/limits?limit=merchant")
	slots, _ := r["slots"].([]any)
	if st != 200 || len(slots) != 1 || fmt.Sprint(slots[0].(map[string]any)["key"]) != "acme/eu" || slots[0].(map[string]any)["job"] != "p-1" {
		t.Fatalf("limits while p-1 runs = %d %v; want p-1 holding acme/eu's slot", st, r)
	}
	if st, r := c.get("/v1/limits?limit=bad*name"); st != 400 {
		t.Fatalf("limits of a bad name = %d %v; want 400", st, r)
	}
	closeRelease()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if j, err := q.Wait(ctx, "p-1"); err != nil || j.State != jobs.Succeeded {
		t.Fatalf("p-1: %+v %v", j, err)
	}
	if st, r := c.get("/v1/limits"); st != 200 || len(r["slots"].([]any)) != 0 {
		t.Fatalf("limits once p-1 ended = %d %v; want none held", st, r)
	}
	for _, want := range []string{"listSlots 200", "listSlots 400"} {
		if !vc.seen[want] {
			t.Errorf("no exchange covered %q", want)
		}
	}
}

// newJobsAPI serves the worker API with jobs (and hubs) on a fresh store, over a real
// socket, and returns a client whose every exchange is validated against
// the OpenAPI document.
func newJobsAPI(t *testing.T) (*apiClient, *validatingClient, *etcdstore.Store) {
	t.Helper()
	doc := loadSpec(t)
	doc.Servers = nil
	router, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	vc := &validatingClient{t: t, router: router, seen: map[string]bool{}}
	prefix := fmt.Sprintf("/t/api/%d/", prefixSeq.Add(1))
	store := newStore(t, prefix)
	var mu sync.Mutex
	hubs := map[string]*jobs.Hub{} // each tenant's, for the /v1/work routes
	api, err := idemhttp.NewAPI(idemhttp.APIConfig{Store: store, Jobs: &idemhttp.JobsConfig{
		Queue: func(tenant string) (*jobs.Queue, error) { return jobs.New(store, jobs.WithTenant(tenant)) },
		Hub: func(tenant string) (*jobs.Hub, error) {
			mu.Lock()
			defer mu.Unlock()
			if hubs[tenant] == nil {
				q, err := jobs.New(store, jobs.WithTenant(tenant))
				if err != nil {
					return nil, err
				}
				h, err := jobs.NewHub(q)
				if err != nil {
					return nil, err
				}
				hubs[tenant] = h
				t.Cleanup(func() { h.Close() })
			}
			return hubs[tenant], nil
		},
	}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	c := &apiClient{t, srv.URL, &http.Client{Transport: vc}}
	return c, vc, store
}
