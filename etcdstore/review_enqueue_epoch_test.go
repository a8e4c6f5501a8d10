package etcdstore

import (
	"errors"
	"testing"
)

// BUG (kernel.Enqueue.Sent): an Enqueue with IfValue on a store WithEpochs
// whose Txn is refused because the shard's epoch moved (another process
// raised it: RaiseEpoch, a key moving here) ends with ErrValueChanged,
// though the value is still at the revision compared and the record is
// still absent. Enqueue.Sent learns the new epoch (guarded.learn) but then
// concludes "the record was as this round expected, so the compare that
// failed is the value's" without considering the epoch compare, which is
// in the same If.
//
// It contradicts IfValue's godoc ("When it moved, and the record does not
// exist, Enqueue writes nothing and returns an error wrapping
// ErrValueChanged": here it did not move) and RaiseEpoch's ("The claims of
// other processes that still believe in the older epoch fail their
// compare, read the new one, and try again"), and the decision table's
// R5 for a claim ("refused: the shard epoch is not the one compared: the
// epoch is learnt; the record read is judged again"). A scheduler (package
// jobs) takes ErrValueChanged to mean another scheduler moved its cursor.
func TestReviewEnqueueIfValueRefusedByEpochIsNotValueChanged(t *testing.T) {
	prefix := testPrefix(t)
	cli := client(t)
	ctx := testCtx(t)

	s := newStore(t, cli, prefix, withEpochs())
	v, ok, err := s.setValue(ctx, "cursor", []byte("c1"), 0)
	if err != nil || !ok {
		t.Fatalf("SetValue = %v, %v, %v", v, ok, err)
	}
	// Another process raises the shard's epoch; s still believes in the old one.
	other := newStore(t, cli, prefix, withEpochs())
	if e, err := other.raiseEpoch(ctx, 0); err != nil || e != 1 {
		t.Fatalf("RaiseEpoch = %d, %v", e, err)
	}
	if s.currentEpoch() != 0 {
		t.Fatalf("s already knows epoch %d", s.currentEpoch())
	}

	rec, err := s.Enqueue(ctx, Key{ID: "job"}, fpOf(t, "p"), []byte("data"), ifValue("cursor", v.Revision))
	if errors.Is(err, errValueChanged) {
		now, _, _ := other.setValue(ctx, "cursor", nil, -1) // reads it back (refused)
		t.Fatalf("Enqueue IfValue(cursor, %d) = %v; the value is still at revision %d (%v) and only the epoch moved "+
			"(s learnt epoch %d): it should try again under the new epoch", v.Revision, err, now.Revision, now, s.currentEpoch())
	}
	if err != nil {
		t.Fatalf("Enqueue: %v", err)
	}
	if rec.Epoch != 1 {
		t.Errorf("enqueued under epoch %d, want 1", rec.Epoch)
	}
}
