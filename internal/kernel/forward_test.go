package kernel

import (
	"testing"
	"time"
)

// A hand-over's landed record is the one a read of it returns: times are
// stored to the millisecond, so the answer's are rounded as the stored
// record's are (Enqueue's are; Forward's were not, and a caller comparing
// the answer with a read of the key saw two records).
func TestForwardLandedRecordIsTheStoredOne(t *testing.T) {
	now := tNow.Add(123456789 * time.Nanosecond) // not a whole millisecond
	m := NewForward(Config{Keys: tKeys, Retention: tRet}, ForwardRequest{Key: tKey, To: "b"})
	if a := m.Next(View{Now: now}); a.Kind != ActRead {
		t.Fatalf("want a read first, got %v", a.Kind)
	}
	m.Read(nil)
	if a := m.Next(View{Now: now}); a.Kind != ActSend {
		t.Fatalf("want the hand-over sent, got %v", a.Kind)
	}
	m.Sent(Reply{Delivery: Applied, Rev: tRev})
	ans := m.Answer()
	if ans.Verdict != Landed || ans.Record == nil {
		t.Fatalf("answer %+v, want Landed with the record", ans)
	}
	rec := ans.Record
	if !rec.Created.Equal(Millis(now)) || !rec.Expires.Equal(Millis(now.Add(tRet))) {
		t.Errorf("landed record Created %v Expires %v; stored as %v and %v", rec.Created, rec.Expires, Millis(now), Millis(now.Add(tRet)))
	}
}

// The same for a claim's record: its creation time as stored (found by
// review: Claim.Created differed from a read by up to a millisecond).
func TestClaimWonRecordIsTheStoredOne(t *testing.T) {
	now := tNow.Add(123456789 * time.Nanosecond)
	m := NewClaim(Config{Keys: tKeys, Retention: tRet}, ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt})
	if a := m.Next(View{Now: now}); a.Kind != ActSend {
		t.Fatalf("want the create sent, got %v", a.Kind)
	}
	m.Sent(Reply{Delivery: Applied, Rev: tRev})
	ans := m.Answer()
	if ans.Verdict != Won || ans.Record == nil {
		t.Fatalf("answer %+v, want Won with the record", ans)
	}
	if !ans.Record.Created.Equal(Millis(now)) {
		t.Errorf("won record Created %v; stored as %v", ans.Record.Created, Millis(now))
	}
}
