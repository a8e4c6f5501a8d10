package kernel

import (
	"slices"
	"testing"
	"time"
)

// The claim's decision, by the record it reads.

type recKind uint8

const (
	recAbsent recKind = iota
	recFence
	recMoved
	recDone
	recInFlight
)

var recNames = [...]string{"absent", "fence", "moved", "done", "in flight"}

type ownerKind uint8

const (
	ownMine      ownerKind = iota // the claimant's own owner and attempt
	ownMineOther                  // the claimant's owner (session), another attempt
	ownOther                      // another session
	ownNone                       // abandoned: no owner
	ownDeadline                   // a claim without a session (DeadlineOwner), not the claimant's
)

type dlKind uint8

const (
	dlNone dlKind = iota
	dlFuture
	dlPast
)

// claimCombo is one combination of a claim's inputs.
type claimCombo struct {
	rec       recKind
	fpOther   bool
	expired   bool
	owner     ownerKind
	deadline  dlKind
	heldHere  bool // the record's attempt is held by this process (another than the claimant's)
	alive     bool // the other owner's liveness, when read
	wait      bool
	existing  bool
	overMoved bool
	fence     bool
	reqDL     bool // the claim asks for a deadline
	noSession bool // the claim is made WithoutSession
	epochs    bool
}

func claimCombos() []claimCombo {
	var out []claimCombo
	for _, base := range recordCombos() {
		for flags := range 1 << 7 {
			c := base
			c.wait, c.existing, c.overMoved, c.fence = flags&1 != 0, flags&2 != 0, flags&4 != 0, flags&8 != 0
			c.reqDL, c.noSession, c.epochs = flags&16 != 0, flags&32 != 0, flags&64 != 0
			if c.noSession && (c.fence || !c.reqDL || c.owner == ownDeadline) {
				continue // WithoutSession needs a deadline; the reaper fences only session claims; its owner is DeadlineOwner
			}
			out = append(out, c)
		}
	}
	return out
}

// recordCombos are the records a claim may read.
func recordCombos() []claimCombo {
	out := []claimCombo{{rec: recAbsent}, {rec: recFence}}
	for _, fp := range []bool{false, true} {
		for _, exp := range []bool{false, true} {
			out = append(out, claimCombo{rec: recMoved, fpOther: fp, expired: exp}, claimCombo{rec: recDone, fpOther: fp, expired: exp})
			for o := ownMine; o <= ownDeadline; o++ {
				for d := dlNone; d <= dlPast; d++ {
					for _, held := range []bool{false, true} {
						for _, alive := range []bool{false, true} {
							if alive && o != ownOther || held && (o == ownMine || o == ownNone) {
								continue // asked of another session only; another attempt only
							}
							out = append(out, claimCombo{rec: recInFlight, fpOther: fp, expired: exp, owner: o, deadline: d, heldHere: held, alive: alive})
						}
					}
				}
			}
		}
	}
	return out
}

func (c claimCombo) reqOwner() string {
	if c.noSession {
		return DeadlineOwner
	}
	return tMe
}

// record is the record the combination reads (nil: absent).
func (c claimCombo) record() *Record {
	r := &Record{State: InFlight, Fingerprint: tFP, Token: tRev, Revision: tRev, Created: tNow.Add(-time.Hour),
		Expires: tNow.Add(time.Hour), Checkpoint: []byte("step 2"), Takeovers: 2, Epoch: tEpoch}
	if c.fpOther {
		r.Fingerprint = tFP2
	}
	if c.expired {
		r.Expires = tNow.Add(-time.Second)
	}
	switch c.rec {
	case recAbsent:
		return nil
	case recFence:
		r.Fence, r.Checkpoint = true, nil
		return r
	case recMoved:
		r.State, r.MovedTo, r.Checkpoint = Moved, "b", nil
		return r
	case recDone:
		r.State, r.Outcome, r.Checkpoint = Done, &Outcome{Body: []byte("ch_1")}, nil
		return r
	}
	r.Owner, r.Attempt = c.reqOwner(), tAtt
	switch c.owner {
	case ownMineOther:
		r.Attempt = tAtt2
	case ownOther:
		r.Owner, r.Attempt = tOther, tAtt2
	case ownNone:
		r.Owner, r.Attempt = "", tAtt2
	case ownDeadline:
		r.Owner, r.Attempt = DeadlineOwner, tAtt2
	}
	switch c.deadline {
	case dlFuture:
		r.Deadline = tNow.Add(time.Minute)
	case dlPast:
		r.Deadline = tNow.Add(-time.Second)
	}
	return r
}

