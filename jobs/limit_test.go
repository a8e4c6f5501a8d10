package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// A job whose last step commits ops, and whose end would no longer fit the
// record once it says "succeeded", must not be saved as a failure with its
// state gone (found by review: it was).
//
// JOBS.md ("What is guaranteed"): "A job keeps what it did. Every end of a
// job (succeeded, failed, compensated, cancelled, and a state too large to
// keep) is saved within the record's limit: what can be cut is cut ... The
// kind, the parameters and the finished steps are never cut. A step whose
// Run.Commit ops were committed is never run again for a size problem".
//
// What happened: the last step commits ops and returns no output; its
// checkpoint (the state with the step finished) fits the record. The end
// adds "outcome":"succeeded" (and fit adds nothing it can cut: no errors,
// no outputs), and no longer fits: fit says so (ok false), but the worker
// saves it anyway (committed), Complete refuses it as too large, and the
// store saves "the outcome could not be saved" in the job's place. The job
// reads as failed, with no kind, no parameters and no finished steps,
// although it succeeded and its effect was committed. Now such a step fails
// before its ops commit.
func TestSucceededJobNearTheLimitKeepsItsState(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	st := newStore(t, prefix, etcdstore.WithMaxRecordSize(4096))
	q := newQueue(t, st)
	k := Kind{Name: "commit", MaxAttempts: 3, Backoff: time.Millisecond, Steps: []Step{
		{Name: "last", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) {
			r.Commit(clientv3.OpPut("/effects"+prefix+r.Key().ID, "done"))
			return nil, nil
		}},
	}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	cli := cluster.MustClient(t)
	committed := 0
	for size := 2800; size < 3100; size++ {
		id := fmt.Sprintf("p-%d", size)
		params := []byte(`{"x":"` + strings.Repeat("x", size-8) + `"}`)
		if _, err := q.Submit(ctx, id, "commit", params); err != nil {
			continue // too large to submit at all
		}
		_, err := w.Run(ctx, id)
		j, jerr := q.Get(ctx, id)
		if jerr != nil {
			t.Fatalf("params of %d bytes: the job cannot be read after its run: %v (Run: %v)", size, jerr, err)
		}
		eff, gerr := cli.Get(ctx, "/effects"+prefix+id)
		if gerr != nil {
			t.Fatal(gerr)
		}
		if len(eff.Kvs) == 0 {
			continue // its checkpoint was refused: failed before any effect
		}
		committed++
		if j.State != Succeeded || j.Kind != "commit" || string(j.Params) != string(params) || len(j.Steps) != 1 || !j.Steps[0].Finished {
			state, kind, plen, steps, jerr := j.State, j.Kind, len(j.Params), len(j.Steps), j.Err
			t.Fatalf("params of %d bytes: the last step's effect was committed (version %d), and the job is %q, kind %q, %d bytes of params, %d steps, err %q (Run: %v); "+
				"want succeeded with its kind, params and finished step", size, eff.Kvs[0].Version, state, kind, plen, steps, jerr, err)
		}
	}
	if committed == 0 {
		t.Fatal("no size committed its effect: the test tests nothing")
	}
}

// Cancel of a job whose cancelled end cannot fit the record is refused
// (ErrTooLarge) and leaves the job as it was: saved anyway, the store would
// put "the outcome could not be saved" in its place, losing its kind and
// parameters.
func TestCancelNearTheLimitKeepsTheJob(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(4096)))
	refused, cancelled := 0, 0
	for size := 2900; size < 3100; size += 2 {
		id := fmt.Sprintf("c-%d", size)
		params := []byte(`{"x":"` + strings.Repeat("x", size-8) + `"}`)
		if _, err := q.Submit(ctx, id, "commit", params); err != nil {
			continue // too large to submit at all
		}
		_, err := q.Cancel(ctx, id, strings.Repeat("r", 200))
		j, jerr := q.Get(ctx, id)
		if jerr != nil {
			t.Fatalf("params of %d bytes: the job cannot be read after Cancel: %v (Cancel: %v)", size, jerr, err)
		}
		if j.Kind != "commit" || string(j.Params) != string(params) {
			t.Fatalf("params of %d bytes: after Cancel (%v) the job is %q, kind %q, %d bytes of params, err %q; want its kind and params kept", size, err, j.State, j.Kind, len(j.Params), j.Err)
		}
		switch {
		case err == nil && j.State == Cancelled:
			cancelled++
		case errors.Is(err, etcdstore.ErrTooLarge) && j.State == Queued:
			refused++
		default:
			t.Fatalf("params of %d bytes: Cancel = %v, job %q; want cancelled, or ErrTooLarge and still queued", size, err, j.State)
		}
	}
	if refused == 0 || cancelled == 0 {
		t.Fatalf("%d cancelled, %d refused: the sizes tried do not reach the limit from both sides", cancelled, refused)
	}
}

