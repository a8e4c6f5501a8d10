package jobs

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/storex"
)

// Promise (jobs/hub.go, HubDrainTimeout: "how long Close lets running
// steps go on before it gives their jobs back"; docs/JOBS.md "Several idem
// processes": a worker's report may reach another process, "that one
// relays it ... so a worker needs no affinity"). While its hub drains
// (idem serve's shutdown grace), a step's worker whose report reaches the
// other process must be answered as one whose report reaches the draining
// process directly is. Hub.Close stops following relayed reports first,
// so the relayed done waits unanswered and the worker is told task-gone:
// the finished step runs again.
func TestReview10ADrainingHubStillAnswersRelayedReports(t *testing.T) {
	prefix := testPrefix(t)
	qa, qb := newQueue(t, newStore(t, prefix)), newQueue(t, newStore(t, prefix))
	ctx := testCtx(t)
	if err := qa.Declare(ctx, Declaration{Name: "drain", TaskTimeout: "30s", Steps: []StepDeclaration{{Name: "a"}}}); err != nil {
		t.Fatal(err)
	}
	ha, err := NewHub(qa, HubDrainTimeout(40*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	hb, err := NewHub(qb)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hb.Close() })
	if _, err := qa.Submit(ctx, "d-1", "drain", nil); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, ha, "drain")
	closed := make(chan struct{})
	go func() { ha.Close(); close(closed) }()
	t.Cleanup(func() { <-closed })
	// Observe: the hub is closing (its step drains, its worker lives).
	for {
		ha.mu.Lock()
		c := ha.closed
		ha.mu.Unlock()
		if c {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the hub never started closing")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A report straight to the draining process is answered (control).
	if a, err := ha.Report(ctx, task.ID, Report{Op: "renew"}); err != nil || a.Result != "renewed" {
		t.Fatalf("a direct renew while draining: %+v, %v", a, err)
	}
	// The same worker's done, behind a load balancer, reaches the other.
	short, cancel := context.WithTimeout(ctx, 25*time.Second) // within the task timeout and the drain (5 s was short under CI's load)
	defer cancel()
	a, err := hb.Report(short, task.ID, Report{Seq: 1, Op: "done", Output: []byte(`"ok"`)})
	if err != nil || a.Result != "accepted" {
		t.Fatalf("a relayed done while its holder drains: %+v, %v (want accepted, as a direct one is)", a, err)
	}
}

// Promise (jobs/relay.go, answerRelayed; the review's "values left
// behind forever"): a relayed report leaves nothing in etcd once it is
// answered: its request is deleted by the holder, its answer once written
// (the relaying process follows the answer from before its request). Both
// a report on a task the holder does not hold and one on a task that ran.
// (Rewritten after the fix: answers were kept until the task was
// forgotten, and a task-gone answer for ever.)
func TestReview10RelayedAnswersOnUnknownTasksAreNotLeftForEver(t *testing.T) {
	prefix := testPrefix(t)
	sa := newStore(t, prefix)
	qa, qb := newQueue(t, sa), newQueue(t, newStore(t, prefix))
	ha := hubFor(t, qa, Declaration{Name: "short", TaskTimeout: "1s", Steps: []StepDeclaration{{Name: "a"}}})
	hb, err := NewHub(qb)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hb.Close() })
	ctx := testCtx(t)
	unknown := ha.id + "-00000000000000000000000000000000"
	if _, err := hb.Report(ctx, unknown, Report{Seq: 1, Op: "done"}); !errors.Is(err, ErrTaskGone) {
		t.Fatalf("a relayed report on a task its hub does not hold: %v, want ErrTaskGone", err)
	}
	if _, err := qa.Submit(ctx, "u-1", "short", nil); err != nil {
		t.Fatal(err)
	}
	ran := nextTask(t, ha, "short")
	report(t, hb, ran, Report{Seq: 1, Op: "done"})
	waitJob(t, qa, "u-1")
	left := func() []string {
		var names []string
		for _, p := range []string{ha.answerPrefix(ha.id), ha.requestPrefix(ha.id)} {
			vs, err := storex.Values(sa, ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range vs {
				names = append(names, v.Name)
			}
		}
		return names
	}
	for len(left()) > 0 { // the deletes follow the answers
		if ctx.Err() != nil {
			t.Fatalf("relayed reports left in etcd: %v", left())
		}
	}
}
