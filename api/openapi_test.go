// Package api holds the worker API's contract, openapi.yaml, and the test
// that holds idem's API to it: every route documented, every exchange of a
// worker's life validated against the document, over real sockets.
package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/idemhttp"
)

const specPath = "openapi.yaml"

var cluster *etcdtest.Cluster

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m, 1, etcdtest.Options{}, &cluster)) }

var prefixSeq atomic.Int64

// newStore returns a store under prefix, closed when the test ends.
func newStore(t *testing.T, prefix string) *etcdstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.New(ctx, cluster.MustClient(t), etcdstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func loadSpec(t *testing.T) *openapi3.T {
	t.Helper()
	doc, err := openapi3.NewLoader().LoadFromFile(specPath)
	if err != nil {
		t.Fatalf("load %s: %v", specPath, err)
	}
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("%s is not a valid OpenAPI document: %v", specPath, err)
	}
	return doc
}

func TestOpenAPIDocumentsEveryRoute(t *testing.T) {
	doc := loadSpec(t)
	var documented, served []string
	for path, item := range doc.Paths.Map() {
		for method := range item.Operations() {
			documented = append(documented, method+" "+path)
		}
	}
	for _, rt := range idemhttp.APIRoutes() {
		served = append(served, rt.Method+" "+rt.Pattern)
		op := doc.Paths.Find(rt.Pattern).GetOperation(rt.Method)
		if op == nil || op.OperationID != rt.Op {
			t.Errorf("%s %s (%s) is not documented as operation %q", rt.Method, rt.Pattern, rt.Op, rt.Op)
		}
	}
	sort.Strings(documented)
	sort.Strings(served)
	if strings.Join(documented, "\n") != strings.Join(served, "\n") {
		t.Fatalf("documented routes:\n%s\nserved routes:\n%s", strings.Join(documented, "\n"), strings.Join(served, "\n"))
	}
}

// validatingClient checks every request it sends and every response it
// gets against the OpenAPI document.
type validatingClient struct {
	t      *testing.T
	router routers.Router
	mu     sync.Mutex
	seen   map[string]bool // "operationId status" pairs exercised
}

func (v *validatingClient) RoundTrip(req *http.Request) (*http.Response, error) {
	var reqBody []byte
	if req.Body != nil {
		reqBody, _ = io.ReadAll(req.Body)
		req.Body = io.NopCloser(bytes.NewReader(reqBody))
	}
	route, params, err := v.router.FindRoute(req)
	if err != nil {
		v.t.Errorf("%s %s: not in the OpenAPI document: %v", req.Method, req.URL, err)
		return http.DefaultTransport.RoundTrip(req)
	}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route,
		Options: &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc}}
	// Requests that are meant to be bad are sent anyway; only good ones must
	// conform.
	reqErr := openapi3filter.ValidateRequest(context.Background(), in)
	req.Body = io.NopCloser(bytes.NewReader(reqBody))
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body = io.NopCloser(bytes.NewReader(body))
	if reqErr != nil && resp.StatusCode < 400 {
		v.t.Errorf("%s %s: request does not match the document (%v), yet got %d", req.Method, req.URL.Path, reqErr, resp.StatusCode)
	}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header,
		Options: &openapi3filter.Options{IncludeResponseStatus: true}}
	out.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		v.t.Errorf("%s %s -> %d %s: response does not match the document: %v", req.Method, req.URL.Path, resp.StatusCode, body, err)
	}
	v.mu.Lock()
	v.seen[fmt.Sprintf("%s %d", route.Operation.OperationID, resp.StatusCode)] = true
	v.mu.Unlock()
	return resp, nil
}

type apiClient struct {
	t    *testing.T
	base string
	http *http.Client
}

func (c *apiClient) post(path string, body any, hdr ...string) (int, map[string]any) {
	c.t.Helper()
	b, _ := json.Marshal(body)
	if s, ok := body.(string); ok {
		b = []byte(s)
	}
	req, _ := http.NewRequest("POST", c.base+path, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return c.send(req)
}

func (c *apiClient) get(path string) (int, map[string]any) {
	c.t.Helper()
	req, _ := http.NewRequest("GET", c.base+path, nil)
	return c.send(req)
}

func (c *apiClient) send(req *http.Request) (int, map[string]any) {
	c.t.Helper()
	resp, err := c.http.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		c.t.Fatalf("%s %s: %d, body not JSON: %v", req.Method, req.URL.Path, resp.StatusCode, err)
	}
	return resp.StatusCode, m
}

