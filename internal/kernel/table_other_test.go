package kernel

import (
	"testing"
	"time"
)

// An enqueue, a hand-over, the reaper, and reads without a write.

type enqCombo struct {
	rec                 recKind // absent, moved, done, in flight (recFence: expired in flight)
	fpOther             bool
	expired             bool
	existing, overMoved bool
	value               uint8 // 0 none, 1 IfValue, 2 IfValueThen
	valueMoved          bool  // the Txn was refused while the record was as expected: the value moved
	epochMoved          bool  // or: the shard epoch moved (the value did not)
	epochs              bool
}

func enqCombos() []enqCombo {
	var out []enqCombo
	for _, r := range []recKind{recAbsent, recMoved, recDone, recInFlight} {
		for flags := range 64 {
			c := enqCombo{rec: r, fpOther: flags&1 != 0, expired: flags&2 != 0, existing: flags&4 != 0,
				overMoved: flags&8 != 0, valueMoved: flags&16 != 0, epochs: flags&32 != 0}
			if r == recAbsent && (c.fpOther || c.expired) {
				continue
			}
			for v := range uint8(3) {
				c.value = v
				if v == 0 && c.valueMoved {
					continue
				}
				out = append(out, c)
				if c.epochs && !c.valueMoved {
					e := c
					e.epochMoved = true
					out = append(out, e)
				}
			}
		}
	}
	return out
}

func (c enqCombo) record() *Record {
	if c.rec == recAbsent {
		return nil
	}
	r := &Record{State: InFlight, Fingerprint: tFP, Revision: tRev, Token: tRev, Expires: tNow.Add(time.Hour)}
	if c.fpOther {
		r.Fingerprint = tFP2
	}
	if c.expired {
		r.Expires = tNow.Add(-time.Second)
	}
	switch c.rec {
	case recMoved:
		r.State, r.MovedTo = Moved, "b"
	case recDone:
		r.State, r.Outcome = Done, &Outcome{}
	}
	return r
}

func (c enqCombo) live() bool { return c.rec != recAbsent && c.rec != recMoved && !c.expired }

func decideEnqueue(c enqCombo) outcome {
	req := EnqueueRequest{Key: tKey, Fingerprint: tFP, Attempt: tAtt, Data: []byte("params"), Existing: c.existing, OverMoved: c.overMoved}
	if c.value > 0 {
		req.Value, req.ValueRev = tKeys.Value("cursor"), 70
	}
	if c.value == 2 {
		req.ValueTo = []byte("submitted")
	}
	v := View{Now: tNow}
	if c.epochs {
		v.Epoch, v.SetRev = tEpoch, tSet
	}
	m := NewEnqueue(Config{Keys: tKeys, Retention: tRet, Epochs: c.epochs}, req)
	a := m.Next(v)
	if a.Kind == ActRead {
		m.Read(c.record())
		a = m.Next(v)
	} else if c.rec != recAbsent {
		m.Sent(Reply{Delivery: Refused, Rev: tRead, Cur: c.record(), Epoch: v.Epoch, Set: SetValue{Rev: v.SetRev}})
		a = m.Next(v)
	}
	var o outcome
	if a.Kind == ActSend {
		o.txn = a.Txn
		if c.valueMoved {
			// Refused with the record as this write expected it: only the
			// value's compare can have failed.
			m.Sent(Reply{Delivery: Refused, Rev: tRead + 1, Cur: c.record(), Epoch: v.Epoch, Set: SetValue{Rev: v.SetRev}})
			m.Next(v)
			o.extra = append(o.extra, "refused")
		}
		if c.epochMoved {
			// Refused by the epoch alone: learnt, the write goes again.
			m.Sent(Reply{Delivery: Refused, Rev: tRead + 1, Cur: c.record(), Epoch: v.Epoch + 1, Set: SetValue{Rev: v.SetRev}})
			v.Epoch++
			if again := m.Next(v); again.Kind != ActSend {
				o.extra = append(o.extra, "not sent again")
			}
		}
	}
	o.answer = m.Answer()
	o.verdict = o.answer.Verdict
	return o
}