func (c claimCombo) live() bool {
	return c.rec != recAbsent && c.rec != recFence && c.rec != recMoved && !c.expired
}

func (c claimCombo) view() View {
	v := View{Now: tNow, HeldHere: func(a string) bool { return a == tAtt || c.heldHere }}
	if c.epochs {
		v.Epoch, v.SetRev = tEpoch, tSet
	}
	return v
}

func (c claimCombo) request() ClaimRequest {
	r := ClaimRequest{Key: tKey, Fingerprint: tFP, Owner: c.reqOwner(), Attempt: tAtt,
		Wait: c.wait, Existing: c.existing, OverMoved: c.overMoved, Fence: c.fence}
	if c.reqDL {
		r.Deadline = 30 * time.Second
	}
	return r
}

// decideClaim runs the claim machine to its decision on the combination's
// record: an answer, a wait, or the Txn it writes.
func decideClaim(c claimCombo) outcome {
	cfg := Config{Keys: tKeys, Retention: tRet, Epochs: c.epochs}
	m := NewClaim(cfg, c.request())
	v := c.view()
	a := m.Next(v)
	switch {
	case a.Kind == ActRead:
		m.Read(c.record(), tRead)
		a = m.Next(v)
	case a.Kind == ActSend && c.rec != recAbsent:
		// The first write assumes no record: its Else read the one there.
		m.Sent(Reply{Delivery: Refused, Rev: tRead, Cur: c.record(), Epoch: v.Epoch, Set: SetValue{Rev: v.SetRev}})
		a = m.Next(v)
	}
	var o outcome
	if a.Kind == ActOwner {
		o.owner = a.Owner
		m.Owner(c.alive || a.Owner == c.reqOwner(), tRead+1, nil) // the claimant's own session lives
		a = m.Next(v)
	}
	switch a.Kind {
	case ActDone:
		o.answer = m.Answer()
		o.verdict = o.answer.Verdict
	case ActAwait:
		o.await, o.ownerRev = true, a.OwnerRev
	case ActSend:
		o.txn = a.Txn
	}
	return o
}

