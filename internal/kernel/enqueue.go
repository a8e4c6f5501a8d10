package kernel

import "time"

// EnqueueRequest is what an enqueue asks: a record in flight with no
// owner, an abandoned claim nobody held, whose checkpoint is Data, unless
// the key has a live record.
type EnqueueRequest struct {
	Key         string
	Fingerprint [32]byte
	Attempt     string // the record's attempt id (random: nobody holds it)
	Data        []byte
	Existing    bool  // write only over a live record (Routed WithoutCreate)
	OverMoved   bool  // replace a Moved record (Routed ReplaceMoved)
	SetRev      int64 // the shard set to compare (0: the store's)
	// Value, when set, makes the write land only while that value (its
	// etcd key) is at ValueRev, and moves the value to a new revision in
	// the same Txn (for ValueRev other than 0): with ValueTo as its
	// content when set, else unchanged.
	Value    string
	ValueRev int64
	ValueTo  []byte
}

// Enqueue is the machine of an enqueue.
type Enqueue struct {
	cfg     Config
	req     EnqueueRequest
	cur     *Record
	known   bool
	round   int
	tries   int
	maybe   bool
	expect  *Record // the record the write replaces (nil: none)
	sent    *Record
	sentG   guarded
	txn     *Txn
	wait    time.Duration
	lastErr error
	full    error
	phase   enqueuePhase
	ans     Answer
}

type enqueuePhase uint8

const (
	enqJudge enqueuePhase = iota
	enqRead
	enqSend
	enqFull
	enqFullJudge
	enqDone
)

// NewEnqueue returns the machine of an enqueue.
func NewEnqueue(cfg Config, req EnqueueRequest) *Enqueue { return &Enqueue{cfg: cfg, req: req} }

// Answer returns how the enqueue ended: Landed (Record, as written),
// Found (the live record found), Mismatch, IsMoved, NotFound,
// SetChanged, ValueChanged, KeptChanging or Error.
func (m *Enqueue) Answer() Answer { return m.ans }

// Next returns what the caller must do next.
func (m *Enqueue) Next(v View) Action {
	switch m.phase {
	case enqDone:
		return Action{Kind: ActDone}
	case enqRead, enqFull:
		return Action{Kind: ActRead}
	case enqSend:
		return Action{Kind: ActSend, Txn: m.txn}
	case enqFullJudge:
		return m.readOnly(v.Now)
	}
	if m.round >= MaxRounds {
		return m.end(Answer{Verdict: KeptChanging})
	}
	if m.req.Existing && !m.known {
		m.phase = enqRead
		return m.act(Action{Kind: ActRead})
	}
	if m.req.Existing && !m.cur.Live(v.Now) {
		return m.end(Answer{Verdict: NotFound})
	}
	cmps := []Cmp{Absent(m.req.Key)}
	m.expect = nil
	if cur := m.cur; m.known && cur != nil {
		switch {
		case cur.Expired(v.Now), m.req.OverMoved && cur.State == Moved:
			cmps, m.expect = []Cmp{Modified(m.req.Key, cur.Revision)}, cur // a new operation
		case cur.State == Moved:
			return m.end(Answer{Verdict: IsMoved, Record: cur})
		case cur.Fingerprint != m.req.Fingerprint:
			return m.end(Answer{Verdict: Mismatch, Record: cur})
		default:
			return m.end(Answer{Verdict: Found, Record: cur})
		}
	}
	return m.act(m.write(v, cmps))
}

// act adds a pending backoff to the action.
func (m *Enqueue) act(a Action) Action {
	a.Wait, a.Err, m.wait = m.wait, m.lastErr, 0
	return a
}

