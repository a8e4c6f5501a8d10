package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"
)

// do sends method path with body (nil: none) and decodes a JSON answer
// (an empty one is nil).
func (c *apiClient) do(method, path string, body any) (int, map[string]any) {
	c.t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, c.base+path, rd)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var m map[string]any
	if len(b) > 0 {
		if err := json.Unmarshal(b, &m); err != nil {
			c.t.Fatalf("%s %s: %d, body not JSON: %s", method, path, resp.StatusCode, b)
		}
	}
	return resp.StatusCode, m
}

// newWorkAPI serves the worker API with jobs and hubs on a fresh store.
func newWorkAPI(t *testing.T) (*apiClient, *validatingClient) {
	t.Helper()
	c, vc, _ := newJobsAPI(t)
	return c, vc
}

// A worker in any language through the job-worker protocol: a kind
// declared over the API, a job submitted, each step taken by long-poll
// and reported on, a sleep and an await within a step, a retried report,
// every exchange validated against the OpenAPI document over a real
// socket.
func TestWorkProtocolConformsToOpenAPI(t *testing.T) {
	c, vc := newWorkAPI(t)
	decl := map[string]any{"steps": []any{
		map[string]any{"name": "charge"},
		map[string]any{"name": "wait", "await": "approved", "timeout": "1m", "on_error": "fail"},
		map[string]any{"name": "ship"},
	}, "task_timeout": "10s"}
	if st, r := c.do("PUT", "/v1/kinds/order", decl); st != 200 || r["name"] != "order" {
		t.Fatalf("declare = %d %v", st, r)
	}
	if st, r := c.do("PUT", "/v1/kinds/order", decl); st != 200 {
		t.Fatalf("declare again = %d %v", st, r)
	}
	bad := map[string]any{"steps": []any{map[string]any{"name": "a", "on_error": "later"}}}
	if st, r := c.do("PUT", "/v1/kinds/bad", bad); st != 400 || r["type"] != "urn:idem:problem:invalid-request" {
		t.Fatalf("a bad declaration = %d %v; want 400", st, r)
	}
	if st, r := c.do("GET", "/v1/kinds/bad", nil); st != 404 || r["type"] != "urn:idem:problem:unknown-kind" {
		t.Fatalf("a refused declaration was stored: %d %v", st, r)
	}
	nightly := map[string]any{"steps": []any{map[string]any{"name": "a"}},
		"limits":    []any{map[string]any{"name": "m", "param": "merchant", "concurrency": 1}},
		"schedules": []any{map[string]any{"name": "nightly", "cron": "0 3 * * *", "location": "Europe/Paris", "params": map[string]any{"x": 1}, "overlap": "skip"}}}
	if st, r := c.do("PUT", "/v1/kinds/nightly", nightly); st != 200 {
		t.Fatalf("declare a kind with limits and a schedule = %d %v", st, r)
	}
	if st, r := c.do("DELETE", "/v1/kinds/nightly", nil); st != 204 {
		t.Fatalf("delete = %d %v", st, r)
	}
	if st, r := c.do("GET", "/v1/kinds", nil); st != 200 || len(r["kinds"].([]any)) != 1 {
		t.Fatalf("list kinds = %d %v", st, r)
	}
	if st, r := c.do("GET", "/v1/kinds/order", nil); st != 200 || len(r["steps"].([]any)) != 3 {
		t.Fatalf("get kind = %d %v", st, r)
	}
	if st, r := c.do("POST", "/v1/work/next", map[string]any{"kinds": []string{"order"}, "wait_ms": 50}); st != 204 {
		t.Fatalf("next with nothing due = %d %v; want 204", st, r)
	}
	if st, r := c.do("POST", "/v1/work/next", map[string]any{"kinds": []string{"nobody"}, "wait_ms": 50}); st != 404 || r["type"] != "urn:idem:problem:unknown-kind" {
		t.Fatalf("next for an undeclared kind = %d %v; want 404 unknown-kind", st, r)
	}
	if st, r := c.post("/v1/jobs", map[string]any{"id": "o-1", "kind": "order", "params": map[string]any{"amount": 5}}); st != 201 {
		t.Fatalf("submit = %d %v", st, r)
	}
	next := func() map[string]any {
		t.Helper()
		st, r := c.do("POST", "/v1/work/next", map[string]any{"kinds": []string{"order"}, "wait_ms": 30000})
		if st != 200 {
			t.Fatalf("next = %d %v", st, r)
		}
		return r
	}
	report := func(task map[string]any, op string, body map[string]any) (int, map[string]any) {
		t.Helper()
		return c.do("POST", "/v1/work/tasks/"+task["task"].(string)+"/"+op, body)
	}
	task := next()
	if task["step"] != "charge" || task["job"] != "o-1" || fmt.Sprint(task["params"]) != "map[amount:5]" || task["step_key"] != "jobs:o-1.charge" {
		t.Fatalf("first task = %v", task)
	}
	if st, r := report(task, "renew", map[string]any{}); st != 200 || r["result"] != "renewed" {
		t.Fatalf("renew = %d %v", st, r)
	}
	if st, r := report(task, "sleep", map[string]any{"seq": 1, "duration_ms": 100}); st != 200 || r["result"] != "suspended" {
		t.Fatalf("sleep = %d %v", st, r)
	}
	if st, r := report(task, "sleep", map[string]any{"seq": 1, "duration_ms": 100}); st != 200 || r["result"] != "suspended" {
		t.Fatalf("the same sleep sent again = %d %v; want the same answer", st, r)
	}
	if st, r := report(task, "done", map[string]any{"seq": 2}); st != 410 || r["type"] != "urn:idem:problem:task-gone" {
		t.Fatalf("a report on a suspended step = %d %v; want 410 task-gone", st, r)
	}
	task = next() // the step again, from its start, once the sleep is over
	if st, r := report(task, "sleep", map[string]any{"seq": 1, "duration_ms": 100}); st != 200 || r["result"] != "continue" {
		t.Fatalf("the sleep once over = %d %v", st, r)
	}
	if st, r := report(task, "fail", map[string]any{"seq": 2}); st != 400 {
		t.Fatalf("a failure without its error = %d %v; want 400", st, r)
	}
	if st, r := report(task, "done", map[string]any{"seq": 2, "output": map[string]any{"charge": "ch_1"}}); st != 200 || r["result"] != "accepted" {
		t.Fatalf("done = %d %v", st, r)
	}
	if st, r := c.post("/v1/jobs/o-1/signals/approved", map[string]any{"payload": map[string]any{"by": "ana"}}); st != 202 {
		t.Fatalf("signal = %d %v", st, r)
	}
	task = next()
	outs, _ := task["outputs"].(map[string]any)
	if task["step"] != "ship" || fmt.Sprint(outs["charge"]) != "map[charge:ch_1]" || fmt.Sprint(outs["wait"]) != "map[by:ana]" {
		t.Fatalf("ship task = %v", task)
	}
	if st, r := report(task, "await", map[string]any{"seq": 1, "event": "approved"}); st != 200 || r["result"] != "event" || fmt.Sprint(r["payload"]) != "map[by:ana]" {
		t.Fatalf("await within a step = %d %v", st, r)
	}
	if st, r := report(task, "done", map[string]any{"seq": 2, "output_base64": "AAE="}); st != 200 {
		t.Fatalf("done = %d %v", st, r)
	}
	st, j := c.get("/v1/jobs/o-1")
	for st == 200 && j["state"] != "succeeded" {
		// The job's end is written after the last step's report.
		st, j = c.do("GET", "/v1/jobs/o-1", nil)
	}
	steps := j["steps"].([]any)
	if st != 200 || len(steps) != 3 || steps[2].(map[string]any)["output_base64"] != "AAE=" {
		t.Fatalf("job = %d %v", st, j)
	}
	if st, _ := c.do("DELETE", "/v1/kinds/order", nil); st != 204 {
		t.Fatalf("delete kind = %d", st)
	}
	if st, _ := c.do("DELETE", "/v1/kinds/order", nil); st != 404 {
		t.Fatalf("delete kind again = %d; want 404", st)
	}
	for _, want := range []string{"putKind 200", "putKind 400", "getKind 200", "getKind 404", "listKinds 200", "deleteKind 204", "deleteKind 404",
		"nextTask 200", "nextTask 204", "nextTask 404", "reportTask 200", "reportTask 400", "reportTask 410"} {
		if !vc.seen[want] {
			t.Errorf("no exchange covered %q", want)
		}
	}
}