// The claim's rules, in the order the first that holds decides.
func claimRules() []rule[claimCombo] {
	conflict := func(t *testing.T, c claimCombo, got outcome, ownerRev int64) {
		switch {
		case c.wait && (!got.await || got.ownerRev != ownerRev):
			t.Errorf("want a wait on the record (owner read at %d), got %+v", ownerRev, got)
		case !c.wait && got.verdict != Conflict:
			t.Errorf("want Conflict, got %+v", got)
		}
	}
	answer := func(v Verdict) func(*testing.T, claimCombo, outcome) {
		return func(t *testing.T, c claimCombo, got outcome) {
			if got.verdict != v || got.txn != nil || got.owner != "" {
				t.Errorf("want %v without a write, got %+v", v, got)
			}
			if v == Won && got.answer.Wrote {
				t.Errorf("a recognised claim wrote nothing, got Wrote")
			}
		}
	}
	return []rule[claimCombo]{
		{"`WithoutCreate` (a key's old shard), and no live record (absent, expired, a fence, Moved)",
			func(c claimCombo) bool { return c.existing && !c.live() },
			"not found: nothing is written", answer(NotFound)},
		{"no record",
			func(c claimCombo) bool { return c.rec == recAbsent },
			"claim: a new operation (the reaper's fence writes a placeholder that leaves the key free)",
			checkWrite(writeNew)},
		{"a fence, or the record's retention passed",
			func(c claimCombo) bool { return c.rec == recFence || c.expired },
			"claim: a new operation replaces the record", checkWrite(writeReplace)},
		{"Moved, and the claim replaces Moved records (`ReplaceMoved`: the key's home)",
			func(c claimCombo) bool { return c.rec == recMoved && c.overMoved },
			"claim: a new operation replaces the record", checkWrite(writeReplace)},
		{"Moved", func(c claimCombo) bool { return c.rec == recMoved },
			"moved: go to the shard it names", answer(IsMoved)},
		{"the fingerprint differs", func(c claimCombo) bool { return c.fpOther },
			"mismatch: never run, never replay", answer(Mismatch)},
		{"done", func(c claimCombo) bool { return c.rec == recDone },
			"replay the saved outcome", answer(Replay)},
		{"in flight under another attempt this process holds (runs it, or holds its outcome while saving it)",
			func(c claimCombo) bool { return c.owner != ownMine && c.owner != ownNone && c.heldHere },
			"conflict (or wait, `WithWait`): its owner is alive by definition",
			func(t *testing.T, c claimCombo, got outcome) { conflict(t, c, got, 0) }},
		{"past its deadline (even the claimant's own)", func(c claimCombo) bool { return c.deadline == dlPast },
			"take over", checkWrite(writeTakeover)},
		{"the claimant's own owner and attempt (its reply was lost)", func(c claimCombo) bool { return c.owner == ownMine },
			"won: it is the claimant's, nothing is written", answer(Won)},
		{"abandoned (no owner)", func(c claimCombo) bool { return c.owner == ownNone },
			"take over", checkWrite(writeTakeover)},
		{"an orphan of this process: its session, another attempt nobody here runs, no deadline",
			func(c claimCombo) bool { return c.owner == ownMineOther && c.deadline == dlNone },
			"take over", checkWrite(writeTakeover)},
		{"held without a session (`WithoutSession`): only its deadline makes it stale",
			func(c claimCombo) bool { return c.owner == ownDeadline || c.owner == ownMineOther && c.noSession },
			"conflict (or wait)", func(t *testing.T, c claimCombo, got outcome) {
				if got.owner != "" {
					t.Errorf("a claim without a session has no owner key to read; got a read of %q", got.owner)
				}
				conflict(t, c, got, 0)
			}},
		{"another session, or its own with a deadline (it may be renewed through another process), whose owner key exists (a linearizable count-only read)",
			func(c claimCombo) bool { return c.alive || c.owner == ownMineOther },
			"conflict (or wait, from that read's revision)", func(t *testing.T, c claimCombo, got outcome) {
				if got.owner != c.record().Owner {
					t.Errorf("want a read of the owner's key, got %+v", got)
				}
				conflict(t, c, got, tRead+1)
			}},
		{"another session, whose owner key is gone", func(claimCombo) bool { return true },
			"take over, if the owner key is still gone", checkWrite(writeTakeoverDead)},
	}
}

type writeKind uint8

const (
	writeNew writeKind = iota
	writeReplace
	writeTakeover
	writeTakeoverDead
)

