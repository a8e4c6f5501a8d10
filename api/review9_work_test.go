package api

import (
	"testing"
	"time"
)

// Promise (api/openapi.yaml, POST /v1/work/next, wait_ms: "How long to
// wait for a step (default and cap: the server's --max-wait)"). A worker
// that leaves wait_ms out long-polls for the server's --max-wait (60 s
// here): a job submitted a moment after it asked is handed to it, not
// answered at once with nothing.
func TestReview9NextWithoutWaitMSWaitsTheMaxWait(t *testing.T) {
	c, _ := newWorkAPI(t)
	decl := map[string]any{"steps": []any{map[string]any{"name": "a"}}, "task_timeout": "10s"}
	if st, r := c.do("PUT", "/v1/kinds/k", decl); st != 200 {
		t.Fatalf("declare = %d %v", st, r)
	}
	type res struct {
		st int
		r  map[string]any
		in time.Duration
	}
	got := make(chan res, 1)
	go func() {
		start := time.Now()
		st, r := c.do("POST", "/v1/work/next", map[string]any{"kinds": []string{"k"}})
		got <- res{st, r, time.Since(start)}
	}()
	select {
	case g := <-got:
		t.Fatalf("next without wait_ms answered %d %v after %v, before any job: it did not wait", g.st, g.r, g.in)
	case <-time.After(500 * time.Millisecond):
	}
	if st, r := c.post("/v1/jobs", map[string]any{"id": "j-1", "kind": "k"}); st != 201 {
		t.Fatalf("submit = %d %v", st, r)
	}
	if g := <-got; g.st != 200 || g.r["job"] != "j-1" {
		t.Fatalf("next without wait_ms = %d %v", g.st, g.r)
	}
}
