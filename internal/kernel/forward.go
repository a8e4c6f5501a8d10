package kernel

import "time"

// ForwardRequest asks to hand a key over to the shard To, unless this
// shard holds it.
type ForwardRequest struct {
	Key    string
	To     string
	SetRev int64 // the shard set to compare (0: the store's)
}

// Forward is the machine of a hand-over: when the key is absent here or
// its retention passed, it writes a Moved record naming To (replacing one
// that names another shard, left by an older shard set), after which this
// shard refuses to claim it. A live record keeps the key here.
type Forward struct {
	cfg     Config
	req     ForwardRequest
	cur     *Record
	try     int
	maybe   bool
	sent    *Record
	sentG   guarded
	txn     *Txn
	wait    time.Duration
	lastErr error
	phase   forwardPhase
	ans     Answer
}

type forwardPhase uint8

const (
	fwdRead forwardPhase = iota
	fwdJudge
	fwdSend
	fwdDone
)

// NewForward returns the machine of a hand-over. It starts with a read.
func NewForward(cfg Config, req ForwardRequest) *Forward { return &Forward{cfg: cfg, req: req} }

// Answer returns how the hand-over ended: Landed (the Moved record
// written), Found (a live record here, or a Moved record naming To),
// SetChanged, KeptChanging or Error.
func (m *Forward) Answer() Answer { return m.ans }

// Next returns what the caller must do next.
func (m *Forward) Next(v View) Action {
	switch m.phase {
	case fwdDone:
		return Action{Kind: ActDone}
	case fwdRead:
		a := Action{Kind: ActRead, Wait: m.wait, Err: m.lastErr}
		m.wait = 0
		return a
	case fwdSend:
		return Action{Kind: ActSend, Txn: m.txn}
	}
	if m.try >= MaxRounds {
		return m.end(Answer{Verdict: KeptChanging})
	}
	cur, now := m.cur, v.Now
	var cmps []Cmp
	switch {
	case cur == nil:
		cmps = []Cmp{Absent(m.req.Key)}
	case cur.Expired(now):
		cmps = []Cmp{Modified(m.req.Key, cur.Revision)}
	case cur.State == Moved && cur.MovedTo == m.req.To:
		return m.end(Answer{Verdict: Found, Record: cur})
	case cur.State == Moved:
		// Written under an older shard set (the one in force, which this
		// write compares, names To): replace it.
		cmps = []Cmp{Modified(m.req.Key, cur.Revision)}
	default:
		return m.end(Answer{Verdict: Found, Record: cur}) // the key lives here
	}
	// Times as stored (to the millisecond), so that the answer is the record
	// a read returns.
	rec := &Record{State: Moved, MovedTo: m.req.To, Epoch: v.Epoch, Created: Millis(now), Expires: Millis(now.Add(m.cfg.Retention))}
	cfg := m.cfg
	cfg.Epochs = true // a hand-over is always guarded
	cmps, m.sentG = cfg.guard(cmps, v, m.req.SetRev)
	m.sent, m.phase = rec, fwdSend
	m.txn = &Txn{If: cmps, Then: []Op{PutRecord(m.req.Key, rec)}, Else: append([]Op{Read(m.req.Key)}, m.cfg.Keys.GuardReads()...)}
	return Action{Kind: ActSend, Txn: m.txn}
}

// Read feeds the record read (nil: absent).
func (m *Forward) Read(rec *Record) { m.cur, m.phase = rec, fwdJudge }

// Sent feeds what became of the hand-over's Txn.
func (m *Forward) Sent(r Reply) Notes {
	switch r.Delivery {
	case Applied:
		rec := new(*m.sent) // a copy: the record sent is shared with the Txn
		rec.Revision, rec.Token, rec.Lease = r.Rev, TokenOf(rec.Epoch, r.Rev), r.Lease
		m.end(Answer{Verdict: Landed, Record: rec})
		return Notes{}
	case Failed, Full:
		err := r.Err
		switch {
		case r.MayHaveLanded:
			m.maybe = true
		case m.maybe && r.NotSent:
			err = earlier(err)
		}
		if !r.Retry || r.Delivery == Full {
			m.end(Answer{Verdict: Error, Err: err, EarlierMayHaveLanded: m.maybe})
			return Notes{}
		}
		m.wait, m.lastErr = Backoff(m.try), err
		m.try++
		m.phase = fwdRead // the outcome is unknown: look
		return Notes{}
	}
	m.try++
	n, moved := m.sentG.learn(r)
	if moved {
		m.end(Answer{Verdict: SetChanged, Set: r.Set})
		return n
	}
	m.cur, m.phase = r.Cur, fwdJudge
	return n
}

func (m *Forward) end(a Answer) Action {
	m.ans, m.phase = a, fwdDone
	return Action{Kind: ActDone}
}
