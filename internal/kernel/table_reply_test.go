package kernel

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// What a claim's Txn answered, and what the claim does with it.

type delivery uint8

const (
	dApplied delivery = iota
	dRefused
	dOwnerGone
	dSetMoved
	dEpochMoved
	dFull
	dFailed
)

type fullRec uint8

const (
	fullAbsent fullRec = iota
	fullDone
	fullOtherFP
	fullLive     // in flight, its owner alive
	fullDead     // in flight, its owner gone
	fullDeadline // in flight, past its deadline
	fullOwn      // in flight, the claimant's own attempt (an earlier try landed), its session alive
	fullOwnGone  // the same, its session's owner key gone
	fullMoved    // a Moved record (the key handed to another shard)
	fullHeld     // in flight, another attempt this process holds, past its deadline
	fullOrphan   // in flight, another attempt of our session that nobody here runs, no deadline
)

type replyCombo struct {
	d                      delivery
	landed, notSent, retry bool
	tries                  int  // failed tries before this one
	uncertain              bool // one of them may have landed
	rounds                 int  // refused writes before this one
	full                   fullRec
	epochs                 bool
}

func replyCombos() []replyCombo {
	var out []replyCombo
	for d := dApplied; d <= dFailed; d++ {
		for _, epochs := range []bool{false, true} {
			if (d == dSetMoved || d == dEpochMoved) && !epochs {
				continue
			}
			for _, rounds := range []int{0, MaxRounds - 1} {
				for tries := 0; tries <= MaxTries; tries++ {
					for flags := range 16 {
						c := replyCombo{d: d, epochs: epochs, rounds: rounds, tries: tries,
							landed: flags&1 != 0, notSent: flags&2 != 0, retry: flags&4 != 0, uncertain: flags&8 != 0}
						if c.landed && c.notSent || c.uncertain && tries == 0 || d != dFailed && (c.landed || c.notSent || c.retry) {
							continue
						}
						for f := fullAbsent; f <= fullOrphan; f++ {
							if f != fullAbsent && d != dFull {
								break
							}
							c.full = f
							out = append(out, c)
						}
					}
				}
			}
		}
	}
	return out
}

var errEtcd = errors.New("etcd: request timed out")

// decideReply brings a claim of an absent key to the combination's tries
// and rounds, then feeds it the combination's answer.
func decideReply(c replyCombo) outcome {
	cfg := Config{Keys: tKeys, Retention: tRet, Epochs: c.epochs}
	v := View{Now: tNow}
	if c.epochs {
		v.Epoch, v.SetRev = tEpoch, tSet
	}
	if c.full == fullHeld {
		v.HeldHere = func(a string) bool { return a == tAtt2 }
	}
	m := NewClaim(cfg, ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: tMe, Attempt: tAtt})
	m.Next(v)
	for i := range c.rounds {
		m.Sent(Reply{Delivery: Refused, Rev: tRead + int64(i), Epoch: v.Epoch, Set: SetValue{Rev: v.SetRev}})
		m.Next(v)
	}
	for i := range c.tries {
		m.Sent(Reply{Delivery: Failed, Retry: true, MayHaveLanded: c.uncertain && i == 0, Err: errEtcd})
		m.Next(v)
	}
	r := Reply{Rev: tRead + 50, Epoch: v.Epoch, Set: SetValue{Rev: v.SetRev}}
	switch c.d {
	case dApplied:
		r.Delivery = Applied
	case dRefused, dOwnerGone, dSetMoved, dEpochMoved:
		r.Delivery, r.OwnerGone = Refused, c.d == dOwnerGone
		if c.d == dSetMoved {
			r.Set.Rev++
		}
		if c.d == dEpochMoved {
			r.Epoch++
		}
	case dFull:
		r.Delivery, r.Err = Full, errors.New("etcdserver: mvcc: database space exceeded")
	case dFailed:
		r = Reply{Delivery: Failed, MayHaveLanded: c.landed, NotSent: c.notSent, Retry: c.retry, Err: errEtcd}
	}
	var o outcome
	notes := m.Sent(r)
	o.extra = append(o.extra, notesString(notes))
	a := m.Next(v)
	if c.d == dFull && a.Kind == ActRead {
		m.Read(c.full.record(), tRead+60)
		if a = m.Next(v); a.Kind == ActOwner {
			o.owner = a.Owner
			m.Owner(c.full == fullLive || c.full == fullOwn || c.full == fullOrphan, tRead+61, nil) // our session lives
			a = m.Next(v)
		}
	}
	switch a.Kind {
	case ActDone:
		o.answer = m.Answer()
		o.verdict = o.answer.Verdict
	case ActSend:
		o.txn = a.Txn
		o.extra = append(o.extra, "wait "+a.Wait.String())
	case ActRead:
		o.extra = append(o.extra, "read")
	}
	unc, _ := m.Uncertain()
	if unc {
		o.extra = append(o.extra, "uncertain")
	}
	return o
}

