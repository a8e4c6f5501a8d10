package kernel

import (
	"slices"
	"testing"
	"time"
)

// BUG: Reap (and ReapFenced) assume a lost claim write can only have
// compared an in-flight record it saw ("rec.State == InFlight &&
// rec.Revision <= seen" is fenced; a Moved record falls through to
// ReapDone, decision table row P3: "written after seen by another, or
// done, or Moved, and retained ...: nothing: no lost write can land while
// it is there"). But a claim with OverMoved (etcdstore.ReplaceMoved, the
// route package shard takes to a key's home) judges a Moved record stale
// and writes over it with If ModRevision(rec) == that Moved record's
// revision. When that write's reply is lost, the Moved record the reaper
// finds is exactly the state the lost write compared: the write can land
// while it is there, leaving an in-flight record under the live session
// that nobody runs (what the reaper exists to prevent). The reaper must
// not answer ReapDone for it. (End-to-end on etcd:
// etcdstore.TestReviewReaperIgnoresLostReplaceMovedWrite.)
func TestReviewReapFencesMovedRecordALostReplaceMovedWriteCompared(t *testing.T) {
	moved := &Record{State: Moved, MovedTo: "b", Revision: tRev, Token: tRev, Created: tNow.Add(-time.Minute),
		Expires: tNow.Add(tRet)}
	m := NewClaim(Config{Keys: tKeys, Retention: tRet},
		ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt, OverMoved: true})
	v := View{Now: tNow}
	if a := m.Next(v); a.Kind != ActSend {
		t.Fatalf("want the create, got %v", a.Kind)
	}
	m.Sent(Reply{Delivery: Refused, Rev: tRead, Cur: moved})
	a := m.Next(v)
	if a.Kind != ActSend {
		t.Fatalf("want the write over the Moved record, got %v", a.Kind)
	}
	if !slices.ContainsFunc(a.Txn.If, func(c Cmp) bool { return c.String() == Modified(tKey, moved.Revision).String() }) {
		t.Fatalf("the write %v does not compare the Moved record's revision", a.Txn)
	}
	lost := a.Txn
	for m.Next(v).Kind == ActSend { // every try's reply is lost
		m.Sent(Reply{Delivery: Failed, MayHaveLanded: true, Retry: true, Err: errLostTest})
	}
	unc, seen := m.Uncertain()
	if !unc || m.Answer().Verdict != Error {
		t.Fatalf("claim = %v, uncertain %v; want an uncertain error", m.Answer().Verdict, unc)
	}
	until := tNow.Add(time.Minute)
	if got := Reap(moved, tMe, tAtt, seen, tNow.Add(time.Second), until); got == ReapDone {
		t.Errorf("Reap(the Moved record the lost write %v compared, seen %d) = ReapDone; "+
			"the lost write can still land on it, until %v", lost, seen, until)
	}
}
