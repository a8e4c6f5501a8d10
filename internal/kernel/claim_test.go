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

// Issue 38 (review): a takeover of a held claim (its owner gone) records
// that the attempt was cut short, and every later write keeps it: the
// reaper's fence over that claim, and the abandon of a takeover whose
// reply was lost. An edge that never runs work twice (idemhttp's save
// policy) reads it on the record it takes over next; without it, the
// fence or the abandon looked like a claim given back on purpose.
func TestCutShortSurvivesFencesAndAbandons(t *testing.T) {
	held := &Record{State: InFlight, Fingerprint: tFP, Owner: tOther, Attempt: tAtt2, Token: tRev, Revision: tRev,
		Created: tNow.Add(-time.Minute), Expires: tNow.Add(time.Hour)}
	claimOver := func(rec *Record, fence bool) *Record {
		t.Helper()
		m := NewClaim(Config{Keys: tKeys, Retention: tRet}, ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt, Existing: true, Fence: fence})
		v := View{Now: tNow}
		if a := m.Next(v); a.Kind != ActRead {
			t.Fatalf("want a read first, got %v", a.Kind)
		}
		m.Read(rec, tRead)
		a := m.Next(v)
		if a.Kind == ActOwner {
			m.Owner(false, tRead, nil) // the owner is gone
			a = m.Next(v)
		}
		if a.Kind != ActSend {
			t.Fatalf("want the takeover, got %v", a.Kind)
		}
		return a.Txn.Then[0].Record
	}
	for _, fence := range []bool{false, true} {
		r := claimOver(held, fence)
		if !r.CutShort || r.Owner != map[bool]string{false: tMe, true: ""}[fence] {
			t.Fatalf("fence %v: a takeover of a dead owner's claim wrote %+v; want it cut short", fence, r)
		}
		// The claim abandoned (the reaper gives up a takeover whose reply
		// was lost): still cut short.
		w := NewWrite(Config{Keys: tKeys, Retention: tRet}, HeldBy(tKey, &Record{State: InFlight, Fingerprint: tFP, Owner: tMe, Attempt: tAtt,
			Token: tRead + 1, Revision: tRead + 1, Created: r.Created, Expires: r.Expires, CutShort: r.CutShort}), WriteRequest{Kind: Abandon})
		a := w.Next(View{Now: tNow})
		if a.Kind != ActSend || !a.Txn.Then[0].Record.CutShort || a.Txn.Then[0].Record.Owner != "" {
			t.Fatalf("fence %v: the abandon of a cut-short claim wrote %+v; want it abandoned and still cut short", fence, a.Txn)
		}
		// And taken over again, by anyone: still cut short.
		abandoned := *a.Txn.Then[0].Record
		abandoned.Revision, abandoned.Token = tRead+2, tRead+1
		if again := claimOver(&abandoned, false); !again.CutShort {
			t.Fatalf("fence %v: a takeover of the abandoned record wrote %+v; want it cut short still", fence, again)
		}
	}
	// A claim given back on purpose (abandoned by its owner, none cut
	// short before it) is not.
	given := *held
	given.Owner = ""
	if r := claimOver(&given, false); r.CutShort {
		t.Fatalf("a takeover of a claim abandoned on purpose wrote %+v; want it not cut short", r)
	}
}