func notesString(n Notes) string {
	var s []string
	if n.NewEpoch {
		s = append(s, "epoch")
	}
	if n.NewSet {
		s = append(s, "set")
	}
	return strings.Join(s, ",")
}

func (f fullRec) record() *Record {
	r := &Record{State: InFlight, Fingerprint: tFP, Owner: tOther, Attempt: tAtt2, Revision: tRev, Token: tRev,
		Expires: tNow.Add(time.Hour)}
	switch f {
	case fullAbsent:
		return nil
	case fullDone:
		r.State, r.Owner, r.Outcome = Done, "", &Outcome{Body: []byte("ch_1")}
	case fullOtherFP:
		r.Fingerprint = tFP2
	case fullDeadline:
		r.Deadline = tNow.Add(-time.Second)
	case fullOwn, fullOwnGone:
		r.Owner, r.Attempt = tMe, tAtt
	case fullHeld:
		r.Deadline = tNow.Add(-time.Second)
	case fullOrphan:
		r.Owner = tMe
	case fullMoved:
		r.State, r.Owner, r.Attempt, r.Fingerprint, r.MovedTo = Moved, "", "", [32]byte{}, "b"
	}
	return r
}

func has(o outcome, s string) bool {
	for _, e := range o.extra {
		if e == s {
			return true
		}
	}
	return false
}

