package kernel

import "time"

// View is the caller's view of its world when it asks for the next
// action: its clock, the shard epoch and set it believes in, and which
// claims of the key this process holds.
type View struct {
	Now    time.Time
	Epoch  int64 // the epoch the store last saw: a shard's, or one raised after a restore (0: none)
	SetRev int64 // the revision of the shard set the store last read
	// HeldHere reports whether this process holds attempt of the key:
	// runs its work, or holds its outcome while its final write is
	// pending. Nil: none.
	HeldHere func(attempt string) bool
}

func (v View) heldHere(attempt string) bool { return v.HeldHere != nil && v.HeldHere(attempt) }

// ClaimRequest is what a claim asks for.
type ClaimRequest struct {
	Key         string // the record's etcd key
	Fingerprint [32]byte
	Owner       string // the session's owner id, or DeadlineOwner
	Attempt     string
	Deadline    time.Duration // 0: none
	Wait        bool          // wait while a live owner runs the key, instead of a conflict
	Existing    bool          // take only a live record (WithoutCreate)
	OverMoved   bool          // replace a Moved record as stale (ReplaceMoved)
	Fence       bool          // the reaper's fence: write the claim abandoned
	SetRev      int64         // the shard set to compare (UnderShardSet; 0: the store's)
}

// ActionKind is what the caller of a machine must do next.
type ActionKind uint8

// The actions.
const (
	ActDone  ActionKind = iota // the operation has its answer
	ActRead                    // read the record linearizably, then Read
	ActOwner                   // read whether Action.Owner's key exists, linearizably, then Owner
	ActAwait                   // wait until the record changes from Action.Rec (as of Action.Rev; the owner as of Action.OwnerRev), then Awaited
	ActSend                    // send Action.Txn, then Sent
)

// Action is the next step of a machine.
type Action struct {
	Kind     ActionKind
	Txn      *Txn
	Owner    string
	Rec      *Record
	Rev      int64
	OwnerRev int64
	// Wait, when above 0, asks the caller to wait that long before the
	// action (a retry's backoff). If the wait is cut short (its context
	// ended), the operation fails with Err.
	Wait time.Duration
	Err  error
}

// Verdict is how an operation ended.
type Verdict uint8

// The verdicts.
const (
	Won          Verdict = iota + 1 // the claim is the caller's: run the work
	Replay                          // the key is done with the same fingerprint: replay Record's outcome
	Mismatch                        // the key names another operation (another fingerprint): never run, never replay
	Conflict                        // in flight under a live owner (Record, nil when it kept changing)
	IsMoved                         // a Moved record: the key lives on Record.MovedTo
	NotFound                        // no live record, and the request creates none
	SessionGone                     // the claim's session ended: its owner key is gone
	SetChanged                      // the shard set moved since the caller routed: route again (Set)
	Error                           // etcd could not say: Err, the last try's error
	Landed                          // a claim's write landed (or was recognised as landed)
	Expired                         // a claim's in-flight write comes past its record's expiry
	Fenced                          // the record is no longer the claim's
	Ended                           // the claim was ended through another handle (Why)
	KeptChanging                    // the claim's record kept changing under its write
	ValueChanged                    // an enqueue's value moved
	Found                           // the key has a live record (Record): nothing was written
)

// Answer is how an operation ended.
type Answer struct {
	Verdict  Verdict
	Record   *Record // Won: as written or recognised; Replay, Conflict, IsMoved: as read
	Previous *Record // Won: the stale record it replaced, if any
	Set      SetValue
	Err      error
	// EarlierMayHaveLanded: an earlier try of the operation's write may
	// have landed although the operation failed.
	EarlierMayHaveLanded bool
	Why                  string
	// Wrote: the operation's own write was applied (answered), not
	// recognised from a read.
	Wrote bool
}

type claimPhase uint8

const (
	claimJudge     claimPhase = iota // judge the record (or read it first)
	claimRead                        // waiting for Read
	claimOwner                       // waiting for Owner
	claimTakeover                    // the owner is gone: write the takeover
	claimAwait                       // waiting for Awaited
	claimSend                        // waiting for Sent
	claimFull                        // etcd is full: waiting for Read
	claimFullJudge                   // etcd is full: judge the record read
	claimFullOwn                     // etcd is full: waiting for Owner
	claimDone
)

