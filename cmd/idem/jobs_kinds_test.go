package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idem-dev/idem/etcdtest"
)

// idem jobs kinds: a file of declarations applied (again: nothing
// changes), listed, shown and removed; a bad file is refused with exit 2,
// naming what is wrong, before etcd is reached, and declares nothing.
func TestJobsKindsCommand(t *testing.T) {
	c, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ep := c.Endpoints()[0]
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("kinds.json", `[
  {"name": "order", "steps": [{"name": "charge"}, {"name": "cool", "sleep": "10s"}, {"name": "approve", "await": "approved", "timeout": "1h", "on_error": "fail"}, {"name": "ship"}],
   "task_timeout": "30s", "limits": [{"name": "customer", "param": "customer", "concurrency": 2}]},
  {"name": "refund", "steps": [{"name": "pay"}], "schedules": [{"name": "hourly-refunds", "cron": "@hourly"}]}
]`)
	idem := func(args ...string) (string, error) {
		return runCmd(t, append([]string{"jobs", "kinds", "--endpoints", ep}, args...)...)
	}
	for range 2 {
		out, err := idem("apply", good)
		if err != nil || !strings.Contains(out, "kind order declared (4 steps)") || !strings.Contains(out, "kind refund declared (1 steps)") {
			t.Fatalf("apply: %v\n%s", err, out)
		}
	}
	out, err := idem("ls")
	if err != nil || out != "order steps=charge,cool(sleep 10s),approve(await approved),ship\nrefund steps=pay schedules=hourly-refunds\n" {
		t.Fatalf("ls: %v\n%q", err, out)
	}
	if out, err := idem("-w", "json", "get", "order"); err != nil || !strings.Contains(out, `"task_timeout":"30s"`) || !strings.Contains(out, `"param":"customer"`) {
		t.Fatalf("get: %v\n%s", err, out)
	}
	for name, c := range map[string]struct{ body, want string }{
		"unknown.json":  {`{"name":"x","steps":[{"name":"a","colour":"red"}]}`, `unknown field "colour"`},
		"twice.json":    {`[{"name":"x","steps":[{"name":"a"}]},{"name":"x","steps":[{"name":"b"}]}]`, "kind x is declared twice"},
		"long.json":     {`{"name":"x","steps":[{"name":"a","sleep":"9000h"}]}`, "past half the store's retention"},
		"repeated.json": {`{"name":"x","name":"y","steps":[{"name":"a"}]}`, `repeats member "name"`},
		"empty.json":    {`[]`, "no kind declared"},
	} {
		// --endpoints names no etcd: a refusal must come before it is dialled.
		out, err := runCmd(t, "jobs", "kinds", "--endpoints", "http://127.0.0.1:1", "--command-timeout", "1s", "apply", write(name, c.body))
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(out, c.want) && !strings.Contains(err.Error(), c.want) {
			t.Errorf("apply %s: %v (want exit 2 naming %q)\n%s", name, err, c.want, out)
		}
	}
	if _, err := idem("get", "x"); err == nil {
		t.Fatal("a refused file declared a kind")
	}
	if _, err := idem("bogus"); !errors.As(err, new(usageError)) {
		t.Fatalf("an unknown verb: %v, want exit 2", err)
	}
	if out, err := idem("delete", "refund"); err != nil || !strings.Contains(out, "kind refund removed") {
		t.Fatalf("delete: %v\n%s", err, out)
	}
	if _, err := idem("delete", "refund"); err == nil || !strings.Contains(err.Error(), "not declared") {
		t.Fatalf("delete again: %v", err)
	}
}
