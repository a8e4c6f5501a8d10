package kernel

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// A claim's own writes: checkpoint, complete, abandon, release, renew.

type foundKind uint8

const (
	foundAbsent    foundKind = iota
	foundAbandoned           // this claim's record, abandoned (its Abandon landed, or another handle's)
	foundSame                // this claim's in-flight record, saying what the write would
	foundOlder               // this claim's in-flight record, an earlier write of it
	foundDoneSame            // this claim's done record, with the write's outcome
	foundDoneOther           // this claim's done record, with another outcome
	foundOther               // another claim's record (a takeover)
)

type writeCombo struct {
	kind                   WriteKind
	d                      delivery // dApplied, dRefused, dFull, dFailed
	found                  foundKind
	expired                bool // the claim's record is past its expiry
	landed, notSent, retry bool
	try                    int  // failed tries before
	maybe                  bool // one of them may have landed
}

func writeCombos() []writeCombo {
	var out []writeCombo
	for k := Checkpoint; k <= Renew; k++ {
		for _, d := range []delivery{dApplied, dRefused, dFull, dFailed} {
			for f := foundAbsent; f <= foundOther; f++ {
				for flags := range 32 {
					c := writeCombo{kind: k, d: d, found: f, expired: flags&1 != 0, landed: flags&2 != 0,
						notSent: flags&4 != 0, retry: flags&8 != 0, maybe: flags&16 != 0}
					if f != foundAbsent && d != dRefused && d != dFull || c.landed && c.notSent || d != dFailed && (c.landed || c.notSent || c.retry) ||
						f == foundSame && k != Checkpoint && k != Renew {
						continue
					}
					for _, try := range []int{0, MaxTries - 1} {
						if c.maybe && try == 0 {
							continue
						}
						c.try = try
						out = append(out, c)
					}
				}
			}
		}
	}
	return out
}

var tHeld = Held{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt, Token: tRev, Rev: tRev + 5,
	Created: tNow.Add(-time.Hour), Expires: tNow.Add(time.Hour), Checkpoint: []byte("step 1"), Takeovers: 1}

func (c writeCombo) request() WriteRequest {
	return WriteRequest{Kind: c.kind, Checkpoint: []byte("step 2"), Outcome: &Outcome{Status: 201, Body: []byte("ch_1")},
		Deadline: tNow.Add(time.Minute)}
}

// record is what the write's Else (or the read, when etcd is full) found.
func (c writeCombo) record(want *Record) *Record {
	r := &Record{State: InFlight, Fingerprint: tFP, Owner: tMe, Attempt: tAtt, Token: tRev, Revision: tRev + 9,
		Expires: tNow.Add(time.Hour), Checkpoint: []byte("step 1")}
	switch c.found {
	case foundAbsent:
		return nil
	case foundAbandoned:
		r.Owner = ""
	case foundSame:
		if want != nil && want.State == InFlight {
			r.Owner, r.Deadline, r.Checkpoint = want.Owner, want.Deadline, want.Checkpoint
		}
	case foundDoneSame:
		r.State, r.Owner, r.Attempt, r.Checkpoint, r.Outcome = Done, "", "", nil, &Outcome{Status: 201, Body: []byte("ch_1")}
	case foundDoneOther:
		r.State, r.Owner, r.Attempt, r.Checkpoint, r.Outcome = Done, "", "", nil, &Outcome{Status: 500}
	case foundOther:
		r.Owner, r.Attempt, r.Token = tOther, tAtt2, tRev+9
	}
	return r
}

func decideWrite(c writeCombo) outcome {
	h := tHeld
	if c.expired {
		h.Expires = tNow.Add(-time.Second)
	}
	m := NewWrite(Config{Keys: tKeys, Retention: tRet}, h, c.request())
	v := View{Now: tNow}
	for range c.try {
		m.Next(v)
		m.Sent(Reply{Delivery: Failed, Retry: true, MayHaveLanded: c.maybe, Err: errEtcd})
	}
	a := m.Next(v)
	var o outcome
	if a.Kind == ActSend {
		o.txn = a.Txn
		want := a.Txn.Then[0].Record
		switch c.d {
		case dApplied:
			m.Sent(Reply{Delivery: Applied, Rev: tRev + 10})
		case dRefused:
			m.Sent(Reply{Delivery: Refused, Rev: tRev + 10, Cur: c.record(want)})
		case dFull:
			m.Sent(Reply{Delivery: Full, Err: errors.New("etcdserver: mvcc: database space exceeded")})
			if m.Next(v).Kind == ActRead {
				o.extra = append(o.extra, "read")
				m.Read(c.record(want), nil)
			}
		case dFailed:
			m.Sent(Reply{Delivery: Failed, MayHaveLanded: c.landed, NotSent: c.notSent, Retry: c.retry, Err: errEtcd})
		}
		a = m.Next(v)
		if a.Kind == ActSend {
			o.extra = append(o.extra, "again", "wait "+a.Wait.String())
		}
	}
	o.answer, o.ends = m.Answer(), m.Ends()
	o.verdict = o.answer.Verdict
	if m.Held().Rev != tHeld.Rev {
		o.extra = append(o.extra, "adopted")
	}
	return o
}