// Claim is one claim's machine: it judges the record, writes the claim,
// and recognises its own writes, until the claim is won, the key is found
// done, or a definite refusal.
type Claim struct {
	cfg Config
	req ClaimRequest

	cur     *Record       // the record as last read; nil: absent, or not read
	seenRev int64         // the revision at which cur was read
	known   bool          // cur reflects a read
	round   int           // refused writes so far
	tries   int           // failed writes so far
	backoff time.Duration // wait before the next action
	lastErr error

	ownerRev int64   // the revision of the owner read (await)
	taken    *Record // the stale record the write replaces
	ownerCmp bool    // the write requires the stale owner's key to be gone
	sent     *Record // the record of the write in flight
	sentG    guarded
	txn      *Txn
	fullErr  error // etcd's refusal for space

	// Uncertain: a write of this claim had an unknown outcome (it may
	// have landed, or land still). Seen: the highest revision the claim
	// saw etcd at: each of its writes compared a state at or before it.
	uncertain bool
	seen      int64

	phase  claimPhase
	answer Answer
}

// NewClaim returns the machine of a claim.
func NewClaim(cfg Config, req ClaimRequest) *Claim { return &Claim{cfg: cfg, req: req} }

// Uncertain reports whether a write of the claim had an unknown outcome,
// and the highest revision the claim saw etcd at: a claim that did not win
// is reaped with them (Reap).
func (m *Claim) Uncertain() (bool, int64) { return m.uncertain, m.seen }

// Request returns the request the claim was made with.
func (m *Claim) Request() ClaimRequest { return m.req }

// Next returns what the caller must do next.
func (m *Claim) Next(v View) Action {
	a := m.next(v)
	if m.backoff > 0 && a.Kind != ActDone {
		a.Wait, a.Err = m.backoff, m.lastErr
		m.backoff = 0
	}
	return a
}

func (m *Claim) next(v View) Action {
	switch m.phase {
	case claimDone:
		return Action{Kind: ActDone}
	case claimRead, claimFull:
		return Action{Kind: ActRead}
	case claimOwner, claimFullOwn:
		return Action{Kind: ActOwner, Owner: m.cur.Owner}
	case claimAwait:
		return Action{Kind: ActAwait, Rec: m.cur, Rev: m.seenRev, OwnerRev: m.ownerRev}
	case claimSend:
		return Action{Kind: ActSend, Txn: m.txn}
	case claimTakeover:
		return m.write(v)
	case claimFullJudge:
		return m.readOnly(v)
	}
	if m.round >= MaxRounds {
		return m.end(Answer{Verdict: Conflict, Record: m.cur})
	}
	if m.req.Existing && !m.known {
		m.phase = claimRead
		return Action{Kind: ActRead}
	}
	if m.req.Existing && !m.cur.Live(v.Now) {
		return m.end(Answer{Verdict: NotFound})
	}
	m.taken, m.ownerCmp = nil, false
	if !m.known || m.cur == nil {
		return m.write(v)
	}
	return m.judge(v)
}

// judge decides on a record that is there.
func (m *Claim) judge(v View) Action {
	cur, now := m.cur, v.Now
	switch {
	case cur.Expired(now), m.req.OverMoved && cur.State == Moved:
		// Retention has passed (or a Moved record here is stale): the key
		// names a new operation. Replace the record; the token still grows.
	case cur.State == Moved:
		return m.end(Answer{Verdict: IsMoved, Record: cur})
	case cur.Fingerprint != m.req.Fingerprint:
		return m.end(Answer{Verdict: Mismatch, Record: cur})
	case cur.State == Done:
		return m.end(Answer{Verdict: Replay, Record: cur})
	case m.heldByAnother(v):
		// Held by this very process: running, or finished with its final
		// write pending (its outcome is only here). Its owner is alive by
		// definition, whatever its session or deadline.
		return m.live(0)
	case cur.PastDeadline(now): // even our own: its holder may be gone
		m.taken = cur
	case cur.Owner != "" && cur.Owner == m.req.Owner && SameAttempt(cur.Attempt, m.req.Attempt):
		// Our own claim, written by an earlier try whose reply was lost.
		return m.end(Answer{Verdict: Won, Record: cur})
	case cur.Owner == "",
		// Our orphan: nobody here runs it (HeldHere said so), and without
		// a deadline it would hold the key until this process dies. A
		// claim with a deadline may be renewed through another process,
		// so only its deadline makes it stale.
		cur.Owner == m.req.Owner && cur.Deadline.IsZero():
		m.taken = cur
	case cur.Owner == DeadlineOwner:
		return m.live(0) // only its deadline makes it stale
	default:
		m.phase = claimOwner
		return Action{Kind: ActOwner, Owner: cur.Owner}
	}
	return m.write(v)
}

// live answers a record held by a live owner: a conflict, or a wait for it
// to change.
func (m *Claim) live(ownerRev int64) Action {
	if !m.req.Wait {
		return m.end(Answer{Verdict: Conflict, Record: m.cur})
	}
	m.phase, m.ownerRev = claimAwait, ownerRev
	return Action{Kind: ActAwait, Rec: m.cur, Rev: m.seenRev, OwnerRev: ownerRev}
}