func newAPIServer(t *testing.T, store *etcdstore.Store) string {
	t.Helper()
	api, err := idemhttp.NewAPI(idemhttp.APIConfig{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return srv.URL
}

// A worker's whole life through the API, on two idem processes, every
// exchange validated against the OpenAPI document.
func TestAPIConformsToOpenAPI(t *testing.T) {
	doc := loadSpec(t)
	doc.Servers = nil // match any host
	router, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	vc := &validatingClient{t: t, router: router, seen: map[string]bool{}}
	hc := &http.Client{Transport: vc}
	prefix := fmt.Sprintf("/t/api/%d/", prefixSeq.Add(1))
	a := &apiClient{t, newAPIServer(t, newStore(t, prefix)), hc} // idem process A
	b := &apiClient{t, newAPIServer(t, newStore(t, prefix)), hc} // idem process B

	params := map[string]any{"order": 42, "amount": 100}
	st, claimed := a.post("/v1/claim", map[string]any{"key": "job-1", "params": params, "deadline_ms": 60000})
	if st != 201 || claimed["state"] != "claimed" {
		t.Fatalf("claim = %d %v", st, claimed)
	}
	handle := claimed["handle"]
	// The worker lost that reply and claims again with its attempt id: it
	// gets its claim back, not a conflict.
	attempt := handle.(map[string]any)["attempt"]
	st, again := a.post("/v1/claim", map[string]any{"key": "job-1", "params": params, "attempt": attempt})
	if st != 201 || fmt.Sprint(again["handle"]) != fmt.Sprint(handle) {
		t.Fatalf("re-claim with the same attempt = %d %v; want the same claim %v", st, again, handle)
	}
	if st, r := a.post("/v1/claim", map[string]any{"key": "job-1", "params": 7, "attempt": attempt}); st != 422 {
		t.Fatalf("re-claim with the same attempt and other params = %d %v; want 422", st, r)
	}
	if st, r := b.post("/v1/claim", map[string]any{"key": "job-1", "params": params}); st != 409 {
		t.Fatalf("second claim = %d %v; want 409", st, r)
	}
	if st, r := b.post("/v1/claim", map[string]any{"key": "job-1", "params": map[string]any{"order": 43}}); st != 422 {
		t.Fatalf("claim with other params = %d %v; want 422", st, r)
	}
	st, cp := a.post("/v1/checkpoint", map[string]any{"handle": handle, "checkpoint": []byte("step 1"), "extend_ms": 60000})
	if st != 200 || cp["handle"] == nil {
		t.Fatalf("checkpoint = %d %v", st, cp)
	}
	// A handle from before the checkpoint (its reply lost) still names the
	// claim: key, attempt and token identify it.
	if st, r := a.post("/v1/renew", map[string]any{"handle": handle, "extend_ms": 60000}); st != 200 {
		t.Fatalf("renew with the handle from before the checkpoint = %d %v; want 200", st, r)
	}
	handle = cp["handle"]
	st, rn := b.post("/v1/renew", map[string]any{"handle": handle, "extend_ms": 60000}) // through the other process
	if st != 200 {
		t.Fatalf("renew through B = %d %v", st, rn)
	}
	handle = rn["handle"]
	if st, r := a.get("/v1/keys/job-1"); st != 200 || r["state"] != "in_flight" {
		t.Fatalf("get = %d %v", st, r)
	}
	waited := make(chan map[string]any, 1)
	go func() {
		_, r := b.post("/v1/claim", map[string]any{"key": "job-1", "params": params}, "Prefer", "wait=30")
		waited <- r
	}()
	st, r := b.post("/v1/complete", map[string]any{"handle": handle, "outcome": map[string]any{"status": 201, "body": []byte(`{"charged":true}`)}})
	if st != 200 || r["state"] != "done" {
		t.Fatalf("complete through B = %d %v", st, r)
	}
	// The worker lost that reply and completes again: its outcome is the
	// saved one, so it is told so, not that its claim was lost.
	if st, r := a.post("/v1/complete", map[string]any{"handle": handle, "outcome": map[string]any{"status": 201, "body": []byte(`{"charged":true}`)}}); st != 200 || r["state"] != "done" {
		t.Fatalf("complete again after a lost reply = %d %v; want 200 done", st, r)
	}
	if st, r := a.post("/v1/complete", map[string]any{"handle": handle, "outcome": map[string]any{"status": 500}}); st != 409 {
		t.Fatalf("complete again with another outcome = %d %v; want 409", st, r)
	}
	if w := <-waited; w["state"] != "done" {
		t.Fatalf("waiting claim = %v; want the outcome", w)
	}
	st, done := a.post("/v1/claim", map[string]any{"key": "job-1", "params": params})
	if st != 200 || done["state"] != "done" || done["outcome"].(map[string]any)["body"] != "eyJjaGFyZ2VkIjp0cnVlfQ==" {
		t.Fatalf("claim of a done key = %d %v; want the saved outcome", st, done)
	}
	if st, r := a.get("/v1/keys/job-1?wait=1"); st != 200 || r["state"] != "done" {
		t.Fatalf("get with wait = %d %v", st, r)
	}

	// Release and abandon.
	_, c2 := a.post("/v1/claim", map[string]any{"key": "job-2"})
	if st, r := a.post("/v1/release", map[string]any{"handle": c2["handle"]}); st != 200 || r["state"] != "released" {
		t.Fatalf("release = %d %v", st, r)
	}
	if st, r := a.get("/v1/keys/job-2"); st != 404 {
		t.Fatalf("get after release = %d %v; want 404", st, r)
	}
	_, c3 := a.post("/v1/claim", map[string]any{"key": "job-3"})
	if st, r := a.post("/v1/abandon", map[string]any{"handle": c3["handle"]}); st != 200 || r["state"] != "abandoned" {
		t.Fatalf("abandon = %d %v", st, r)
	}
	if st, r := b.post("/v1/abandon", map[string]any{"handle": c3["handle"]}); st != 200 || r["state"] != "abandoned" {
		t.Fatalf("abandon again after a lost reply = %d %v; want 200 abandoned", st, r)
	}
	if st, r := b.post("/v1/claim", map[string]any{"key": "job-3"}); st != 201 || r["took_over"] != true {
		t.Fatalf("claim after abandon = %d %v; want a takeover", st, r)
	}
	if st, r := a.post("/v1/complete", map[string]any{"handle": c3["handle"], "outcome": map[string]any{}}); st != 409 {
		t.Fatalf("complete with the abandoned handle = %d %v; want 409", st, r)
	}
	if st, r := b.post("/v1/renew", map[string]any{"handle": c3["handle"], "extend_ms": 1000}); st != 409 {
		t.Fatalf("renew with the abandoned handle = %d %v; want 409", st, r)
	}

	// Bad requests.
	for name, body := range map[string]any{
		"unknown field":          map[string]any{"key": "k", "colour": "red"},
		"bad key":                map[string]any{"key": "a b"},
		"fingerprint and params": map[string]any{"key": "k", "params": 1, "fingerprint": strings.Repeat("a", 64)},
		"bad fingerprint":        map[string]any{"key": "k", "fingerprint": "xyz"},
		"duplicate JSON member":  map[string]any{"key": "k", "params": json.RawMessage(`{"a":1,"a":2}`)},
		"deadline too long":      map[string]any{"key": "k", "deadline_ms": 1e9},
		"not JSON":               "not json",
	} {
		if st, r := a.post("/v1/claim", body); st != 400 {
			t.Errorf("%s: %d %v; want 400", name, st, r)
		}
	}
	if st, r := a.post("/v1/complete", map[string]any{"handle": map[string]any{"key": "k"}}); st != 400 {
		t.Errorf("complete without an outcome = %d %v; want 400", st, r)
	}
	for _, want := range []string{"claim 201", "claim 200", "claim 409", "claim 422", "claim 400", "checkpoint 200",
		"renew 200", "renew 409", "complete 200", "complete 409", "release 200", "abandon 200", "get 200", "get 404"} {
		if !vc.seen[want] {
			t.Errorf("no exchange covered %q", want)
		}
	}
}
