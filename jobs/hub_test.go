package jobs

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// hubFor declares kinds in q's tenant and returns a hub for them.
func hubFor(t *testing.T, q *Queue, ds ...Declaration) *Hub {
	t.Helper()
	for _, d := range ds {
		if err := q.Declare(testCtx(t), d); err != nil {
			t.Fatalf("Declare(%s): %v", d.Name, err)
		}
	}
	h, err := NewHub(q)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// nextTask long-polls h, as a remote worker does, until a task comes.
func nextTask(t *testing.T, h *Hub, kinds ...string) *Task {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	task, err := h.Next(ctx, kinds)
	if err != nil || task == nil {
		t.Fatalf("Next(%v) = %v, %v", kinds, task, err)
	}
	return task
}

func report(t *testing.T, h *Hub, task *Task, r Report) Answer {
	t.Helper()
	a, err := h.Report(testCtx(t), task.ID, r)
	if err != nil {
		t.Fatalf("Report(%s %s seq %d): %v", task.Step, r.Op, r.Seq, err)
	}
	return a
}

// orderKind: a worker step, a sleep idem runs, an await idem runs, and a
// worker step that sleeps and awaits within itself.
func orderKind() Declaration {
	return Declaration{Name: "order", TaskTimeout: "5s", Backoff: "100ms", Steps: []StepDeclaration{
		{Name: "charge"},
		{Name: "cool", Sleep: "300ms"},
		{Name: "approve", Await: "approved", Timeout: "1m", OnError: "fail"},
		{Name: "ship"},
	}}
}

func TestAHubRunsADeclaredKindThroughARemoteWorker(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	h := hubFor(t, q, orderKind())
	ctx := testCtx(t)
	if _, err := q.Submit(ctx, "o-1", "order", []byte(`{"amount":12}`)); err != nil {
		t.Fatal(err)
	}
	effects := map[string]int{}
	// charge
	task := nextTask(t, h, "order")
	if task.Step != "charge" || task.Job != "o-1" || string(task.Params) != `{"amount":12}` || task.Attempt != 1 || task.StepKey != "jobs:o-1.charge" {
		t.Fatalf("first task = %+v", task)
	}
	effects[task.StepKey]++
	if a := report(t, h, task, Report{Seq: 1, Op: "done", Output: []byte("ch_1")}); a.Result != "accepted" {
		t.Fatalf("done answered %+v", a)
	}
	// cool sleeps and approve waits in idem, with no worker: signal it.
	if err := q.Signal(ctx, "o-1", "approved", []byte(`{"by":"ana"}`)); err != nil {
		t.Fatal(err)
	}
	// ship: sleeps within the step, then resumes from its start.
	task = nextTask(t, h, "order")
	if task.Step != "ship" || string(task.Outputs["charge"]) != "ch_1" || string(task.Outputs["approve"]) != `{"by":"ana"}` {
		t.Fatalf("ship task = %+v, outputs %q", task, task.Outputs)
	}
	if a := report(t, h, task, Report{Seq: 1, Op: "sleep", For: 200 * time.Millisecond}); a.Result != "suspended" {
		t.Fatalf("a first sleep answered %+v, want suspended", a)
	}
	task = nextTask(t, h, "order")
	if task.Step != "ship" {
		t.Fatalf("after the sleep: %+v", task)
	}
	if a := report(t, h, task, Report{Seq: 1, Op: "sleep", For: 200 * time.Millisecond}); a.Result != "continue" {
		t.Fatalf("the same sleep, again after it ended, answered %+v, want continue", a)
	}
	effects[task.StepKey]++
	report(t, h, task, Report{Seq: 2, Op: "done", Output: []byte("shipped")})
	j := waitJob(t, q, "o-1")
	if j.State != Succeeded || string(j.Output("ship")) != "shipped" || string(j.Output("charge")) != "ch_1" {
		t.Fatalf("job ended %s, outputs %q %q", j.State, j.Output("charge"), j.Output("ship"))
	}
	for k, n := range effects {
		if n != 1 {
			t.Errorf("%s ran %d times", k, n)
		}
	}
}

// A report sent again after its reply was lost is answered as the first
// time and applied once: a repeated done does not finish the next step,
// a repeated await does not wait twice.
func TestAHubAnswersARepeatedReportAsBefore(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	h := hubFor(t, q, Declaration{Name: "two", TaskTimeout: "5s", Steps: []StepDeclaration{{Name: "a"}, {Name: "b"}}})
	ctx := testCtx(t)
	if _, err := q.Submit(ctx, "t-1", "two", nil); err != nil {
		t.Fatal(err)
	}
	if err := q.Signal(ctx, "t-1", "go", []byte(`1`)); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, h, "two")
	// Sent three times at once, and once more after: one answer.
	var wg sync.WaitGroup
	answers := make([]Answer, 3)
	for i := range answers {
		wg.Go(func() { answers[i] = report(t, h, task, Report{Seq: 1, Op: "await", Event: "go"}) })
	}
	wg.Wait()
	answers = append(answers, report(t, h, task, Report{Seq: 1, Op: "await", Event: "go"}))
	for _, a := range answers {
		if a.Result != "event" || string(a.Payload) != "1" {
			t.Fatalf("await answered %+v", a)
		}
	}
	if _, err := h.Report(ctx, task.ID, Report{Seq: 3, Op: "done"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a report that skips a number: %v, want ErrInvalid", err)
	}
	report(t, h, task, Report{Seq: 2, Op: "done", Output: []byte("A")})
	if a := report(t, h, task, Report{Seq: 2, Op: "done", Output: []byte("A")}); a.Result != "accepted" {
		t.Fatalf("a done sent again answered %+v", a)
	}
	next := nextTask(t, h, "two")
	if next.Step != "b" || string(next.Outputs["a"]) != "A" {
		t.Fatalf("after a's done (sent twice): %+v", next)
	}
	report(t, h, next, Report{Seq: 1, Op: "done", Output: []byte("B")})
	if j := waitJob(t, q, "t-1"); j.State != Succeeded || string(j.Output("b")) != "B" {
		t.Fatalf("job %s", j.State)
	}
	if _, err := h.Report(ctx, task.ID, Report{Seq: 3, Op: "done"}); !errors.Is(err, ErrTaskGone) {
		t.Fatalf("a new report on an ended task: %v, want ErrTaskGone", err)
	}
}

// A worker that dies in a step (silent past the task's timeout) ends its
// attempt as a crashed Go worker does: the step is handed again, in the
// next attempt, under a greater token; the dead worker's late report is
// refused.
func TestAHubResumesAStepWhoseWorkerWentSilent(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	// on_error fail: a worker's death is no failure of its step.
	h := hubFor(t, q, Declaration{Name: "one", TaskTimeout: "1s", MaxAttempts: 3, Steps: []StepDeclaration{{Name: "a", OnError: "fail"}}})
	if _, err := q.Submit(testCtx(t), "s-1", "one", nil); err != nil {
		t.Fatal(err)
	}
	dead := nextTask(t, h, "one") // and never heard of again
	again := nextTask(t, h, "one")
	if again.Step != "a" || again.Attempt != 2 || tokenOf(t, again) <= tokenOf(t, dead) {
		t.Fatalf("after a silent worker: %+v (first %+v)", again, dead)
	}
	if _, err := h.Report(testCtx(t), dead.ID, Report{Seq: 1, Op: "done"}); !errors.Is(err, ErrTaskGone) {
		t.Fatalf("the silent worker's late done: %v, want ErrTaskGone", err)
	}
	report(t, h, again, Report{Seq: 1, Op: "done"})
	if j := waitJob(t, q, "s-1"); j.State != Succeeded || j.Attempts != 2 {
		t.Fatalf("job %s after %d attempts", j.State, j.Attempts)
	}
}

func tokenOf(t *testing.T, task *Task) uint64 {
	n, err := strconv.ParseUint(task.Token, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A step's failure is the kind's to handle: retried after its backoff,
// then failed for on_error fail, with the worker's error saved.
func TestAHubAppliesTheKindsPolicyToAFailedStep(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	h := hubFor(t, q, Declaration{Name: "pay", TaskTimeout: "5s", Backoff: "50ms", Steps: []StepDeclaration{{Name: "try"}, {Name: "card", OnError: "fail"}}})
	if _, err := q.Submit(testCtx(t), "p-1", "pay", nil); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, h, "pay")
	report(t, h, task, Report{Seq: 1, Op: "fail", Error: "timeout talking to the bank"})
	task = nextTask(t, h, "pay")
	if task.Step != "try" || task.Attempt != 2 {
		t.Fatalf("after a retried failure: %+v", task)
	}
	report(t, h, task, Report{Seq: 1, Op: "done"})
	task = nextTask(t, h, "pay")
	report(t, h, task, Report{Seq: 1, Op: "fail", Error: "card refused"})
	j := waitJob(t, q, "p-1")
	if j.State != Failed || !strings.Contains(j.Err, "card refused") {
		t.Fatalf("job %s, error %q", j.State, j.Err)
	}
}

func TestADeclarationThatCannotRunIsRefusedNamingWhy(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	for _, c := range []struct{ json, want string }{
		{`{"name":"k","steps":[{"name":"a","on_error":"later"}]}`, `on_error "later"`},
		{`{"name":"k","steps":[{"name":"a","sleep":"1s","await":"e"}]}`, "both sleep and await"},
		{`{"name":"k","steps":[{"name":"a","sleep":"soon"}]}`, `sleep "soon"`},
		{`{"name":"k","steps":[{"name":"a","timeout":"1s"}]}`, "timeout without await"},
		{`{"name":"k","steps":[{"name":"a","colour":"red"}]}`, `unknown field "colour"`},
		{`{"name":"k","steps":[]}`, "no steps"},
		{`{"name":"k","steps":[{"name":"a"},{"name":"a"}]}`, "two steps named a"},
		{`{"name":"k","task_timeout":"10ms","steps":[{"name":"a"}]}`, "under a second"},
	} {
		if _, err := ParseDeclaration([]byte(c.json)); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseDeclaration(%s) = %v, want ErrInvalid naming %q", c.json, err, c.want)
		}
	}
	long := Declaration{Name: "k", Steps: []StepDeclaration{{Name: "a", Sleep: "9999h"}}}
	if err := q.Declare(testCtx(t), long); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a sleep past the retention declared: %v", err)
	}
	silent := Declaration{Name: "k", TaskTimeout: "9999h", Steps: []StepDeclaration{{Name: "a"}}}
	if err := q.Declare(testCtx(t), silent); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "task_timeout") {
		t.Fatalf("a task timeout past the retention declared: %v", err)
	}
	if ds, err := q.Declared(testCtx(t)); err != nil || len(ds) != 0 {
		t.Fatalf("after refusals, declared %v, %v", ds, err)
	}
	if _, err := NewHub(q); err != nil {
		t.Fatal(err)
	}
	h := hubFor(t, q)
	if _, err := h.Next(testCtx(t), []string{"nobody"}); !errors.Is(err, ErrUnknownKind) {
		t.Fatalf("Next for an undeclared kind: %v, want ErrUnknownKind", err)
	}
}