// write builds the enqueue's Txn.
func (m *Enqueue) write(v View, cmps []Cmp) Action {
	now := v.Now
	rec := &Record{State: InFlight, Fingerprint: m.req.Fingerprint, Attempt: m.req.Attempt,
		Created: now, Expires: now.Add(m.cfg.Retention), Checkpoint: m.req.Data, Kind: KindJob}
	then := []Op{PutRecord(m.req.Key, rec)}
	if m.req.Value != "" {
		cmps = append(cmps, Modified(m.req.Value, m.req.ValueRev))
		switch {
		case m.req.ValueTo != nil:
			then = append(then, Op{Kind: Put, Key: m.req.Value, Value: m.req.ValueTo, Lease: KeepLease})
		case m.req.ValueRev != 0:
			// The record and the value's new revision land together: a
			// decision made at ValueRev that the record is absent (a
			// compare-and-set of the value) cannot land beside it.
			then = append(then, Op{Kind: Put, Key: m.req.Value, KeepValue: true, Lease: KeepLease})
		}
	}
	rec.Epoch = v.Epoch // a shard's, or one a restore raised (0: none)
	cmps, m.sentG = m.cfg.guard(cmps, v, m.req.SetRev)
	els := []Op{Read(m.req.Key)}
	if m.sentG.on {
		els = append(els, m.sentG.reads(m.cfg.Keys)...)
	}
	m.round++
	m.sent, m.phase = rec, enqSend
	m.txn = &Txn{If: cmps, Then: then, Else: els}
	return Action{Kind: ActSend, Txn: m.txn}
}

// Read feeds the record read (nil: absent).
func (m *Enqueue) Read(rec *Record) {
	if m.phase == enqFull {
		m.cur, m.phase = rec, enqFullJudge
		return
	}
	m.cur, m.known, m.phase = rec, true, enqJudge
}

// readOnly answers while etcd refuses every Put: a key already enqueued
// (or done) is answered from a read.
func (m *Enqueue) readOnly(now time.Time) Action {
	if got := m.cur; got.Live(now) && got.Fingerprint == m.req.Fingerprint {
		return m.end(Answer{Verdict: Found, Record: got})
	}
	return m.end(Answer{Verdict: Error, Err: m.full})
}

// Sent feeds what became of the enqueue's Txn.
func (m *Enqueue) Sent(r Reply) Notes {
	switch r.Delivery {
	case Applied:
		rec := new(*m.sent) // a copy: the record sent is shared with the Txn
		rec.Revision, rec.Token, rec.Lease = r.Rev, TokenOf(rec.Epoch, r.Rev), r.Lease
		rec.Expires, rec.Created = Millis(rec.Expires), Millis(rec.Created)
		m.end(Answer{Verdict: Landed, Record: rec})
		return Notes{}
	case Full:
		m.full, m.phase = r.Err, enqFull
		return Notes{}
	case Failed:
		m.failed(r)
		return Notes{}
	}
	n, moved := m.sentG.learn(r)
	if moved {
		m.end(Answer{Verdict: SetChanged, Set: r.Set})
		return n
	}
	m.cur, m.known, m.phase = r.Cur, true, enqJudge
	if m.req.Value != "" && !n.NewEpoch && (r.Cur == nil && m.expect == nil || r.Cur != nil && m.expect != nil && r.Cur.Revision == m.expect.Revision) {
		// The record was as this round expected (absent, or the same
		// expired one) and so was the epoch, so the compare that failed
		// is the value's. (An epoch that moved is learnt: the write goes
		// again, and the value's compare is judged then.)
		m.end(Answer{Verdict: ValueChanged})
	}
	return n
}

func (m *Enqueue) failed(r Reply) {
	err := r.Err
	switch {
	case r.MayHaveLanded:
		m.maybe = true
	case m.maybe && r.NotSent:
		err = earlier(err)
	}
	if !r.Retry || m.tries >= MaxTries {
		m.end(Answer{Verdict: Error, Err: err, EarlierMayHaveLanded: m.maybe})
		return
	}
	m.tries++
	m.wait, m.lastErr = Backoff(m.tries), err
	m.known, m.phase = false, enqJudge // the write may have landed: read what is there
}

func (m *Enqueue) end(a Answer) Action {
	m.ans, m.phase = a, enqDone
	return Action{Kind: ActDone}
}