func enqRules() []rule[enqCombo] {
	verdict := func(v Verdict) func(*testing.T, enqCombo, outcome) {
		return func(t *testing.T, c enqCombo, got outcome) {
			if got.verdict != v || got.txn != nil {
				t.Errorf("want %v without a write, got %+v", v, got)
			}
		}
	}
	write := func(create bool) func(*testing.T, enqCombo, outcome) {
		return func(t *testing.T, c enqCombo, got outcome) {
			if got.txn == nil {
				t.Errorf("want a write, got %+v", got)
				return
			}
			want := []Cmp{Modified(tKey, tRev)}
			if create {
				want[0] = Absent(tKey)
			}
			then := 1
			if c.value > 0 {
				want = append(want, Modified(tKeys.Value("cursor"), 70))
				then = 2 // the value moves with the record
			}
			if c.epochs {
				want = append(want, tKeys.Guards(tEpoch, tSet)...)
			}
			r := got.txn.Then[0].Record
			switch {
			case len(got.txn.If) != len(want) || len(got.txn.Then) != then:
				t.Errorf("compares %v, then %v; want %v and %d ops", got.txn.If, got.txn.Then, want, then)
			case r.Owner != "" || r.State != InFlight || string(r.Checkpoint) != "params" || r.Takeovers != 0:
				t.Errorf("want an abandoned claim nobody held, its checkpoint the data: %+v", r)
			case c.valueMoved && got.verdict != ValueChanged:
				t.Errorf("refused with the record as expected: want ValueChanged, got %+v", got)
			case c.epochMoved && (got.verdict != 0 || len(got.extra) > 0):
				t.Errorf("refused by the shard epoch alone: want it learnt and the write sent again, got %+v", got)
			}
			for i := range want {
				if i < len(got.txn.If) && !sameCmp(got.txn.If[i], want[i]) {
					t.Errorf("compare %d: %v, want %v", i, got.txn.If[i], want[i])
				}
			}
		}
	}
	return []rule[enqCombo]{
		{"`WithoutCreate` and no live record", func(c enqCombo) bool { return c.existing && !c.live() },
			"not found: nothing written", verdict(NotFound)},
		{"no record", func(c enqCombo) bool { return c.rec == recAbsent },
			"enqueue: an in-flight record with no owner, its checkpoint the job's data (with `IfValue`: only while the value is at its revision, which the write moves); refused with the record as expected: `ErrValueChanged`, unless the shard epoch moved (learnt, and the write sent again)",
			write(true)},
		{"its retention passed, or Moved and `ReplaceMoved`", func(c enqCombo) bool { return c.expired || c.rec == recMoved && c.overMoved },
			"enqueue over it: a new job", write(false)},
		{"Moved", func(c enqCombo) bool { return c.rec == recMoved }, "moved", verdict(IsMoved)},
		{"another fingerprint", func(c enqCombo) bool { return c.fpOther }, "mismatch", verdict(Mismatch)},
		{"a live record (in flight or done)", func(enqCombo) bool { return true },
			"returned as it is: a key is enqueued once, whoever enqueues it", verdict(Found)},
	}
}

func enqueueTable(t *testing.T) [][]string {
	return table(t, "enqueue", "E", enqCombos(), enqRules(), decideEnqueue, func(c enqCombo, o outcome) string {
		if o.txn == nil || c.epochs || c.value != 2 {
			return ""
		}
		return short(o.txn)
	})
}

type fwdCombo struct {
	rec     recKind // absent, moved, done, in flight
	movedTo string  // moved: to the same shard, or another
	expired bool
}

func fwdCombos() []fwdCombo {
	var out []fwdCombo
	for _, r := range []recKind{recAbsent, recMoved, recDone, recInFlight} {
		for _, exp := range []bool{false, true} {
			for _, to := range []string{"b", "c"} {
				if r == recAbsent && (exp || to == "c") || r != recMoved && to == "c" {
					continue
				}
				out = append(out, fwdCombo{rec: r, movedTo: to, expired: exp})
			}
		}
	}
	return out
}