// checkWrite checks the Txn a claim writes: its compares, exactly, and the
// record it puts.
func checkWrite(k writeKind) func(*testing.T, claimCombo, outcome) {
	return func(t *testing.T, c claimCombo, got outcome) {
		if got.txn == nil {
			t.Errorf("want a write, got %+v", got)
			return
		}
		prev := c.record()
		var want []Cmp
		switch k {
		case writeNew:
			want = append(want, Absent(tKey))
		case writeTakeoverDead:
			want = append(want, Absent(tKeys.Owner(tOther)), Modified(tKey, tRev))
		default:
			want = append(want, Modified(tKey, tRev))
		}
		if c.epochs {
			want = append(want, ValueIs(tKeys.Epoch(), []byte("3")), Modified(tKeys.Set(), tSet))
		}
		els := []Op{Read(tKey)}
		if !c.noSession {
			want = append(want, Exists(tKeys.Owner(tMe)))
			els = append(els, CountOf(tKeys.Owner(tMe)))
		}
		if c.epochs {
			els = append(els, Read(tKeys.Epoch()), Read(tKeys.Set()))
		}
		if !slices.EqualFunc(got.txn.If, want, sameCmp) || len(got.txn.Then) != 1 || !slices.EqualFunc(got.txn.Else, els, sameOp) {
			t.Errorf("compares %v then %v else %v; want %v, a put, else %v", got.txn.If, got.txn.Then, got.txn.Else, want, els)
			return
		}
		checkClaimRecord(t, c, k, prev, got.txn.Then[0])
	}
}

// checkClaimRecord checks the record a claim puts: it names the claim, or
// is written abandoned by the reaper's fence; a takeover inherits what the
// key's operation had; a new operation starts afresh.
func checkClaimRecord(t *testing.T, c claimCombo, k writeKind, prev *Record, op Op) {
	r := op.Record
	takeover := k == writeTakeover || k == writeTakeoverDead
	owner := c.reqOwner()
	if c.fence {
		owner = ""
	}
	wantExp := tNow.Add(tRet)
	if c.reqDL {
		wantExp = tNow.Add(30*time.Second + tRet)
	}
	switch {
	case op.Kind != Put || op.Key != tKey || op.Lease != RetentionLease || !op.Until.Equal(r.Expires):
		t.Errorf("want a put of the record on the lease that outlives it, got %v", op)
	case r.State != InFlight || r.Fingerprint != tFP || r.Owner != owner || r.Attempt != tAtt || r.Token != 0:
		t.Errorf("the record names the claim (owner %q, attempt %q, token of this write): got %+v", owner, tAtt, r)
	case r.Fence != (c.fence && !takeover):
		t.Errorf("a fence placeholder only where the reaper fences a key with no operation: got Fence %v", r.Fence)
	case takeover && (r.Takeovers != prev.Takeovers+1 || string(r.Checkpoint) != string(prev.Checkpoint) || !r.Created.Equal(prev.Created)):
		t.Errorf("a takeover inherits the checkpoint and creation, and counts: got %+v from %+v", r, prev)
	case !takeover && (r.Takeovers != 0 || r.Checkpoint != nil || !r.Created.Equal(tNow) || r.CutShort):
		t.Errorf("a new operation starts afresh: got %+v", r)
	case takeover && r.CutShort != (prev.Owner != "" || prev.CutShort):
		// Issue 38: a held claim taken over (a fence's too) may have run.
		t.Errorf("a takeover of a claim held by %q is cut short %v; want it so exactly when the claim was held", prev.Owner, r.CutShort)
	case !r.Expires.Equal(wantExp) || c.reqDL != !r.Deadline.IsZero():
		t.Errorf("expires %v (want %v), deadline %v", r.Expires, wantExp, r.Deadline)
	case c.epochs && r.Epoch != tEpoch || !c.epochs && r.Epoch != 0:
		t.Errorf("the record carries the shard epoch it was written under: got %d", r.Epoch)
	}
}

func sameCmp(a, b Cmp) bool { return a.String() == b.String() }
func sameOp(a, b Op) bool   { return a.String() == b.String() }

func claimTable(t *testing.T) [][]string {
	return table(t, "claim", "C", claimCombos(), claimRules(), decideClaim, func(c claimCombo, o outcome) string {
		if o.txn == nil || c.epochs || c.noSession {
			return ""
		}
		return short(o.txn)
	})
}
