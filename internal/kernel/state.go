package kernel

import (
	"encoding/binary"
	"sort"
)

// A machine's state can be cloned and written canonically, so that a
// model checker can fork it and tell states apart by their encoding.
// Records and Txns are never changed once a machine has built or been
// handed them, so a clone shares them.

// Clone returns an independent copy of the machine.
func (m *Claim) Clone() *Claim { c := *m; return &c }

// Clone returns an independent copy of the machine.
func (m *Write) Clone() *Write { c := *m; return &c }

// Clone returns an independent copy of the machine.
func (m *Enqueue) Clone() *Enqueue { c := *m; return &c }

// Clone returns an independent copy of the machine.
func (m *Forward) Clone() *Forward { c := *m; return &c }

// AppendState appends a canonical encoding of the machine's state.
func (m *Claim) AppendState(b []byte) []byte {
	b = appendInts(b, int64(m.phase), int64(m.round), int64(m.tries), int64(m.backoff), m.seenRev, m.ownerRev, m.seen)
	b = appendBools(b, m.known, m.ownerCmp, m.uncertain)
	b = appendRecords(b, m.cur, m.taken, m.sent)
	b = m.txn.AppendState(b)
	b = appendErrs(b, m.lastErr, m.fullErr)
	return m.answer.AppendState(b)
}

// AppendState appends a canonical encoding of the machine's state.
func (m *Write) AppendState(b []byte) []byte {
	b = appendInts(b, int64(m.phase), int64(m.try), int64(m.wait))
	b = appendBools(b, m.maybe, m.ends)
	b = m.h.AppendState(b)
	b = appendRecords(b, m.want)
	b = m.txn.AppendState(b)
	b = appendErrs(b, m.err, m.full)
	return m.ans.AppendState(b)
}

// AppendState appends a canonical encoding of the machine's state.
func (m *Enqueue) AppendState(b []byte) []byte {
	b = appendInts(b, int64(m.phase), int64(m.round), int64(m.tries), int64(m.wait))
	b = appendBools(b, m.known, m.maybe)
	b = appendRecords(b, m.cur, m.expect, m.sent)
	b = m.txn.AppendState(b)
	b = appendErrs(b, m.lastErr, m.full)
	return m.ans.AppendState(b)
}

// AppendState appends a canonical encoding of the machine's state.
func (m *Forward) AppendState(b []byte) []byte {
	b = appendInts(b, int64(m.phase), int64(m.try), int64(m.wait))
	b = appendBools(b, m.maybe)
	b = appendRecords(b, m.cur, m.sent)
	b = m.txn.AppendState(b)
	b = appendErrs(b, m.lastErr)
	return m.ans.AppendState(b)
}

// AppendState appends a canonical encoding of the claim.
func (h Held) AppendState(b []byte) []byte {
	b = appendStrings(b, h.Key, h.Owner, h.Attempt, string(h.Checkpoint))
	b = append(b, h.Fingerprint[:]...)
	return appendInts(b, h.Token, h.Rev, h.Created.UnixNano(), h.Deadline.UnixNano(), h.Expires.UnixNano(), int64(h.Takeovers))
}

// AppendState appends a canonical encoding of the answer.
func (a Answer) AppendState(b []byte) []byte {
	b = appendInts(b, int64(a.Verdict), a.Set.Rev)
	b = appendBools(b, a.EarlierMayHaveLanded, a.Wrote)
	b = appendStrings(b, a.Why, string(a.Set.Value))
	b = appendErrs(b, a.Err)
	return appendRecords(b, a.Record, a.Previous)
}

// AppendState appends a canonical encoding of the record (nil: absent).
func (r *Record) AppendState(b []byte) []byte {
	if r == nil {
		return append(b, 0)
	}
	b = append(b, 1, byte(r.State))
	b = append(b, r.Fingerprint[:]...)
	b = appendStrings(b, r.Owner, r.Attempt, string(r.Checkpoint), r.MovedTo)
	b = appendInts(b, r.Token, r.Created.UnixNano(), r.Expires.UnixNano(), r.Deadline.UnixNano(), int64(r.Takeovers),
		r.Epoch, r.Revision, r.Lease)
	b = appendBools(b, r.Fence)
	return r.Outcome.AppendState(b)
}

// AppendState appends a canonical encoding of the outcome (nil: none).
func (o *Outcome) AppendState(b []byte) []byte {
	if o == nil {
		return append(b, 0)
	}
	b = append(b, 1)
	b = appendInts(b, int64(o.Status))
	b = appendStrings(b, string(o.Body), o.Err)
	names := make([]string, 0, len(o.Header))
	for k := range o.Header {
		names = append(names, k)
	}
	sort.Strings(names)
	b = appendInts(b, int64(len(names)))
	for _, k := range names {
		b = appendStrings(b, k)
		b = appendStrings(b, o.Header[k]...)
	}
	return b
}

// AppendState appends a canonical encoding of the Txn (nil: none).
func (t *Txn) AppendState(b []byte) []byte {
	if t == nil {
		return append(b, 0)
	}
	b = append(b, 1)
	b = appendInts(b, int64(len(t.If)))
	for _, c := range t.If {
		b = append(b, byte(c.Target), byte(c.Result))
		b = appendStrings(b, c.Key, string(c.Value))
		b = appendInts(b, c.Num)
	}
	for _, ops := range [][]Op{t.Then, t.Else} {
		b = appendInts(b, int64(len(ops)))
		for _, o := range ops {
			b = append(b, byte(o.Kind), byte(o.Lease))
			b = appendStrings(b, o.Key, string(o.Value))
			b = appendBools(b, o.KeepValue)
			b = appendInts(b, o.Until.UnixNano(), o.ID)
			b = o.Record.AppendState(b)
			b = o.Txn.AppendState(b)
		}
	}
	return b
}

func appendInts(b []byte, ns ...int64) []byte {
	for _, n := range ns {
		b = binary.AppendVarint(b, n)
	}
	return b
}

func appendBools(b []byte, vs ...bool) []byte {
	var bits byte
	for i, v := range vs {
		if v {
			bits |= 1 << i
		}
	}
	return append(b, bits)
}

func appendStrings(b []byte, ss ...string) []byte {
	b = binary.AppendUvarint(b, uint64(len(ss)))
	for _, s := range ss {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return b
}

func appendRecords(b []byte, rs ...*Record) []byte {
	for _, r := range rs {
		b = r.AppendState(b)
	}
	return b
}

func appendErrs(b []byte, errs ...error) []byte {
	for _, err := range errs {
		if err == nil {
			b = append(b, 0)
			continue
		}
		b = appendStrings(append(b, 1), err.Error())
	}
	return b
}