func decideForward(c fwdCombo) outcome {
	m := NewForward(Config{Keys: tKeys, Retention: tRet, Epochs: true}, ForwardRequest{Key: tKey, To: "b"})
	v := View{Now: tNow, Epoch: tEpoch, SetRev: tSet}
	m.Next(v)
	e := enqCombo{rec: c.rec, expired: c.expired}
	r := e.record()
	if r != nil && r.State == Moved {
		r.MovedTo = c.movedTo
	}
	m.Read(r)
	var o outcome
	if a := m.Next(v); a.Kind == ActSend {
		o.txn = a.Txn
	}
	o.answer = m.Answer()
	o.verdict = o.answer.Verdict
	return o
}

func fwdRules() []rule[fwdCombo] {
	write := func(create bool) func(*testing.T, fwdCombo, outcome) {
		return func(t *testing.T, c fwdCombo, got outcome) {
			first := Modified(tKey, tRev)
			if create {
				first = Absent(tKey)
			}
			if got.txn == nil || !sameCmp(got.txn.If[0], first) || len(got.txn.If) != 3 ||
				got.txn.Then[0].Record.State != Moved || got.txn.Then[0].Record.MovedTo != "b" || got.txn.Then[0].Record.Epoch != tEpoch {
				t.Errorf("want a Moved record naming b with the shard's epoch, guarded, over %v; got %+v", first, got)
			}
		}
	}
	found := func(t *testing.T, c fwdCombo, got outcome) {
		if got.verdict != Found || got.txn != nil {
			t.Errorf("want the record returned, nothing written: %+v", got)
		}
	}
	return []rule[fwdCombo]{
		{"hand-over: no record", func(c fwdCombo) bool { return c.rec == recAbsent },
			"write a Moved record naming the key's home: this shard refuses to claim it from then on", write(true)},
		{"hand-over: its retention passed, or Moved to another shard (an older set's)",
			func(c fwdCombo) bool { return c.expired || c.rec == recMoved && c.movedTo != "b" }, "replace it by a Moved record", write(false)},
		{"hand-over: a live record here, or Moved to the home already", func(fwdCombo) bool { return true },
			"returned: a live record keeps the key here (claimed only while it lives: `WithoutCreate`)", found},
	}
}

func forwardTable(t *testing.T) [][]string {
	return table(t, "forward", "F", fwdCombos(), fwdRules(), decideForward, func(c fwdCombo, o outcome) string { return short(o.txn) })
}

type reapCombo struct {
	rec     recKind // absent, done, moved, in flight
	mine    bool    // in flight: the reaped claim's owner and attempt
	after   bool    // written after the claim's highest seen revision
	ownerOK bool    // in flight, not mine: same attempt, another owner (or the reverse)
	expired bool    // past its retention at the reaper's clock
	soon    bool    // retained now, expired before the claim's lost writes can no longer land
}

func reapCombos() []reapCombo {
	var out []reapCombo
	for _, r := range []recKind{recAbsent, recDone, recMoved, recInFlight} {
		for flags := range 32 {
			c := reapCombo{rec: r, mine: flags&1 != 0, after: flags&2 != 0, ownerOK: flags&4 != 0, expired: flags&8 != 0, soon: flags&16 != 0}
			if r != recInFlight && (c.mine || c.ownerOK) || r == recAbsent && (c.after || c.expired || c.soon) || c.mine && c.ownerOK || c.expired && c.soon {
				continue
			}
			out = append(out, c)
		}
	}
	return out
}

func (c reapCombo) record() *Record {
	if c.rec == recAbsent {
		return nil
	}
	r := &Record{State: InFlight, Owner: tOther, Attempt: tAtt2, Revision: tRev, Expires: tNow.Add(time.Hour)}
	if c.expired {
		r.Expires = tNow.Add(-time.Second)
	}
	if c.soon {
		r.Expires = tNow.Add(time.Second)
	}
	if c.after {
		r.Revision = tRead + 1
	}
	switch {
	case c.rec == recDone:
		r.State = Done
	case c.rec == recMoved:
		r.State = Moved
	case c.mine:
		r.Owner, r.Attempt = tMe, tAtt
	case c.ownerOK:
		r.Attempt = tAtt // the attempt, under another owner: not the reaped claim's
	}
	return r
}