func replyRules() []rule[replyCombo] {
	verdict := func(v Verdict) func(*testing.T, replyCombo, outcome) {
		return func(t *testing.T, c replyCombo, got outcome) {
			if got.verdict != v {
				t.Errorf("want %v, got %+v", v, got)
			}
		}
	}
	judgeAgain := func(t *testing.T, c replyCombo, got outcome) {
		if got.txn == nil || got.txn.If[0].String() != Absent(tKey).String() || !has(got, "wait 0s") {
			t.Errorf("want the record read judged again at once (absent: a create), got %+v", got)
		}
	}
	return []rule[replyCombo]{
		{"applied", func(c replyCombo) bool { return c.d == dApplied },
			"won: the token is `epoch<<44 | the Txn's revision`", func(t *testing.T, c replyCombo, got outcome) {
				want := tRead + 50
				if c.epochs {
					want |= tEpoch << EpochShift
				}
				if got.verdict != Won || !got.answer.Wrote || got.answer.Record.Token != want || got.answer.Record.Revision != tRead+50 {
					t.Errorf("want Won with token %d, got %+v", want, got)
				}
			}},
		{"refused: the claimant's owner key is gone", func(c replyCombo) bool { return c.d == dOwnerGone },
			"the session ended: `ErrSessionLost`, nothing written", verdict(SessionGone)},
		{"refused: the shard set is not the one compared", func(c replyCombo) bool { return c.d == dSetMoved },
			"`ErrSetChanged`: the set is learnt, the key routed again", func(t *testing.T, c replyCombo, got outcome) {
				if got.verdict != SetChanged || !has(got, "set") {
					t.Errorf("want SetChanged with the set learnt, got %+v", got)
				}
			}},
		{"the eighth write was refused, or got no answer and would be retried",
			func(c replyCombo) bool {
				return c.rounds == MaxRounds-1 && (c.d == dRefused || c.d == dEpochMoved || c.d == dFailed && c.retry && c.tries < MaxTries)
			},
			"conflict: the record kept changing", verdict(Conflict)},
		{"refused: the shard epoch is not the one compared", func(c replyCombo) bool { return c.d == dEpochMoved },
			"the epoch is learnt; the record read is judged again", func(t *testing.T, c replyCombo, got outcome) {
				if !has(got, "epoch") {
					t.Errorf("want the epoch learnt, got %+v", got)
				}
				judgeAgain(t, c, got)
			}},
		{"refused", func(c replyCombo) bool { return c.d == dRefused },
			"the record its Else read is judged again (the table above)", judgeAgain},
		{"etcd is full (`NOSPACE`: any Txn with a Put is refused); a read finds the key done",
			func(c replyCombo) bool { return c.d == dFull && c.full == fullDone }, "replay, from the read", verdict(Replay)},
		{"etcd is full; the read finds a Moved record (the key handed to another shard)",
			func(c replyCombo) bool { return c.d == dFull && c.full == fullMoved }, "moved: go to the shard it names, as when etcd is not full", verdict(IsMoved)},
		{"etcd is full; the read finds another fingerprint", func(c replyCombo) bool { return c.d == dFull && c.full == fullOtherFP },
			"mismatch", verdict(Mismatch)},
		{"etcd is full; the claimant's own attempt, in flight before its deadline (an earlier try landed), and its owner key exists (a claim `WithoutSession` has none to read)",
			func(c replyCombo) bool { return c.d == dFull && c.full == fullOwn }, "won, from the reads, as when etcd is not full (nothing needs writing)", verdict(Won)},
		{"etcd is full; the claimant's own attempt, its owner key gone",
			func(c replyCombo) bool { return c.d == dFull && c.full == fullOwnGone }, "the session ended: `ErrSessionLost`, as a write's Else would say", verdict(SessionGone)},
		{"etcd is full; in flight under another attempt this process holds (even past its deadline: its renewals are refused too)",
			func(c replyCombo) bool { return c.d == dFull && c.full == fullHeld }, "conflict, as when etcd is not full (C8)", verdict(Conflict)},
		{"etcd is full; in flight before its deadline, and its owner key exists",
			func(c replyCombo) bool { return c.d == dFull && c.full == fullLive }, "conflict", verdict(Conflict)},
		{"etcd is full, otherwise (absent, a stale claim, our own orphan: a write is needed)", func(c replyCombo) bool { return c.d == dFull },
			"etcd's refusal: `ErrStoreFull`", verdict(Error)},
		{"no answer, may be retried (the caller's context lives, a transient error), fewer than 4 retries so far",
			func(c replyCombo) bool { return c.d == dFailed && c.retry && c.tries < MaxTries },
			"sent again after a backoff (25 ms doubling): the create's Else finds whatever landed, its own attempt recognised; a try that may have landed makes the claim uncertain (reaped if it fails)",
			func(t *testing.T, c replyCombo, got outcome) {
				if got.txn == nil || !has(got, "wait "+Backoff(c.tries+1).String()) || has(got, "uncertain") != (c.uncertain || c.landed) {
					t.Errorf("want a retry after %v, uncertain %v: got %+v", Backoff(c.tries+1), c.uncertain || c.landed, got)
				}
			}},
		{"no answer otherwise", func(c replyCombo) bool { return c.d == dFailed },
			"the error (`ErrUnavailable`); if a try may have landed and the last was not sent, it says an earlier try may have landed",
			func(t *testing.T, c replyCombo, got outcome) {
				unc := c.uncertain || c.landed
				wrapped := strings.HasPrefix(got.answer.Err.Error(), "an earlier try may have landed")
				if got.verdict != Error || got.answer.EarlierMayHaveLanded != unc || wrapped != (unc && c.notSent) {
					t.Errorf("want Error, uncertain %v, wrapped %v: got %+v", unc, unc && c.notSent, got.answer)
				}
			}},
	}
}

func claimReplyTable(t *testing.T) [][]string {
	return table(t, "claim reply", "R", replyCombos(), replyRules(), decideReply, func(replyCombo, outcome) string { return "" })
}
