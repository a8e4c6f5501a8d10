package etcdstore

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/canonjson"
)

// State is a record's state.
type State string

// The two states of the seed's table.
const (
	InFlight State = "in_flight"
	Done     State = "done"
)

// Outcome is the result of a key's work, saved once and replayed to every
// retry. Status and Header are for HTTP-shaped results and may be left zero;
// Err is set when the work's failure itself was saved (policy EndSave).
type Outcome struct {
	Status int
	Header map[string][]string
	Body   []byte
	Err    string
}

// size is the outcome's contribution to the record size.
func (o *Outcome) size() int {
	n := len(o.Body) + len(o.Err)
	for k, vs := range o.Header {
		n += len(k)
		for _, v := range vs {
			n += len(v) + 4
		}
	}
	return n
}

// Record is the state of one key as stored in etcd.
type Record struct {
	Key         Key
	State       State
	Fingerprint Fingerprint
	// Owner is the owner id (session) holding an in-flight claim, or "" when
	// the claim was abandoned for the next claimant to resume.
	Owner string
	// Attempt identifies the attempt that made the current claim.
	Attempt string
	// Token is the fencing token of the current claim (or of the claim that
	// completed the record).
	Token fencing.Token
	// Created is when the key was first claimed.
	Created time.Time
	// Expires is when retention ends; the record is treated as absent after.
	Expires time.Time
	// Deadline is when an in-flight claim becomes stale even if its owner is
	// alive; zero when the claim has none.
	Deadline time.Time
	// Checkpoint is the last recovery point saved by an owner.
	Checkpoint []byte
	// Takeovers counts how often the key was taken over from a stale owner.
	Takeovers int
	// Outcome is the saved outcome of a done record.
	Outcome *Outcome
	// Revision is the etcd ModRevision of the record: the fence of the last
	// write.
	Revision int64
	// Lease is the retention lease the record is attached to.
	Lease int64
}

// recordVersion is the first byte of every encoded record. A record with an
// unknown version is never overwritten (ErrCorrupt).
const recordVersion = 1

// meta is the JSON part of an encoded record. The body of an outcome follows
// it raw, so large bodies pay no base64 tax.
type meta struct {
	State      State               `json:"s"`
	FP         string              `json:"fp"`
	Owner      string              `json:"o,omitempty"`
	Attempt    string              `json:"a,omitempty"`
	Token      int64               `json:"t,omitempty"` // 0: the revision of this write
	Created    int64               `json:"c"`           // unix ms
	Expires    int64               `json:"x"`           // unix ms
	Deadline   int64               `json:"d,omitempty"` // unix ms
	Checkpoint []byte              `json:"cp,omitempty"`
	Takeovers  int                 `json:"n,omitempty"`
	Status     int                 `json:"st,omitempty"`
	Header     map[string][][]byte `json:"hb,omitempty"` // bytes: header values need not be UTF-8
	Err        string              `json:"e,omitempty"`
}

// encode lays a record out as: version byte, uvarint length of the JSON meta,
// the meta, the outcome body. token 0 means "the revision of this write",
// which is how a claim or takeover names a token it cannot know in advance.
func encode(r *Record, token fencing.Token) []byte {
	m := meta{
		State:      r.State,
		FP:         r.Fingerprint.String(),
		Owner:      r.Owner,
		Attempt:    r.Attempt,
		Token:      int64(token),
		Created:    r.Created.UnixMilli(),
		Expires:    r.Expires.UnixMilli(),
		Checkpoint: r.Checkpoint,
		Takeovers:  r.Takeovers,
	}
	if !r.Deadline.IsZero() {
		m.Deadline = r.Deadline.UnixMilli()
	}
	var body []byte
	if o := r.Outcome; o != nil {
		m.Status, m.Err, body = o.Status, o.Err, o.Body
		if len(o.Header) > 0 {
			m.Header = make(map[string][][]byte, len(o.Header))
			for k, vs := range o.Header {
				bs := make([][]byte, len(vs))
				for i, v := range vs {
					bs[i] = []byte(v)
				}
				m.Header[k] = bs
			}
		}
	}
	js := appendMeta(make([]byte, 0, 256+len(m.Checkpoint)*4/3), &m)
	buf := make([]byte, 0, 1+binary.MaxVarintLen64+len(js)+len(body))
	buf = append(buf, recordVersion)
	buf = binary.AppendUvarint(buf, uint64(len(js)))
	buf = append(buf, js...)
	return append(buf, body...)
}