// A declared limit holds a second job of the same key back while the
// first runs, with a worker waiting for it: the limit, not the number of
// workers, decides.
func TestAHubAppliesADeclaredLimit(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	h := hubFor(t, q, Declaration{Name: "payout", TaskTimeout: "10s", Steps: []StepDeclaration{{Name: "pay"}},
		Limits: []LimitDeclaration{{Name: "merchant", Param: "merchant", Concurrency: 1}}})
	ctx := testCtx(t)
	for _, id := range []string{"p-1", "p-2"} {
		if _, err := q.Submit(ctx, id, "payout", []byte(`{"merchant":"acme"}`)); err != nil {
			t.Fatal(err)
		}
	}
	first := nextTask(t, h, "payout")
	other := map[string]string{"p-1": "p-2", "p-2": "p-1"}[first.Job]
	got := make(chan *Task, 1)
	go func() {
		task, _ := h.Next(ctx, []string{"payout"})
		got <- task
	}()
	for {
		j, err := q.Get(ctx, other)
		if err != nil {
			t.Fatal(err)
		}
		if j.Limited == "merchant=acme" || !strings.Contains(h.worker().Explain(other), `blocked=""`) {
			break // held back by the limit: tried, or known full from the slots
		}
		select {
		case task := <-got:
			t.Fatalf("a second job of the merchant was handed out while the first runs: %+v", task)
		case <-ctx.Done():
			t.Fatal("the second job was never tried while a worker waited for it")
		default:
		}
	}
	report(t, h, first, Report{Seq: 1, Op: "done"})
	task := <-got
	if task == nil || task.Job != other {
		t.Fatalf("after the first ended, the waiting worker got %+v, want %s", task, other)
	}
	report(t, h, task, Report{Seq: 1, Op: "done"})
	if _, err := ParseDeclaration([]byte(`{"name":"k","steps":[{"name":"a"}],"limits":[{"name":"m","concurrency":1}]}`)); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "names no param") {
		t.Fatalf("a limit without its param: %v", err)
	}
}

