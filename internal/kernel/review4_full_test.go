package kernel

import (
	"errors"
	"testing"
	"time"
)

// review4Answer brings a claim of a key it believes absent to read rec,
// either from a refused write (etcd has room: judge) or from a read after
// etcd refused the write for space (readOnly); alive answers owner reads.
func review4Answer(t *testing.T, rec *Record, full, alive bool, held func(string) bool) Answer {
	t.Helper()
	m := NewClaim(Config{Keys: tKeys, Retention: tRet}, ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt})
	v := View{Now: tNow, HeldHere: held}
	if a := m.Next(v); a.Kind != ActSend {
		t.Fatalf("want the create sent, got %v", a.Kind)
	}
	if full {
		m.Sent(Reply{Delivery: Full, Err: errors.New("etcdserver: mvcc: database space exceeded")})
		if a := m.Next(v); a.Kind != ActRead {
			t.Fatalf("want a read, got %v", a.Kind)
		}
		m.Read(rec, tRead)
	} else {
		m.Sent(Reply{Delivery: Refused, Cur: rec, Rev: tRead})
	}
	for range 4 {
		switch a := m.Next(v); a.Kind {
		case ActDone:
			return m.Answer()
		case ActOwner:
			m.Owner(alive, tRead+1, nil)
		case ActSend:
			return Answer{Why: "a write"}
		case ActAwait:
			return Answer{Why: "a wait"}
		default:
			t.Fatalf("unexpected %v", a.Kind)
		}
	}
	t.Fatal("no answer")
	return Answer{}
}

// A record of another attempt this process holds (runs it: its renewals
// are refused while etcd is full, so its deadline passes): with room the
// claim answers a conflict (C8); while etcd is full it should too (no write
// is needed), not etcd's refusal.
func TestReview4HeldHerePastDeadlineWhileFull(t *testing.T) {
	rec := &Record{State: InFlight, Fingerprint: tFP, Owner: tMe, Attempt: tAtt2, Token: tRev, Revision: tRev,
		Deadline: tNow.Add(-time.Second), Expires: tNow.Add(time.Hour)}
	held := func(a string) bool { return a == tAtt2 }
	room := review4Answer(t, rec, false, true, held)
	full := review4Answer(t, rec, true, true, held)
	if room.Verdict != full.Verdict {
		t.Errorf("held here, past its deadline: with room %v (%s), etcd full %v (%v)", room.Verdict, room.Why, full.Verdict, full.Err)
	}
}

// An orphan of this process's own session (another attempt nobody here
// runs, no deadline): with room it is taken over (a write: C12), so while
// etcd is full the answer should be etcd's refusal (R13), not a conflict
// that says a live owner runs it.
func TestReview4OwnOrphanWhileFull(t *testing.T) {
	rec := &Record{State: InFlight, Fingerprint: tFP, Owner: tMe, Attempt: tAtt2, Token: tRev, Revision: tRev,
		Expires: tNow.Add(time.Hour)}
	room := review4Answer(t, rec, false, true, nil)
	full := review4Answer(t, rec, true, true, nil)
	if room.Why != "a write" || full.Verdict != Error {
		t.Errorf("own orphan: with room %v (%s), etcd full %v (%v); want a write, then etcd's refusal", room.Verdict, room.Why, full.Verdict, full.Err)
	}
}