// DecodeRecord reads the record of key k from its etcd key-value, for tools
// that read idem's records from etcd directly (a watch of the prefix, a
// backup). An unknown version or a malformed record is an error wrapping
// ErrCorrupt.
func DecodeRecord(k Key, kv *mvccpb.KeyValue) (*Record, error) { return decode(k, kv) }

// decode reads a record from its etcd key-value.
func decode(k Key, kv *mvccpb.KeyValue) (*Record, error) {
	v := kv.Value
	if len(v) < 2 || v[0] != recordVersion {
		return nil, fmt.Errorf("record %s: %w: unknown version", k, ErrCorrupt)
	}
	n, w := binary.Uvarint(v[1:])
	if w <= 0 || n > uint64(len(v)-1-w) {
		return nil, fmt.Errorf("record %s: %w: bad meta length", k, ErrCorrupt)
	}
	js, body := v[1+w:1+w+int(n)], v[1+w+int(n):]
	var m meta
	if !parseMeta(js, &m) {
		// Not laid out as appendMeta writes it: read it the general way.
		m = meta{}
		if err := json.Unmarshal(js, &m); err != nil {
			return nil, fmt.Errorf("record %s: %w: %v", k, ErrCorrupt, err)
		}
	}
	r := &Record{
		Key:        k,
		State:      m.State,
		Owner:      m.Owner,
		Attempt:    m.Attempt,
		Token:      fencing.Token(m.Token),
		Created:    time.UnixMilli(m.Created),
		Expires:    time.UnixMilli(m.Expires),
		Checkpoint: m.Checkpoint,
		Takeovers:  m.Takeovers,
		Revision:   kv.ModRevision,
		Lease:      kv.Lease,
	}
	if r.Token == 0 {
		r.Token = fencing.Token(kv.ModRevision)
	}
	if m.Deadline != 0 {
		r.Deadline = time.UnixMilli(m.Deadline)
	}
	if fp, err := hex.DecodeString(m.FP); err != nil || len(fp) != len(r.Fingerprint) {
		return nil, fmt.Errorf("record %s: %w: bad fingerprint", k, ErrCorrupt)
	} else {
		copy(r.Fingerprint[:], fp)
	}
	switch m.State {
	case InFlight:
		if len(body) != 0 {
			return nil, fmt.Errorf("record %s: %w: in-flight record with a body", k, ErrCorrupt)
		}
	case Done:
		r.Outcome = &Outcome{Status: m.Status, Err: m.Err, Body: body}
		if len(m.Header) > 0 {
			r.Outcome.Header = make(map[string][]string, len(m.Header))
			for k, bs := range m.Header {
				vs := make([]string, len(bs))
				for i, b := range bs {
					vs[i] = string(b)
				}
				r.Outcome.Header[k] = vs
			}
		}
		if len(body) == 0 {
			r.Outcome.Body = nil
		}
	default:
		return nil, fmt.Errorf("record %s: %w: state %q", k, ErrCorrupt, m.State)
	}
	return r, nil
}

