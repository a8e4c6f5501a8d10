package kernel

import (
	"testing"
	"time"
)

// A claim that reads the record before it writes (WithoutCreate: a key's
// old shard), or after a wait, has seen etcd at that read's revision: a
// reaper of its lost takeover must not take the record it read for one
// written since (the model checker found the orphan this left).
func TestClaimReadCountsAsSeen(t *testing.T) {
	rec := &Record{State: InFlight, Fingerprint: tFP, Owner: tOther, Attempt: tAtt2, Token: tRev, Revision: tRev,
		Expires: tNow.Add(time.Hour)}
	for _, wait := range []bool{false, true} {
		m := NewClaim(Config{Keys: tKeys, Retention: tRet}, ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt, Existing: !wait, Wait: wait})
		v := View{Now: tNow}
		if wait {
			m.Next(v)
			m.Sent(Reply{Delivery: Refused, Rev: tRev, Cur: rec})
			if a := m.Next(v); a.Kind != ActOwner {
				t.Fatalf("want an owner read, got %v", a.Kind)
			}
			m.Owner(true, tRev, nil)
			m.Next(v) // the wait
			m.Awaited(rec, tRead)
		} else {
			if a := m.Next(v); a.Kind != ActRead {
				t.Fatalf("want a read first, got %v", a.Kind)
			}
			m.Read(rec, tRead)
		}
		if a := m.Next(v); a.Kind == ActOwner {
			m.Owner(false, tRead, nil)
		}
		if a := m.Next(v); a.Kind != ActSend {
			t.Fatalf("want the takeover, got %v", a.Kind)
		}
		m.Sent(Reply{Delivery: Failed, MayHaveLanded: true, Err: errLostTest})
		if unc, seen := m.Uncertain(); !unc || seen < tRead {
			t.Errorf("wait %v: Uncertain() = %v, %d; want true, at least %d (the read's revision)", wait, unc, seen, tRead)
		}
	}
}

var errLostTest = errString("etcd: request timed out")

type errString string

func (e errString) Error() string { return string(e) }

// A claim WithoutCreate (a job's, a key's old shard's) whose write met a
// full etcd, and whose read then finds no live record, answers not found,
// as it would had etcd room (C1): not etcd's refusal, as if a write were
// needed.
func TestExistingClaimWhileFullFindsNothing(t *testing.T) {
	live := &Record{State: InFlight, Fingerprint: tFP, Owner: "", Attempt: tAtt2, Token: tRev, Revision: tRev, Expires: tNow.Add(time.Hour)}
	for _, gone := range []*Record{nil, {State: Done, Fingerprint: tFP, Revision: tRev, Expires: tNow.Add(-time.Second)}} {
		m := NewClaim(Config{Keys: tKeys, Retention: tRet}, ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt, Existing: true})
		v := View{Now: tNow}
		if a := m.Next(v); a.Kind != ActRead {
			t.Fatalf("want a read first, got %v", a.Kind)
		}
		m.Read(live, tRead) // abandoned: taken over
		if a := m.Next(v); a.Kind != ActSend {
			t.Fatalf("want the takeover sent, got %v", a.Kind)
		}
		m.Sent(Reply{Delivery: Full, Err: errLostTest})
		if a := m.Next(v); a.Kind != ActRead {
			t.Fatalf("want a read after etcd's refusal, got %v", a.Kind)
		}
		m.Read(gone, tRead+1)
		if a := m.Next(v); a.Kind != ActDone {
			t.Fatalf("want an answer, got %v", a.Kind)
		}
		if ans := m.Answer(); ans.Verdict != NotFound {
			t.Errorf("record %+v read while etcd is full: verdict %v, want NotFound", gone, ans.Verdict)
		}
	}
}