func reapRules() []rule[reapCombo] {
	step := func(want Reaping) func(*testing.T, reapCombo, outcome) {
		return func(t *testing.T, c reapCombo, got outcome) {
			if s := Reap(c.record(), tMe, tAtt, tRead, tNow, tNow.Add(10*time.Second)); s != want {
				t.Errorf("want %v, got %v", want, s)
			}
		}
	}
	return []rule[reapCombo]{
		{"reaper: in flight, the claim's own owner and attempt (the lost write landed)", func(c reapCombo) bool { return c.mine },
			"abandon it: the next claimant anywhere takes it over at once", step(ReapAbandon)},
		{"reaper: absent, past its retention, or in flight or Moved at a revision the claim saw (a claim with OverMoved writes over a Moved record it read)", func(c reapCombo) bool {
			return c.rec == recAbsent || c.expired || (c.rec == recInFlight || c.rec == recMoved) && !c.after
		}, "fence it: claim it with the same attempt and the claim's OverMoved, written abandoned (absent or expired: a Fence placeholder, free as absent, live a retention); the lost write's compare can never hold after",
			step(ReapFence)},
		{"reaper: written after `seen` by another, or done, and retained until the lost writes can no longer land (twice the request timeout)",
			func(c reapCombo) bool { return !c.soon }, "nothing: no lost write can land while it is there", step(ReapDone)},
		{"reaper: such a record that expires before then (the sweeper or EvictIf may delete it first)", func(reapCombo) bool { return true },
			"look again later (once it expired: fence it)", step(ReapRetry)},
	}
}

func reapTable(t *testing.T) [][]string {
	return table(t, "reap", "P", reapCombos(), reapRules(), func(reapCombo) outcome { return outcome{} },
		func(reapCombo, outcome) string { return "" })
}

type readCombo struct {
	rec     recKind // absent, done, in flight
	fpOther bool
	expired bool
}

func readCombos() []readCombo {
	var out []readCombo
	for _, r := range []recKind{recAbsent, recFence, recDone, recInFlight} {
		for flags := range 4 {
			c := readCombo{rec: r, fpOther: flags&1 != 0, expired: flags&2 != 0}
			if r == recAbsent && flags != 0 {
				continue
			}
			out = append(out, c)
		}
	}
	return out
}

func readRules() []rule[readCombo] {
	verdict := func(want Verdict) func(*testing.T, readCombo, outcome) {
		return func(t *testing.T, c readCombo, got outcome) {
			r := enqCombo{rec: c.rec, fpOther: c.fpOther, expired: c.expired}.record()
			if c.rec == recFence {
				r = &Record{State: InFlight, Fence: true, Fingerprint: tFP, Expires: tNow.Add(time.Hour)}
			}
			if v := ReadDone(r, tFP, tNow); v != want {
				t.Errorf("want %v, got %v", want, v)
			}
		}
	}
	return []rule[readCombo]{
		{"a read without a write (the replay cache, or the read-first Get): done, retained, another fingerprint",
			func(c readCombo) bool { return c.rec == recDone && !c.expired && c.fpOther }, "mismatch", verdict(Mismatch)},
		{"a read without a write: done, retained", func(c readCombo) bool { return c.rec == recDone && !c.expired },
			"replay it, no write", verdict(Replay)},
		{"a read without a write: anything else (absent, expired, in flight, a fence)", func(readCombo) bool { return true },
			"nothing: the claim's Txn decides", verdict(0)},
	}
}

func readTable(t *testing.T) [][]string {
	return table(t, "read", "D", readCombos(), readRules(), func(readCombo) outcome { return outcome{} },
		func(readCombo, outcome) string { return "" })
}