// Found by review, now fixed: a refused Cancel counted an attempt.
// A refused Cancel must leave the job as it was.
//
// JOBS.md ("What is guaranteed"): "`Cancel` of a job whose cancelled end
// cannot fit is refused with `ErrTooLarge`, and the job is left as it
// was." (and Queue.Cancel's doc: "an error wrapping etcdstore.ErrTooLarge,
// and the job is left as it was").
//
// What happened: Cancel goes through operate, which takes the queued
// (abandoned) record over with Store.Run: that takeover raises the
// record's takeover count, which is how a job counts its attempts
// (Job.Attempts = Takeovers - Base; worker: n := c.Takeovers() - st.Base).
// When the cancelled end does not fit, the op returns EndAbandon and the
// state is checkpointed unchanged, but, unlike Retry's refusal
// (st.Base++ "this takeover was no attempt") and the worker's giveBack,
// Cancel does not raise Base. So a refused Cancel counts an attempt the job
// never had: Attempts goes from 0 to 1, and on with every refused Cancel
// (an operator retrying it), each one spent from the job's MaxAttempts
// (the worker parks a job whose n exceeds it, "a previous attempt ended
// without saying why").
func TestRefusedCancelLeavesTheJobAsItWas(t *testing.T) {
	ctx := testCtx(t)
	st := newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(4096))
	q := newQueue(t, st)

	// Find a size whose Cancel is refused for its size (as in
	// TestCancelNearTheLimitKeepsTheJob).
	var id string
	var before *Job
	for size := 2900; size < 3100 && id == ""; size += 2 {
		cand := fmt.Sprintf("c-%d", size)
		params := []byte(`{"x":"` + strings.Repeat("x", size-8) + `"}`)
		if _, err := q.Submit(ctx, cand, "once", params); err != nil {
			continue
		}
		b, err := q.Get(ctx, cand)
		if err != nil {
			t.Fatal(err)
		}
		_, err = q.Cancel(ctx, cand, strings.Repeat("r", 200))
		if errors.Is(err, etcdstore.ErrTooLarge) {
			id, before = cand, b
		}
	}
	if id == "" {
		t.Fatal("no size had its Cancel refused: the test tests nothing")
	}
	after, err := q.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if after.State != before.State || after.Attempts != before.Attempts {
		t.Errorf("Cancel refused with ErrTooLarge; the job was %s with %d attempts, and is now %s with %d attempts: want it left as it was",
			before.State, before.Attempts, after.State, after.Attempts)
	}
	// Each further refused Cancel counts one more.
	for range 3 {
		if _, err := q.Cancel(ctx, id, strings.Repeat("r", 200)); !errors.Is(err, etcdstore.ErrTooLarge) {
			t.Fatalf("Cancel again: %v; want ErrTooLarge", err)
		}
	}
	if again, err := q.Get(ctx, id); err != nil || again.Attempts != before.Attempts {
		t.Errorf("after 4 refused Cancels the job counts %d attempts (read: %v), none run; want %d", again.Attempts, err, before.Attempts)
	}
}