// toMillis rounds t down to the millisecond, the precision of times stored
// in records, so a claim's in-memory deadline equals the stored one.
func toMillis(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

// expired reports whether the record's retention has passed at now.
func (r *Record) expired(now time.Time) bool { return !now.Before(r.Expires) }

// pastDeadline reports whether an in-flight claim's deadline has passed at now.
func (r *Record) pastDeadline(now time.Time) bool {
	return !r.Deadline.IsZero() && !now.Before(r.Deadline)
}

// appendMeta writes m as the JSON encoding/json would (field order and
// omitempty as in meta's tags), without reflection: records are encoded
// twice per operation.
func appendMeta(b []byte, m *meta) []byte {
	b = append(b, `{"s":`...)
	b = canonjson.AppendString(b, string(m.State))
	b = append(b, `,"fp":`...)
	b = canonjson.AppendString(b, m.FP)
	if m.Owner != "" {
		b = append(b, `,"o":`...)
		b = canonjson.AppendString(b, m.Owner)
	}
	if m.Attempt != "" {
		b = append(b, `,"a":`...)
		b = canonjson.AppendString(b, m.Attempt)
	}
	if m.Token != 0 {
		b = strconv.AppendInt(append(b, `,"t":`...), m.Token, 10)
	}
	b = strconv.AppendInt(append(b, `,"c":`...), m.Created, 10)
	b = strconv.AppendInt(append(b, `,"x":`...), m.Expires, 10)
	if m.Deadline != 0 {
		b = strconv.AppendInt(append(b, `,"d":`...), m.Deadline, 10)
	}
	if len(m.Checkpoint) > 0 {
		b = append(b, `,"cp":"`...)
		b = base64.StdEncoding.AppendEncode(b, m.Checkpoint)
		b = append(b, '"')
	}
	if m.Takeovers != 0 {
		b = strconv.AppendInt(append(b, `,"n":`...), int64(m.Takeovers), 10)
	}
	if m.Status != 0 {
		b = strconv.AppendInt(append(b, `,"st":`...), int64(m.Status), 10)
	}
	if len(m.Header) > 0 {
		names := make([]string, 0, len(m.Header))
		for k := range m.Header {
			names = append(names, k)
		}
		sort.Strings(names)
		b = append(b, `,"hb":{`...)
		for i, k := range names {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(canonjson.AppendString(b, k), ':', '[')
			for j, v := range m.Header[k] {
				if j > 0 {
					b = append(b, ',')
				}
				b = append(b, '"')
				b = base64.StdEncoding.AppendEncode(b, v)
				b = append(b, '"')
			}
			b = append(b, ']')
		}
		b = append(b, '}')
	}
	if m.Err != "" {
		b = append(b, `,"e":`...)
		b = canonjson.AppendString(b, m.Err)
	}
	return append(b, '}')
}

// parseMeta reads meta as appendMeta writes it: its fields in that order,
// strings without escapes, no header map. It reports false on anything else,
// for encoding/json to read instead. Replays and the cache decode records
// on their hot path.
func parseMeta(b []byte, m *meta) bool {
	p := metaParser{b: b}
	if !p.lit(`{"s":`) {
		return false
	}
	st, ok := p.str()
	if !ok || !p.lit(`,"fp":`) {
		return false
	}
	m.State = State(st)
	if m.FP, ok = p.str(); !ok {
		return false
	}
	for !p.lit("}") {
		var name string
		if !p.lit(`,"`) {
			return false
		}
		if name, ok = p.name(); !ok {
			return false
		}
		switch name {
		case "o":
			m.Owner, ok = p.str()
		case "a":
			m.Attempt, ok = p.str()
		case "e":
			m.Err, ok = p.str()
		case "cp":
			var enc string
			if enc, ok = p.str(); ok {
				cp, err := base64.StdEncoding.DecodeString(enc)
				m.Checkpoint, ok = cp, err == nil
			}
		case "t":
			m.Token, ok = p.int()
		case "c":
			m.Created, ok = p.int()
		case "x":
			m.Expires, ok = p.int()
		case "d":
			m.Deadline, ok = p.int()
		case "n":
			var n int64
			n, ok = p.int()
			m.Takeovers = int(n)
		case "st":
			var n int64
			n, ok = p.int()
			m.Status = int(n)
		default:
			return false // "hb" and anything unknown
		}
		if !ok {
			return false
		}
	}
	return p.i == len(p.b)
}

type metaParser struct {
	b []byte
	i int
}

func (p *metaParser) lit(s string) bool {
	if bytes.HasPrefix(p.b[p.i:], []byte(s)) {
		p.i += len(s)
		return true
	}
	return false
}

// name reads a member name after its opening quote, and the colon.
func (p *metaParser) name() (string, bool) {
	j := bytes.IndexByte(p.b[p.i:], '"')
	if j < 0 || p.i+j+1 >= len(p.b) || p.b[p.i+j+1] != ':' {
		return "", false
	}
	n := string(p.b[p.i : p.i+j])
	p.i += j + 2
	return n, true
}

// str reads a string with no escapes.
func (p *metaParser) str() (string, bool) {
	if !p.lit(`"`) {
		return "", false
	}
	j := bytes.IndexByte(p.b[p.i:], '"')
	if j < 0 || bytes.IndexByte(p.b[p.i:p.i+j], '\\') >= 0 {
		return "", false
	}
	s := string(p.b[p.i : p.i+j])
	p.i += j + 1
	return s, true
}

func (p *metaParser) int() (int64, bool) {
	j := p.i
	if j < len(p.b) && p.b[j] == '-' {
		j++
	}
	for j < len(p.b) && p.b[j] >= '0' && p.b[j] <= '9' {
		j++
	}
	n, err := strconv.ParseInt(string(p.b[p.i:j]), 10, 64)
	p.i = j
	return n, err == nil
}
