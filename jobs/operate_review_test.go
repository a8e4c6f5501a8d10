package jobs

import (
	"context"
	"errors"
	"testing"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
)

// goneAfterGet is a queue's records whose job is deleted right after each
// Get returns it: the record an operator read expired and was swept (or
// evicted) before the operator's claim.
type goneAfterGet struct{ idem.Store }

func (g goneAfterGet) Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	rec, err := g.Store.Get(ctx, key)
	if err == nil {
		if _, err := g.Store.EvictIf(ctx, key, rec.Revision); err != nil {
			return nil, err
		}
	}
	return rec, err
}

// Regression (review): an operator's cancel or retry of a job whose record
// is gone by the time of its claim makes nothing. Its claim used to create
// a fresh record with no checkpoint, abandoned as not a job: a record in
// flight that held no job, which a schedule's next tick read as an error
// (ErrNotJob) for a whole retention instead of the job's absence.
func TestReviewOperatorMakesNoRecordOfAGoneJob(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	if _, err := q.Submit(ctx, "j1", "sync", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	real := q.recs
	q.recs = goneAfterGet{real}
	_, err := q.Cancel(ctx, "j1", "operator")
	q.recs = real
	if !errors.Is(err, etcdstore.ErrNotFound) {
		t.Errorf("cancel of a job gone since its read = %v; want an error wrapping etcdstore.ErrNotFound", err)
	}
	if rec, err := q.recs.Get(ctx, q.Key("j1")); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("after the cancel, the job's key holds %+v (%v); want no record", rec, err)
	}
}