// Found by review, now fixed: a resumed job ran its committed last step
// again. A last step whose Run.Commit ops were committed must never run
// again.
//
// JOBS.md ("What is guaranteed"): "A step whose `Run.Commit` ops were
// committed is never run again for a size problem" and "The kind, the
// parameters and the finished steps are never cut."; Kind.Steps: "A step
// that finished (its checkpoint landed) is never run again for the job,
// whoever resumes it".
//
// What happened: attempt 1 runs the last step, which commits ops and
// returns an output. Its end would fit (fits: the outputs can be cut), so
// its checkpoint (the state with the step finished, output included, just
// under the limit) lands with the ops. The worker dies before its Complete
// (crash, or its session ends while etcd does not answer; simulated here
// by making exactly that claim and checkpoint with the store's API, then
// ending the session, as a crash would). Attempt 2 takes the job over:
// every step is finished, so it runs none, and lastOps is 0, so
// committed = false, and fit(st, "", max, false) is asked not to cut the
// outputs: the state plus `"outcome":"succeeded"` does not fit, and the
// worker treats it as "the last step's output outgrew the record": it
// removed the committed step from Done and failed it (policy Retry: saved,
// and retried). Attempts 3, 4 and 5 run the finished step again (any effect
// it has outside etcd happens again; its ops are committed again whenever
// the new checkpoint fits, here they are refused for the errors the state
// has gathered), and the job ends parked with its committed step forgotten.
func TestResumedJobNeverRunsACommittedLastStepAgain(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	const limit = 4096
	cli := cluster.MustClient(t)
	effect := "/effects" + prefix + "j"
	var runs atomic.Int32
	out := []byte{}
	k := Kind{Name: "commit", MaxAttempts: 5, Backoff: time.Millisecond, MaxBackoff: time.Millisecond, Steps: []Step{
		{Name: "last", OnError: Retry, Run: func(ctx context.Context, r *Run) ([]byte, error) {
			runs.Add(1)
			r.Commit(clientv3.OpPut(effect, "charged"))
			return out, nil
		}},
	}}

	// Attempt 1, in a process that then dies.
	stA := newStore(t, prefix, etcdstore.WithMaxRecordSize(limit))
	qA := newQueue(t, stA)
	if _, err := qA.Submit(ctx, "j", "commit", []byte(`{"amount":100}`)); err != nil {
		t.Fatal(err)
	}
	rec, err := stA.Get(ctx, qA.Key("j"))
	if err != nil {
		t.Fatal(err)
	}
	c, _, err := stA.Claim(ctx, qA.Key("j"), rec.Fingerprint)
	if err != nil || c == nil {
		t.Fatalf("claim: %v", err)
	}
	st, err := decodeState(c.LastCheckpoint())
	if err != nil {
		t.Fatal(err)
	}
	st.Steps = []string{"last"}
	// An output that makes the checkpoint just fit, and the succeeded end
	// (uncut) not.
	for n := 0; ; n++ {
		o := []byte(strings.Repeat("o", n))
		s := *st
		s.Done = []doneStep{{Name: "last", Token: int64(c.Token()), At: time.Now().UnixMilli(), Output: o}}
		size := len(s.encode())
		end := s
		end.Outcome = Succeeded
		if size <= limit && len(end.encode()) > limit {
			out = o
			*st = s
			break
		}
		if size > limit {
			t.Fatal("no output size makes the checkpoint fit and the uncut end not")
		}
	}
	// What the worker checks before it commits the last step's ops: the
	// end fits (its outputs may be cut).
	end := st.clone()
	end.Outcome = Succeeded
	if _, ok := fits(end, "", limit); !ok {
		t.Fatal("the worker would refuse this step before committing: the test tests nothing")
	}
	runs.Add(1) // attempt 1 ran the step
	if err := c.Checkpoint(ctx, st.encode(), clientv3.OpPut(effect, "charged")); err != nil {
		t.Fatalf("attempt 1's checkpoint: %v", err)
	}
	endSession(t, stA) // the worker dies before its Complete

	// Another worker resumes the job.
	stB := newStore(t, prefix, etcdstore.WithMaxRecordSize(limit))
	qB := newQueue(t, stB)
	w := newWorker(t, qB, []Kind{k}, Concurrency(0))
	deadline := time.Now().Add(30 * time.Second)
	var j *Job
	for time.Now().Before(deadline) {
		j, err = w.Run(ctx, "j")
		if err != nil && !errors.Is(err, etcdstore.ErrConflict) {
			t.Fatalf("Run: %v", err)
		}
		if j != nil && (j.State.Final() || j.State == Parked) {
			break
		}
		// (Not yet: a retry waits out its 1 ms backoff.)
	}
	eff, err := cli.Get(ctx, effect)
	if err != nil || len(eff.Kvs) == 0 {
		t.Fatalf("effect: %v %v", eff, err)
	}
	if runs.Load() != 1 || eff.Kvs[0].Version != 1 {
		var state State
		var jerr string
		if j != nil {
			state, jerr = j.State, j.Err
		}
		t.Errorf("the last step committed its ops in attempt 1; it then ran %d times in all and committed its ops %d times (job %q, err %q); want once",
			runs.Load(), eff.Kvs[0].Version, state, jerr)
	}
	if j == nil || j.State != Succeeded {
		var finished []string
		var state State
		if j != nil {
			state = j.State
			for _, s := range j.Steps {
				finished = append(finished, fmt.Sprintf("%s finished=%v", s.Name, s.Finished))
			}
		}
		t.Errorf("job %q (steps %v); want succeeded with its last step finished", state, finished)
	}
}

