package kernel

import "time"

// Held is a claim as the process that holds it knows it.
type Held struct {
	Key         string // the record's etcd key
	Fingerprint [32]byte
	Owner       string
	Attempt     string
	Token       int64
	Rev         int64 // the ModRevision of the claim's last write: the fence
	Created     time.Time
	Deadline    time.Time
	Expires     time.Time // its record's expiry: the claim ends then too
	Checkpoint  []byte
	Takeovers   int
	CutShort    bool
	Kind        Kind
}

// HeldBy is the claim that rec, won (or recognised) by a claim, gives its
// holder.
func HeldBy(key string, rec *Record) Held {
	return Held{Key: key, Fingerprint: rec.Fingerprint, Owner: rec.Owner, Attempt: rec.Attempt, Token: rec.Token,
		Rev: rec.Revision, Created: rec.Created, Deadline: rec.Deadline, Expires: rec.Expires,
		Checkpoint: rec.Checkpoint, Takeovers: rec.Takeovers, CutShort: rec.CutShort, Kind: rec.Kind}
}

// WriteKind is what a claim's write does.
type WriteKind uint8

// The writes of a claim.
const (
	Checkpoint WriteKind = iota + 1 // save a recovery point
	Complete                        // save the outcome: the record is done
	Abandon                         // give the claim up for the next claimant: no owner
	Release                         // delete the record: a retry runs the work again
	Renew                           // move the deadline
)

// Final reports whether the write ends the claim.
func (k WriteKind) Final() bool { return k == Complete || k == Abandon || k == Release }

func (k WriteKind) String() string {
	return [...]string{"", "checkpoint", "complete", "abandon", "release", "renew"}[k]
}

// WriteRequest is one write of a claim.
type WriteRequest struct {
	Kind       WriteKind
	Checkpoint []byte    // Checkpoint
	Outcome    *Outcome  // Complete
	Deadline   time.Time // Renew
}

// Write is the machine of one fenced write of a claim: If(ModRevision ==
// the claim's last write). It retries while the outcome is unknown, and
// recognises its own earlier writes: only this claim writes records with
// its token and attempt id.
type Write struct {
	cfg   Config
	h     Held
	req   WriteRequest
	try   int
	maybe bool          // a try may have landed
	wait  time.Duration // before the next try
	err   error         // the last try's error
	want  *Record
	txn   *Txn
	full  error
	phase writePhase
	ans   Answer
	// End is set once the write's answer ends the claim in its process:
	// its cause (nil: the claim stays held).
	ends bool
}

type writePhase uint8

const (
	writeNext writePhase = iota
	writeSend
	writeFull // etcd is full: waiting for Read
	writeDone
)

// NewWrite returns the machine of write req of claim h.
func NewWrite(cfg Config, h Held, req WriteRequest) *Write { return &Write{cfg: cfg, h: h, req: req} }

// Held returns the claim as the write left it: what landed of it (its
// fence, checkpoint and deadline).
func (m *Write) Held() Held { return m.h }

// Ends reports whether the write's answer ends the claim in its process.
func (m *Write) Ends() bool { return m.ends }

// Answer returns how the write ended: Landed, Expired, Fenced, Ended (by
// another handle: Why), KeptChanging, or Error (the claim stays held).
func (m *Write) Answer() Answer { return m.ans }

// record is the claim's in-flight record as of now.
func (m *Write) record(now time.Time) *Record {
	h := m.h
	return &Record{
		State: InFlight, Fingerprint: h.Fingerprint, Owner: h.Owner, Attempt: h.Attempt, Token: h.Token,
		Created: h.Created, Expires: InFlightExpiry(now, h.Deadline, m.cfg.Retention), Deadline: h.Deadline,
		Checkpoint: h.Checkpoint, Takeovers: h.Takeovers, CutShort: h.CutShort, Kind: h.Kind,
	}
}

// wanted is the record the write puts at now (nil: a delete).
func (m *Write) wanted(now time.Time) *Record {
	if m.req.Kind == Release {
		return nil
	}
	r := m.record(now)
	switch m.req.Kind {
	case Checkpoint:
		r.Checkpoint = m.req.Checkpoint
	case Complete:
		r.State, r.Outcome, r.Checkpoint = Done, m.req.Outcome, nil
	case Abandon:
		r.Owner, r.Deadline = "", time.Time{}
	case Renew:
		r.Deadline = m.req.Deadline
		r.Expires = InFlightExpiry(now, r.Deadline, m.cfg.Retention)
	}
	return r
}

// Next returns what the caller must do next.
func (m *Write) Next(v View) Action {
	switch m.phase {
	case writeDone:
		return Action{Kind: ActDone}
	case writeSend:
		return Action{Kind: ActSend, Txn: m.txn}
	case writeFull:
		return Action{Kind: ActRead}
	}
	m.want = m.wanted(v.Now)
	if w := m.want; w != nil && w.State == InFlight && !m.h.Expires.IsZero() && !v.Now.Before(m.h.Expires) {
		// The claim's record is past its expiry, by this clock: others
		// treat it as absent, and the claim ended with it. An in-flight
		// write now would bring the forgotten record back; a Complete or a
		// Release still goes, as an outcome that happened is better saved.
		return m.end(Answer{Verdict: Expired, EarlierMayHaveLanded: m.maybe}, true)
	}
	then := Del(m.h.Key)
	if m.want != nil {
		then = PutRecord(m.h.Key, m.want)
	}
	m.txn = &Txn{If: []Cmp{Modified(m.h.Key, m.h.Rev)}, Then: []Op{then}, Else: []Op{Read(m.h.Key)}}
	m.phase = writeSend
	a := Action{Kind: ActSend, Txn: m.txn, Wait: m.wait, Err: m.err}
	m.wait = 0
	return a
}