// write builds the claim's Txn: the record, and the compares that make it
// land only on the state judged.
func (m *Claim) write(v View) Action {
	k := m.cfg.Keys
	var cmps []Cmp
	if !m.known || m.cur == nil {
		cmps = []Cmp{Absent(m.req.Key)}
	} else {
		if m.ownerCmp {
			cmps = append(cmps, Absent(k.Owner(m.cur.Owner)))
		}
		cmps = append(cmps, Modified(m.req.Key, m.cur.Revision))
	}
	m.round++
	rec := m.record(v.Now)
	rec.Epoch = v.Epoch // a shard's, or one a restore raised (0: none)
	cmps, m.sentG = m.cfg.guard(cmps, v, m.req.SetRev)
	els := []Op{Read(m.req.Key)}
	if m.req.Owner != DeadlineOwner {
		// A claim under a session is written only while the session's owner
		// key exists: never under a session that has ended.
		cmps = append(cmps, Exists(k.Owner(m.req.Owner)))
		els = append(els, CountOf(k.Owner(m.req.Owner)))
	}
	if m.sentG.on {
		els = append(els, m.sentG.reads(k)...)
	}
	m.sent, m.phase = rec, claimSend
	m.txn = &Txn{If: cmps, Then: []Op{PutRecord(m.req.Key, rec)}, Else: els}
	return Action{Kind: ActSend, Txn: m.txn}
}

// record is the in-flight record the claim writes at now.
func (m *Claim) record(now time.Time) *Record {
	rec := &Record{
		State:       InFlight,
		Fingerprint: m.req.Fingerprint,
		Owner:       m.req.Owner,
		Attempt:     m.req.Attempt,
		Created:     Millis(now), // as stored: the answer is the record a read returns
		Kind:        KindKey,
	}
	if m.req.Fence {
		// Written abandoned (see Reap); on a key with no record, a fence
		// that leaves it free, as if absent.
		rec.Owner = ""
		rec.Fence = m.taken == nil
	}
	if m.req.Deadline > 0 {
		rec.Deadline = Millis(now.Add(m.req.Deadline))
	}
	rec.Expires = InFlightExpiry(now, rec.Deadline, m.cfg.Retention)
	if t := m.taken; t != nil && t.State == InFlight {
		rec.Created, rec.Checkpoint, rec.Takeovers, rec.Kind = t.Created, t.Checkpoint, t.Takeovers+1, t.Kind
		// The claim taken over was held (not abandoned): it may have run.
		rec.CutShort = t.CutShort || t.Owner != ""
	}
	return rec
}

// Read feeds the record the caller read (nil: absent) at revision rev.
// The claim has seen etcd at rev: its later writes may compare what it
// read (a reaper of the claim must know; found by the model checker,
// a takeover on a key's old shard, WithoutCreate, read first).
func (m *Claim) Read(rec *Record, rev int64) {
	m.seen = max(m.seen, rev)
	if m.phase == claimFull {
		m.cur, m.phase = rec, claimFullJudge
		return
	}
	m.cur, m.seenRev, m.known, m.phase = rec, rev, true, claimJudge
}

// Owner feeds whether the owner's key exists, read at rev (err: the read
// failed).
func (m *Claim) Owner(alive bool, rev int64, err error) {
	switch {
	case m.phase == claimFullOwn && err == nil && m.own():
		// Our own claim: ours while our session lives, else it ended.
		if alive {
			m.end(Answer{Verdict: Won, Record: m.cur})
		} else {
			m.end(Answer{Verdict: SessionGone})
		}
	case m.phase == claimFullOwn && err == nil && alive:
		m.end(Answer{Verdict: Conflict, Record: m.cur})
	case m.phase == claimFullOwn:
		m.end(Answer{Verdict: Error, Err: m.fullErr})
	case err != nil:
		m.end(Answer{Verdict: Error, Err: err})
	case alive:
		m.phase = claimJudge
		m.live(rev)
	default:
		m.taken, m.ownerCmp, m.phase = m.cur, true, claimTakeover
	}
}

// Awaited feeds the record as it changed (nil: gone), read at rev.
func (m *Claim) Awaited(rec *Record, rev int64) {
	m.seen = max(m.seen, rev)
	m.cur, m.seenRev, m.phase = rec, rev, claimJudge
}