// Found by review, now fixed: a succeeded end that fit once an earlier
// output was cut failed its last step. Such a job must succeed.
//
// JOBS.md ("What is guaranteed"): "Every end of a job (succeeded, failed,
// compensated, cancelled, and a state too large to keep) is saved within the
// record's limit: what can be cut is cut, in this order ... then (at the end
// only) the steps' outputs, oldest first." Only "a last step without ops
// whose output alone outgrows the record fails, as any step whose checkpoint
// is refused for its size".
//
// What happened: step "first" returns a large output, its checkpoint
// lands (the state fits). Step "last" commits no ops and returns nothing:
// the state with both steps finished still fits the record (a checkpoint of
// it would be accepted), but adding `"outcome":"succeeded"` pushes it a few
// bytes over. The worker calls fit(st, "", max, committed) with committed =
// lastOps > 0 = false, so the outputs are not cut, fit says no, and the
// worker fails the last step as if its own output had outgrown the record
// ("its checkpoint was refused"), although cutting first's output (which
// the end is allowed to do) makes the end fit: a state that fits refused.
func TestSucceededEndCutsEarlierOutputs(t *testing.T) {
	ctx := testCtx(t)
	const limit = 4096
	st := newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(limit))
	q := newQueue(t, st)
	out := []byte{}
	k := Kind{Name: "two", MaxAttempts: 3, Backoff: time.Millisecond, MaxBackoff: time.Millisecond, Steps: []Step{
		{Name: "first", Run: func(ctx context.Context, r *Run) ([]byte, error) { return out, nil }},
		{Name: "last", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }},
	}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "j", "two", []byte(`{"amount":100}`)); err != nil {
		t.Fatal(err)
	}
	rec, err := st.Get(ctx, q.Key("j"))
	if err != nil {
		t.Fatal(err)
	}
	s0, err := decodeState(rec.Checkpoint)
	if err != nil {
		t.Fatal(err)
	}
	// An output that leaves the finished state within the limit and its
	// uncut succeeded end a little over it (tokens written with 6 digits,
	// times in ms as the real ones).
	now := time.Now().UnixMilli()
	for n := 0; ; n++ {
		o := []byte(strings.Repeat("o", n))
		s := *s0
		s.Steps = []string{"first", "last"}
		s.Done = []doneStep{{Name: "first", Token: 999999, At: now, Output: o}, {Name: "last", Token: 999999, At: now}}
		// Aim at 6 to 12 bytes under the limit: real tokens may have
		// fewer digits than 999999; the outcome field adds 22 bytes.
		size := len(s.encode())
		if size >= limit-12 && size <= limit-6 {
			out = o
			break
		}
		if size > limit {
			t.Fatal("no output size fits")
		}
	}
	j, err := w.Run(ctx, "j")
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if j.State != Succeeded {
		t.Errorf("a job whose finished state fits the record, and whose succeeded end fits once first's output is cut, ended %s: %q; want succeeded (truncated %v)",
			j.State, j.Err, j.Truncated)
	}
}