// Behind a load balancer a worker's report reaches another idem process
// than the one whose hub handed the task out: it is relayed there through
// etcd and answered as if it had come itself (numbered, a repeat answered
// once). A task of a hub that is gone is answered ErrTaskGone once the
// report's time is up, not held for ever.
func TestAReportThatReachesAnotherProcessIsRelayed(t *testing.T) {
	prefix := testPrefix(t)
	qa, qb := newQueue(t, newStore(t, prefix)), newQueue(t, newStore(t, prefix)) // two idem processes
	ha := hubFor(t, qa, Declaration{Name: "two", TaskTimeout: "5s", Steps: []StepDeclaration{{Name: "a"}, {Name: "b"}}})
	hb, err := NewHub(qb)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hb.Close() })
	ctx := testCtx(t)
	if _, err := qa.Submit(ctx, "r-1", "two", nil); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, ha, "two")
	if a := report(t, hb, task, Report{Seq: 1, Op: "sleep", For: 100 * time.Millisecond}); a.Result != "suspended" {
		t.Fatalf("a relayed sleep answered %+v", a)
	}
	for _, h := range []*Hub{hb, ha} { // sent again, through either process
		if a := report(t, h, task, Report{Seq: 1, Op: "sleep", For: 100 * time.Millisecond}); a.Result != "suspended" {
			t.Fatalf("the sleep sent again answered %+v", a)
		}
	}
	task = nextTask(t, ha, "two")
	report(t, hb, task, Report{Op: "renew"})
	if a := report(t, hb, task, Report{Seq: 1, Op: "sleep", For: 100 * time.Millisecond}); a.Result != "continue" {
		t.Fatalf("the sleep once over, relayed: %+v", a)
	}
	if _, err := hb.Report(ctx, task.ID, Report{Seq: 3, Op: "done"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a relayed report that skips a number: %v, want ErrInvalid", err)
	}
	report(t, hb, task, Report{Seq: 2, Op: "done", Output: []byte(`"A"`)})
	next := nextTask(t, ha, "two")
	if next.Step != "b" || string(next.Outputs["a"]) != `"A"` {
		t.Fatalf("after a's relayed done: %+v", next)
	}
	report(t, hb, next, Report{Seq: 1, Op: "done"})
	if j := waitJob(t, qa, "r-1"); j.State != Succeeded || j.Attempts != 1 {
		t.Fatalf("job %s after %d attempts", j.State, j.Attempts)
	}
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if _, err := hb.Report(short, "0123456789abcdef-gone", Report{Seq: 1, Op: "done"}); !errors.Is(err, ErrTaskGone) {
		t.Fatalf("a task of a hub that is gone: %v, want ErrTaskGone", err)
	}
}

// A worker that joins while the only attempt's worker runs its step gets
// another job at once: a busy worker's attempt needs no waiting one.
func TestAHubGivesAWorkerThatJoinsAnotherJob(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	h := hubFor(t, q, Declaration{Name: "one", TaskTimeout: "30s", Steps: []StepDeclaration{{Name: "a"}}})
	ctx := testCtx(t)
	for _, id := range []string{"j-1", "j-2"} {
		if _, err := q.Submit(ctx, id, "one", nil); err != nil {
			t.Fatal(err)
		}
	}
	first := nextTask(t, h, "one")
	second := nextTask(t, h, "one") // while first runs: within nextTask's minute, not after it
	if second.Job == first.Job {
		t.Fatalf("both workers got %s", first.Job)
	}
	report(t, h, first, Report{Seq: 1, Op: "done"})
	report(t, h, second, Report{Seq: 1, Op: "done"})
	for _, id := range []string{"j-1", "j-2"} {
		if j := waitJob(t, q, id); j.State != Succeeded || j.Attempts != 1 {
			t.Fatalf("%s: %s after %d attempts", id, j.State, j.Attempts)
		}
	}
}