// Sent feeds what became of the write's Txn.
func (m *Write) Sent(r Reply) {
	switch r.Delivery {
	case Applied:
		m.h.Rev = r.Rev
		if m.want != nil {
			m.adopt(m.want)
		}
		m.end(Answer{Verdict: Landed}, m.req.Kind.Final())
	case Full:
		if w := m.want; w != nil && (w.State == Done || w.Owner == "") {
			// etcd over its quota refuses every Txn with a Put, even one
			// whose compare fails: an earlier try of this Complete or
			// Abandon that landed (its reply lost) is known only by a read.
			m.full, m.phase = r.Err, writeFull
			return
		}
		m.failed(r)
	case Failed:
		m.failed(r)
	default:
		m.refused(r.Cur)
	}
}

// Read feeds the record read while etcd is full (nil: absent; err: the
// read failed).
func (m *Write) Read(cur *Record, err error) {
	w := m.want
	if err == nil && cur != nil && cur.Token == m.h.Token {
		switch {
		case w.State == Done && cur.State == Done && SameOutcome(cur.Outcome, w.Outcome):
			m.h.Rev = cur.Revision
			m.end(Answer{Verdict: Landed}, true) // our Complete landed
			return
		case w.State == InFlight && cur.State == InFlight && cur.Owner == "" && SameAttempt(cur.Attempt, m.h.Attempt):
			m.h.Rev = cur.Revision
			m.adopt(cur)
			m.end(Answer{Verdict: Landed}, true) // our Abandon landed
			return
		}
	}
	m.failed(Reply{Delivery: Failed, Err: m.full})
}

// failed judges a try that got no answer: retried while it may be, and
// while the claim is held.
func (m *Write) failed(r Reply) {
	err := r.Err
	switch {
	case r.MayHaveLanded:
		m.maybe = true
	case m.maybe && r.NotSent:
		err = earlier(err) // this try never left, but an earlier one may have landed
	}
	if !r.Retry || m.try >= MaxTries-1 {
		m.end(Answer{Verdict: Error, Err: err, EarlierMayHaveLanded: m.maybe}, false) // the claim stays held
		return
	}
	m.wait, m.err = Backoff(m.try), err
	m.try++
	m.phase = writeNext
}

// refused judges the record a refused write found. This claim's record
// has its token (a done record keeps no attempt id: no other claim of the
// key can have its token) and attempt id.
func (m *Write) refused(cur *Record) {
	w := m.want
	mine := cur != nil && cur.Token == m.h.Token && (cur.State == Done || SameAttempt(cur.Attempt, m.h.Attempt))
	switch {
	case mine && cur.State == InFlight && cur.Owner == "":
		m.h.Rev = cur.Revision
		m.adopt(cur)
		if w != nil && w.State == InFlight && w.Owner == "" {
			m.end(Answer{Verdict: Landed}, true) // our Abandon landed although its reply was lost
			return
		}
		m.end(Answer{Verdict: Ended, Why: "abandoned"}, true) // by this claim through another handle
	case mine && cur.State == InFlight:
		// An earlier write of this claim landed although its reply was
		// lost (or another handle of this claim wrote): adopt it.
		m.h.Rev = cur.Revision
		m.adopt(cur)
		if w != nil && w.State == InFlight && sameInFlight(cur, w) {
			m.end(Answer{Verdict: Landed}, false) // this very write landed (a checkpoint or a renewal)
			return
		}
		if m.try >= MaxTries-1 {
			m.end(Answer{Verdict: KeptChanging}, false)
			return
		}
		m.try++
		m.phase = writeNext // write again, on top of what landed
	case mine && cur.State == Done:
		m.h.Rev = cur.Revision
		if w != nil && w.State == Done && SameOutcome(cur.Outcome, w.Outcome) {
			m.end(Answer{Verdict: Landed}, true) // our Complete landed
			return
		}
		m.end(Answer{Verdict: Ended, Why: "completed with another outcome"}, true)
	case cur == nil && w == nil:
		m.end(Answer{Verdict: Landed}, true) // nothing of ours is left to release
	default:
		m.end(Answer{Verdict: Fenced}, true)
	}
}

// adopt makes rec, written by this claim, the claim's state: its
// checkpoint and deadline (the fence is set by the caller).
func (m *Write) adopt(rec *Record) {
	m.h.Checkpoint, m.h.Deadline, m.h.Expires = rec.Checkpoint, rec.Deadline, rec.Expires
}

func (m *Write) end(a Answer, ends bool) Action {
	m.ans, m.ends, m.phase = a, ends, writeDone
	return Action{Kind: ActDone}
}