// Sent feeds what became of the claim's Txn, and returns what it taught
// the caller of its shard.
func (m *Claim) Sent(r Reply) Notes {
	switch r.Delivery {
	case Applied:
		rec := new(*m.sent) // a copy: the record sent is shared with the Txn
		rec.Revision, rec.Token, rec.Lease = r.Rev, TokenOf(rec.Epoch, r.Rev), r.Lease
		m.end(Answer{Verdict: Won, Record: rec, Previous: m.taken, Wrote: true})
		return Notes{}
	case Full:
		// etcd refuses any Txn with a Put while it is full, even when its
		// Else would run. A done key can still be replayed from a read.
		m.fullErr, m.phase = r.Err, claimFull
		return Notes{}
	case Failed:
		m.failed(r)
		return Notes{}
	}
	if r.OwnerGone {
		m.end(Answer{Verdict: SessionGone})
		return Notes{}
	}
	n, moved := m.sentG.learn(r)
	if moved {
		m.end(Answer{Verdict: SetChanged, Set: r.Set})
		return n
	}
	m.cur, m.seenRev, m.known, m.phase = r.Cur, r.Rev, true, claimJudge
	m.seen = max(m.seen, r.Rev)
	n.Found = r.Cur != nil && m.round == 1
	return n
}

// failed judges a write that got no answer: it may have landed. The claim
// reads what is there and decides again; its own claim is recognised by
// its owner and attempt id.
func (m *Claim) failed(r Reply) {
	if r.MayHaveLanded {
		m.uncertain = true
	}
	err := r.Err
	if m.uncertain && r.NotSent {
		err = earlier(err)
	}
	if !r.Retry || m.tries >= MaxTries {
		m.end(Answer{Verdict: Error, Err: err, EarlierMayHaveLanded: m.uncertain})
		return
	}
	m.tries++
	m.backoff, m.lastErr = Backoff(m.tries), err
	m.known, m.phase = false, claimJudge
}

// heldByAnother reports whether the record read is in flight under another
// attempt that this very process holds (runs it, or holds its outcome
// while saving it): its owner is alive by definition (C8).
func (m *Claim) heldByAnother(v View) bool {
	cur := m.cur
	return cur != nil && cur.Owner != "" && !SameAttempt(cur.Attempt, m.req.Attempt) && v.heldHere(cur.Attempt)
}

// own reports whether the record read is this claim's own attempt.
func (m *Claim) own() bool {
	cur := m.cur
	return cur != nil && cur.Owner != "" && cur.Owner == m.req.Owner && SameAttempt(cur.Attempt, m.req.Attempt)
}

// readOnly answers a claim from a read while etcd refuses writes, in
// judge's order: whatever judge answers without a write (not found, moved,
// a mismatch, the saved outcome, a conflict with an owner alive or held
// here, our own claim) is answered so; what needs a write (a new
// operation, a takeover of a stale claim, an orphan's) is etcd's refusal.
func (m *Claim) readOnly(v View) Action {
	cur, now := m.cur, v.Now
	switch {
	case m.req.Existing && !cur.Live(now):
		return m.end(Answer{Verdict: NotFound}) // C1, as when etcd is not full: nothing to write
	case cur == nil || cur.Expired(now), m.req.OverMoved && cur.State == Moved:
		// A new operation, or a stale Moved record to replace: a write.
	case cur.State == Moved:
		return m.end(Answer{Verdict: IsMoved, Record: cur}) // as judge: go where it names
	case cur.Fingerprint != m.req.Fingerprint:
		return m.end(Answer{Verdict: Mismatch, Record: cur})
	case cur.State == Done:
		return m.end(Answer{Verdict: Replay, Record: cur})
	case m.heldByAnother(v):
		// Held by this very process (C8): its owner is alive by
		// definition, whatever its deadline (its renewals are refused too).
		return m.end(Answer{Verdict: Conflict, Record: cur})
	case cur.PastDeadline(now):
		// Stale, even our own: a takeover, a write.
	case m.own():
		// Our own claim, written by an earlier try whose reply was lost:
		// ours, as when etcd is not full (nothing needs writing), if its
		// session lives: a write would compare the owner key (its Else
		// reads it), so the read does too (a claim without a session has
		// none).
		if cur.Owner == DeadlineOwner {
			return m.end(Answer{Verdict: Won, Record: cur})
		}
		m.phase = claimFullOwn
		return Action{Kind: ActOwner, Owner: cur.Owner}
	case cur.Owner == "", cur.Owner == m.req.Owner && cur.Deadline.IsZero():
		// Abandoned, or our orphan (nobody here runs it): a takeover.
	case cur.Owner == DeadlineOwner:
		return m.end(Answer{Verdict: Conflict, Record: cur}) // only its deadline makes it stale
	default:
		// Another session's: a conflict if its owner lives (it may still
		// save its outcome); a dead owner's would be taken over, a write.
		m.phase = claimFullOwn
		return Action{Kind: ActOwner, Owner: cur.Owner}
	}
	return m.end(Answer{Verdict: Error, Err: m.fullErr})
}

// end gives the claim its answer.
func (m *Claim) end(a Answer) Action {
	m.answer, m.phase = a, claimDone
	return Action{Kind: ActDone}
}

// Answer returns how the claim ended (valid once Next returns ActDone).
func (m *Claim) Answer() Answer { return m.answer }
