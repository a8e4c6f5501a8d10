package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
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
