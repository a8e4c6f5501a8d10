package jobs

import (
	"context"
	"errors"
	"testing"
	"time"
)

// Promise (jobs/declare.go, Queue.Declare's doc): "hubs run the new one
// from their next look (jobs already running finish their attempt under
// the old)". Declaring another kind in the tenant must not end a step a
// live worker is running (and renewing): the hub starts a new Worker and
// closes the old one, whose drain timeout then cuts the running step,
// whose task becomes gone (docs/JOBS.md: a task-gone worker stops the
// step, which runs again).
func TestReview9DeclaringAnotherKindDoesNotEndARunningStep(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	ctx := testCtx(t)
	if err := q.Declare(ctx, Declaration{Name: "slow", TaskTimeout: "5s", Steps: []StepDeclaration{{Name: "a"}}}); err != nil {
		t.Fatal(err)
	}
	h, err := NewHub(q, HubDrainTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	if _, err := q.Submit(ctx, "s-1", "slow", nil); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, h, "slow")
	// Another team declares another kind; a worker of it asks (the hub
	// looks at the declarations again).
	if err := q.Declare(ctx, Declaration{Name: "other", Steps: []StepDeclaration{{Name: "x"}}}); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	if _, err := h.Next(short, []string{"other"}); err != nil {
		t.Fatal(err)
	}
	cancel()
	// The slow step's worker is alive: it renews well within its timeout.
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		if _, err := h.Report(ctx, task.ID, Report{Op: "renew"}); err != nil {
			t.Fatalf("a live worker's renewal, after another kind was declared: %v (its running step was cut)", err)
		}
		time.Sleep(100 * time.Millisecond) // a worker's renewal period, not synchronisation
	}
	if a, err := h.Report(ctx, task.ID, Report{Seq: 1, Op: "done"}); err != nil || a.Result != "accepted" {
		t.Fatalf("done: %+v, %v", a, err)
	}
	if j := waitJob(t, q, "s-1"); j.State != Succeeded || j.Attempts != 1 {
		t.Fatalf("job %s after %d attempts", j.State, j.Attempts)
	}
}

// Promise (docs/JOBS.md "The protocol": "idem claims a job only while a
// worker of its kind waits"; Hub's doc: "the job's attempt keeps that
// worker's place until it ends"). One worker that waits for two kinds is
// one worker: it must not get a job of each claimed for it at once, the
// second held claimed, with no worker waiting, for the task timeout.
func TestReview9OneWorkerOfTwoKindsIsNotCountedTwice(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	ctx := testCtx(t)
	h := hubFor(t, q,
		Declaration{Name: "ka", TaskTimeout: "5s", Steps: []StepDeclaration{{Name: "a"}}},
		Declaration{Name: "kb", TaskTimeout: "5s", Steps: []StepDeclaration{{Name: "b"}}})
	if _, err := q.Submit(ctx, "a-1", "ka", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Submit(ctx, "b-1", "kb", nil); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, h, "ka", "kb")
	other := map[string]string{"a-1": "b-1", "b-1": "a-1"}[task.Job]
	// The one worker runs its step (renewing); nobody else waits.
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		j, err := q.Get(ctx, other)
		if err != nil {
			t.Fatal(err)
		}
		if j.State == Running {
			t.Fatalf("job %s was claimed (attempt %d) while its only worker runs %s's step and no worker waits", other, j.Attempts, task.Job)
		}
		if _, err := h.Report(ctx, task.ID, Report{Op: "renew"}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // a worker's renewal period
	}
}

// Promise (docs/JOBS.md table: await "waits for an event of the job";
// the HTTP layer checks a report's input and answers 400 for a bad one).
// An await report naming an event that can never be signalled (not a
// valid event name) is bad input: it must be refused (ErrInvalid), not
// accepted and turned into a failure of the step, which with on_error
// "fail" fails the job.
func TestReview9ABadAwaitReportDoesNotFailTheJob(t *testing.T) {
	q := newQueue(t, newStore(t, testPrefix(t)))
	ctx := testCtx(t)
	h := hubFor(t, q, Declaration{Name: "w", TaskTimeout: "5s", Steps: []StepDeclaration{{Name: "a", OnError: "fail"}}})
	if _, err := q.Submit(ctx, "w-1", "w", nil); err != nil {
		t.Fatal(err)
	}
	task := nextTask(t, h, "w")
	a, err := h.Report(ctx, task.ID, Report{Seq: 1, Op: "await", Event: "not a name!"})
	if !errors.Is(err, ErrInvalid) {
		t.Errorf("an await of an invalid event name: %+v, %v; want ErrInvalid", a, err)
	}
	// What the accepted report did to the job (bounded: a refused report
	// leaves it running, and this wait ends with ctx).
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if j, err := q.Wait(short, "w-1"); err == nil && j.State == Failed {
		t.Fatalf("a malformed await report failed the job: %s", j.Err)
	}
}