func writeRules() []rule[writeCombo] {
	ends := func(v Verdict, end bool) func(*testing.T, writeCombo, outcome) {
		return func(t *testing.T, c writeCombo, got outcome) {
			if got.verdict != v || got.ends != end {
				t.Errorf("want %v (the claim ends: %v), got %+v", v, end, got)
			}
		}
	}
	inFlight := func(c writeCombo) bool { return c.kind == Checkpoint || c.kind == Abandon || c.kind == Renew }
	mine := func(c writeCombo) bool { return c.found >= foundAbandoned && c.found <= foundDoneOther }
	return []rule[writeCombo]{
		{"an in-flight write (checkpoint, renew, abandon) when the claim's record is past its expiry by this clock",
			func(c writeCombo) bool { return c.expired && inFlight(c) },
			"not sent: the claim ended with its record (`ErrDeadline`); an outcome (complete, release) still goes",
			func(t *testing.T, c writeCombo, got outcome) {
				if got.txn != nil || got.verdict != Expired || !got.ends || got.answer.EarlierMayHaveLanded != c.maybe {
					t.Errorf("want Expired, unsent, ending the claim: got %+v", got)
				}
			}},
		{"applied", func(c writeCombo) bool { return c.d == dApplied },
			"landed; the claim's fence is the new revision; complete, abandon and release end the claim",
			func(t *testing.T, c writeCombo, got outcome) {
				ends(Landed, c.kind.Final())(t, c, got)
				if !has(got, "adopted") {
					t.Errorf("the claim's fence moves to the write's revision")
				}
			}},
		{"refused; the record is this claim's (its token and attempt), abandoned",
			func(c writeCombo) bool { return c.d == dRefused && c.found == foundAbandoned },
			"an abandon: it landed (its reply was lost); any other write: the claim was abandoned through another handle (`ErrClaimEnded`)",
			func(t *testing.T, c writeCombo, got outcome) {
				if c.kind == Abandon {
					ends(Landed, true)(t, c, got)
				} else {
					ends(Ended, true)(t, c, got)
				}
			}},
		{"refused; this claim's in-flight record, saying what the write would put (a checkpoint or renewal whose reply was lost)",
			func(c writeCombo) bool {
				return c.d == dRefused && c.found == foundSame && (c.kind == Checkpoint || c.kind == Renew)
			},
			"landed: the record is adopted", ends(Landed, false)},
		{"refused; this claim's in-flight record, another write of it (an earlier one landed), on the last try",
			func(c writeCombo) bool {
				return c.d == dRefused && (c.found == foundSame || c.found == foundOlder) && c.try == MaxTries-1
			},
			"`ErrUnavailable`: the record kept changing (adopted; the claim stays held)", ends(KeptChanging, false)},
		{"refused; this claim's in-flight record, another write of it",
			func(c writeCombo) bool { return c.d == dRefused && (c.found == foundSame || c.found == foundOlder) },
			"adopt it (never rewrite from older memory), and write again on top at once",
			func(t *testing.T, c writeCombo, got outcome) {
				if !has(got, "again") || !has(got, "wait 0s") || !has(got, "adopted") {
					t.Errorf("want the record adopted and the write sent again at once, got %+v", got)
				}
			}},
		{"refused; this claim's done record, with the outcome this complete saves",
			func(c writeCombo) bool { return c.d == dRefused && c.found == foundDoneSame && c.kind == Complete },
			"landed (its reply was lost)", ends(Landed, true)},
		{"refused; this claim's done record otherwise", func(c writeCombo) bool { return c.d == dRefused && mine(c) },
			"completed through another handle (`ErrClaimEnded`)", ends(Ended, true)},
		{"refused; no record, for a release", func(c writeCombo) bool { return c.d == dRefused && c.found == foundAbsent && c.kind == Release },
			"nothing of the claim's is left to release: done", ends(Landed, true)},
		{"refused otherwise (another claim's record: a takeover; or gone)", func(c writeCombo) bool { return c.d == dRefused },
			"fenced (`ErrFenced`): the claim ends", ends(Fenced, true)},
		{"etcd is full, a complete or an abandon: a read finds this claim's write landed",
			func(c writeCombo) bool {
				return c.d == dFull && (c.kind == Complete && c.found == foundDoneSame || c.kind == Abandon && c.found == foundAbandoned)
			}, "landed (known only by a read: etcd refuses every Txn with a Put)", ends(Landed, true)},
		{"etcd is full otherwise", func(c writeCombo) bool { return c.d == dFull },
			"etcd's refusal (`ErrStoreFull`); the claim stays held", ends(Error, false)},
		{"no answer, may be retried, fewer than 4 tries", func(c writeCombo) bool { return c.retry && c.try < MaxTries-1 },
			"sent again after a backoff", func(t *testing.T, c writeCombo, got outcome) {
				if !has(got, "again") || !has(got, "wait "+Backoff(c.try).String()) {
					t.Errorf("want the write again after %v, got %+v", Backoff(c.try), got)
				}
			}},
		{"no answer otherwise", func(writeCombo) bool { return true },
			"the error (`ErrUnavailable`): the claim stays held; if a try may have landed and the last was not sent, it says so",
			func(t *testing.T, c writeCombo, got outcome) {
				maybe := c.maybe || c.landed
				wrapped := got.answer.Err != nil && strings.HasPrefix(got.answer.Err.Error(), "an earlier try may have landed")
				if got.verdict != Error || got.ends || got.answer.EarlierMayHaveLanded != maybe || wrapped != (maybe && c.notSent) {
					t.Errorf("want Error, held, maybe %v, wrapped %v: got %+v", maybe, maybe && c.notSent, got)
				}
			}},
	}
}

func writeTable(t *testing.T) [][]string {
	return table(t, "write", "W", writeCombos(), writeRules(), decideWrite, func(c writeCombo, o outcome) string {
		if o.txn == nil {
			return ""
		}
		return strings.ReplaceAll(short(o.txn), "=105", "=mine")
	})
}