// fenceCombo is how the reaper's fencing claim ended.
type fenceCombo struct {
	soon    bool // the record refusing the fence expires before the lost writes can no longer land
	verdict Verdict
	own     bool // Won: its own claim (the lost write landed); Conflict: a record of the reaper's session
	after   bool // Conflict: written after seen
	noRec   bool // Conflict: the record kept changing (none)
}

func fenceCombos() []fenceCombo {
	var out []fenceCombo
	for v := Won; v <= KeptChanging; v++ {
		for flags := range 16 {
			c := fenceCombo{verdict: v, own: flags&1 != 0, after: flags&2 != 0, noRec: flags&4 != 0, soon: flags&8 != 0}
			if v != Conflict && (c.after || c.noRec) || v != Won && v != Conflict && c.own || c.noRec && (c.own || c.after || c.soon) ||
				c.soon && v != Conflict && v != Replay && v != Mismatch && v != IsMoved {
				continue
			}
			out = append(out, c)
		}
	}
	return out
}

func (c fenceCombo) answer() Answer {
	a := Answer{Verdict: c.verdict}
	switch {
	case c.verdict == Won && c.own:
		a.Record = &Record{State: InFlight, Owner: tMe, Attempt: tAtt}
	case c.verdict == Won:
		a.Record = &Record{State: InFlight, Attempt: tAtt} // written abandoned: the fence
	case c.verdict == Replay || c.verdict == Mismatch || c.verdict == IsMoved:
		a.Record = &Record{State: Done, Revision: tRev, Expires: tNow.Add(time.Hour)}
		if c.soon {
			a.Record.Expires = tNow.Add(time.Second)
		}
	case c.verdict == Conflict && !c.noRec:
		a.Record = &Record{State: InFlight, Owner: tOther, Attempt: tAtt2, Revision: tRev, Expires: tNow.Add(time.Hour)}
		if c.soon {
			a.Record.Expires = tNow.Add(time.Second)
		}
		if c.own {
			a.Record.Owner = tMe
		}
		if c.after {
			a.Record.Revision = tRead + 1
		}
	}
	return a
}

func fenceRules() []rule[fenceCombo] {
	step := func(want Reaping) func(*testing.T, fenceCombo, outcome) {
		return func(t *testing.T, c fenceCombo, got outcome) {
			if s := ReapFenced(c.answer(), tMe, tRead, tNow.Add(10*time.Second)); s != want {
				t.Errorf("want %v, got %v", want, s)
			}
		}
	}
	return []rule[fenceCombo]{
		{"reaper's fence: won, written abandoned", func(c fenceCombo) bool { return c.verdict == Won && !c.own },
			"done: the lost write's compare can never hold", step(ReapDone)},
		{"reaper's fence: won as the claim's own record (the lost write landed meanwhile)", func(c fenceCombo) bool { return c.verdict == Won },
			"abandon it", step(ReapAbandon)},
		{"reaper's fence: done, another fingerprint, or Moved, retained until the lost writes can no longer land",
			func(c fenceCombo) bool {
				return (c.verdict == Replay || c.verdict == Mismatch || c.verdict == IsMoved) && !c.soon
			},
			"done: the lost write never wrote over such a record", step(ReapDone)},
		{"reaper's fence: held by a live owner of another session, or written after `seen`, retained until then",
			func(c fenceCombo) bool { return c.verdict == Conflict && !c.noRec && (!c.own || c.after) && !c.soon },
			"done", step(ReapDone)},
		{"reaper's fence: refused because the shard set moved since the set it compared (the lost write's, or a newer one)",
			func(c fenceCombo) bool { return c.verdict == SetChanged },
			"read once more: the lost write can no longer land; abandon it if it landed, else done", step(ReapCheck)},
		{"reaper's fence: otherwise (held here under its own session at a revision the lost write may have compared; a record that may be deleted first; etcd could not say)",
			func(fenceCombo) bool { return true }, "look again later: what holds it here ends (found by the model checker)", step(ReapRetry)},
	}
}

func fenceTable(t *testing.T) [][]string {
	return table(t, "reap fence", "Q", fenceCombos(), fenceRules(), func(fenceCombo) outcome { return outcome{} },
		func(fenceCombo, outcome) string { return "" })
}
