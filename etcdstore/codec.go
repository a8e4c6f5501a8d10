package etcdstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/idem-dev/idem/etcdstore/internal/dict"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"
)

// A record in etcd is laid out as one byte of version, a uvarint length,
// the metadata, then the outcome's body, raw (no encoding tax on large
// responses).
//
// Version 2, written since idem 0.2, encodes the metadata in protobuf's wire
// format (written by hand with protowire: no generated code), one field per
// Record field. A reader skips fields it does not know, so a field added
// later is read as absent by older processes. Version 1, a JSON object, is
// still read: records written before an upgrade stay readable until their
// retention ends. Any other version is never overwritten (ErrCorrupt).
//
// Version 3 is version 2 compressed with zstd (compress.go): one byte of
// version, one of state (so that a done record is told from a claim
// without decompressing it), the dictionary's id as a uvarint (0: none),
// then a zstd frame of what follows the version byte in version 2. It is
// written only when it is smaller.
const (
	recordV1 = 1
	recordV2 = 2
	recordV3 = 3

	recordVersion = recordV3 // the default format
)

// The metadata fields. Numbers are never reused.
const (
	fState      protowire.Number = 1  // varint: 1 in flight, 2 done
	fFP         protowire.Number = 2  // bytes: SHA-256
	fOwner      protowire.Number = 3  // bytes; absent: abandoned
	fAttempt    protowire.Number = 4  // bytes
	fToken      protowire.Number = 5  // varint; absent: the revision of this write
	fCreated    protowire.Number = 6  // varint, unix ms
	fExpires    protowire.Number = 7  // varint, unix ms
	fDeadline   protowire.Number = 8  // varint, unix ms; absent: none
	fCheckpoint protowire.Number = 9  // bytes
	fTakeovers  protowire.Number = 10 // varint
	fStatus     protowire.Number = 11 // varint
	fHeader     protowire.Number = 12 // bytes, repeated: one header value, {1: name, 2: value}
	fErr        protowire.Number = 13 // bytes
	fMovedTo    protowire.Number = 14 // bytes: the shard a moved key lives on
	fEpoch      protowire.Number = 15 // varint: the shard epoch of the claim (or move); absent: 0
	fFence      protowire.Number = 16 // varint 1: a fence (Record.Fence)
	fKind       protowire.Number = 17 // varint: 1 a key, 2 a job; absent: written before kinds
	fCutShort   protowire.Number = 18 // varint 1: an earlier claim was cut short (Record.CutShort)
)

// encodeV1 lays r out in format 1, for WithRecordFormat(1): the format
// idem 0.1 reads.
func encodeV1(r *Record, token fencing.Token) []byte {
	m := metaV1{State: r.State, FP: r.Fingerprint.String(), Owner: r.Owner, Attempt: r.Attempt, Token: int64(token),
		Created: r.Created.UnixMilli(), Expires: r.Expires.UnixMilli(), Checkpoint: r.Checkpoint, Takeovers: r.Takeovers,
		Epoch: r.Epoch, MovedTo: r.MovedTo, Fence: r.Fence, Kind: r.Kind, CutShort: r.CutShort}
	if !r.Deadline.IsZero() {
		m.Deadline = r.Deadline.UnixMilli()
	}
	var body []byte
	if o := r.Outcome; o != nil {
		m.Status, m.Err, body = o.Status, o.Err, o.Body
		for k, vs := range o.Header {
			if m.Header == nil {
				m.Header = make(map[string][][]byte, len(o.Header))
			}
			for _, v := range vs {
				m.Header[k] = append(m.Header[k], []byte(v))
			}
		}
	}
	js, _ := json.Marshal(&m) // cannot fail: plain values only
	buf := binary.AppendUvarint([]byte{recordV1}, uint64(len(js)))
	return append(append(buf, js...), body...)
}

// encode lays r out. token 0 means "the revision of this write", which is
// how a claim or takeover names a token it cannot know in advance.
func encode(r *Record, token fencing.Token) []byte {
	m := make([]byte, 0, 128+len(r.Checkpoint))
	state := uint64(1)
	switch r.State {
	case Done:
		state = 2
	case Moved:
		state = 3
	}
	m = appendVarint(m, fState, state)
	m = appendBytes(m, fFP, r.Fingerprint[:])
	if r.State != Done {
		// A done record needs neither: nobody owns it, and its claim is
		// recognised by its token alone (a key's tokens are revisions of
		// its own claim writes: no two claims share one).
		m = appendString(m, fOwner, r.Owner)
		m = appendString(m, fAttempt, r.Attempt)
	}
	m = appendVarint(m, fToken, uint64(token))
	m = appendTime(m, fCreated, r.Created)
	m = appendTime(m, fExpires, r.Expires)
	m = appendTime(m, fDeadline, r.Deadline)
	m = appendBytes(m, fCheckpoint, r.Checkpoint)
	m = appendVarint(m, fTakeovers, uint64(r.Takeovers))
	m = appendString(m, fMovedTo, r.MovedTo)
	m = appendVarint(m, fEpoch, uint64(r.Epoch))
	if r.Fence {
		m = appendVarint(m, fFence, 1)
	}
	if r.CutShort {
		m = appendVarint(m, fCutShort, 1)
	}
	m = appendVarint(m, fKind, uint64(kernelKinds[r.Kind]))
	var body []byte
	if o := r.Outcome; o != nil {
		m = appendVarint(m, fStatus, uint64(o.Status))
		names := make([]string, 0, len(o.Header))
		for k := range o.Header {
			names = append(names, k)
		}
		sort.Strings(names)
		for _, k := range names {
			for _, v := range o.Header[k] {
				h := protowire.AppendTag(nil, 1, protowire.BytesType)
				h = protowire.AppendString(h, k)
				h = protowire.AppendTag(h, 2, protowire.BytesType)
				h = protowire.AppendString(h, v)
				m = appendBytes(m, fHeader, h)
			}
		}
		m = appendString(m, fErr, o.Err)
		body = o.Body
	}
	buf := make([]byte, 0, 1+binary.MaxVarintLen64+len(m)+len(body))
	buf = append(buf, recordV2)
	buf = binary.AppendUvarint(buf, uint64(len(m)))
	buf = append(buf, m...)
	return append(buf, body...)
}

// appendTime appends a time as unix milliseconds; the zero time is absent.
func appendTime(b []byte, n protowire.Number, t time.Time) []byte {
	if t.IsZero() {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, n, protowire.VarintType), uint64(t.UnixMilli()))
}

// appendVarint, appendBytes and appendString append a field, leaving out
// zero values (absent reads as zero).
func appendVarint(b []byte, n protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, n, protowire.VarintType), v)
}

func appendBytes(b []byte, n protowire.Number, v []byte) []byte {
	if len(v) == 0 {
		return b
	}
	return protowire.AppendBytes(protowire.AppendTag(b, n, protowire.BytesType), v)
}

func appendString(b []byte, n protowire.Number, v string) []byte {
	if v == "" {
		return b
	}
	return protowire.AppendString(protowire.AppendTag(b, n, protowire.BytesType), v)
}

// The range of times a record may hold: years 1 to 9999.
const (
	minMillis = -62135596800000
	maxMillis = 253402300799999
)

// fromMillis reads a time written by appendTime.
func fromMillis(v uint64) (time.Time, error) {
	ms := int64(v)
	if ms <= minMillis || ms > maxMillis { // the zero time is written as absent
		return time.Time{}, fmt.Errorf("time %d out of range", ms)
	}
	return time.UnixMilli(ms), nil
}

// split returns a record's version, metadata and body.
func split(v []byte) (byte, []byte, []byte, bool) {
	if len(v) < 2 {
		return 0, nil, nil, false
	}
	n, w := binary.Uvarint(v[1:])
	if w <= 0 || n > uint64(len(v)-1-w) {
		return 0, nil, nil, false
	}
	return v[0], v[1+w : 1+w+int(n)], v[1+w+int(n):], true
}

// encodeAs lays r out in format (1, 2 or 3) for a write onto lease l,
// offering a done record to the next compression dictionary.
func (s *Store) encodeAs(ctx context.Context, format byte, r *Record, token fencing.Token, l clientv3.LeaseID) []byte {
	switch format {
	case recordV1:
		return encodeV1(r, token)
	case recordV2:
		return encode(r, token)
	}
	v2 := encode(r, token)
	if r.Outcome == nil || len(r.Outcome.Body) < dict.Min || encoded(r.Outcome) {
		return v2
	}
	s.dicts.Sample(s.life, v2[1:]) // what is compressed: headers and metadata too
	id, frame, ok := s.dicts.Compress(ctx, v2[1:], l)
	if !ok {
		return v2 // closed: the write is refused anyway
	}
	v3 := make([]byte, 0, 2+binary.MaxVarintLen32+len(frame))
	v3 = append(v3, recordV3, 2)
	v3 = binary.AppendUvarint(v3, uint64(id))
	v3 = append(v3, frame...)
	if len(v3)+16 > len(v2) {
		return v2 // compression does not pay
	}
	return v3
}

// decodeRecord reads a record from its etcd key-value, for tools that read
// idem's records from etcd directly (a watch of the prefix, a backup). A
// key outside the prefix's records, an unknown version or a malformed
// record is an error wrapping ErrCorrupt. A compressed record whose
// dictionary this Admin has not met yet is read with one etcd Get; a
// record of the past (deleted since, with its dictionary) is read with the
// dictionary as etcd held it at the record's revision, unless compacted.
func (a *Admin) decodeRecord(kv *mvccpb.KeyValue) (*Record, error) {
	k, ok := a.ks.parseRecord(string(kv.Key))
	if !ok {
		return nil, fmt.Errorf("%w: %q is not a record key under %q", ErrCorrupt, kv.Key, a.ks.prefix)
	}
	return a.decodeAt(context.Background(), k, kv, kv.ModRevision)
}

// decodeKV reads a record key-value of this store's.
func (a *Admin) decodeKV(ctx context.Context, kv *mvccpb.KeyValue) (*Record, error) {
	k, ok := a.ks.parseRecord(string(kv.Key))
	if !ok {
		return nil, fmt.Errorf("%w: %q is not a record key under %q", ErrCorrupt, kv.Key, a.ks.prefix)
	}
	return a.decode(ctx, k, kv)
}

// decode reads a record from its etcd key-value, decompressing format 3.
// A dictionary that cannot be read from etcd is ErrUnavailable; one etcd
// does not hold, or that does not decode, is ErrCorrupt.
func (a *Admin) decode(ctx context.Context, k Key, kv *mvccpb.KeyValue) (*Record, error) {
	return a.decodeAt(ctx, k, kv, 0)
}

// decodeAt is decode, reading a dictionary no longer in etcd at revision at
// (0: never).
func (a *Admin) decodeAt(ctx context.Context, k Key, kv *mvccpb.KeyValue, at int64) (*Record, error) {
	if len(kv.Value) < 3 || kv.Value[0] != recordV3 {
		return decode(k, kv)
	}
	id, n := binary.Uvarint(kv.Value[2:])
	if n <= 0 || id > 1<<32-1 {
		return nil, fmt.Errorf("record %s: %w: bad layout", k, ErrCorrupt)
	}
	plain, err := a.dicts.Decompress(ctx, uint32(id), kv.Value[2+n:], at)
	switch {
	case errors.Is(err, dict.ErrClosed):
		return nil, fmt.Errorf("record %s: %w", k, ErrClosed)
	case errors.Is(err, dict.ErrRead):
		return nil, fmt.Errorf("record %s: %w: %w", k, ErrUnavailable, err)
	case err != nil:
		return nil, fmt.Errorf("record %s: %w: %v", k, ErrCorrupt, err)
	}
	v2 := &mvccpb.KeyValue{Key: kv.Key, CreateRevision: kv.CreateRevision, ModRevision: kv.ModRevision,
		Version: kv.Version, Lease: kv.Lease, Value: append([]byte{recordV2}, plain...)}
	return decode(k, v2)
}

// decode reads a record of format 1 or 2 from its etcd key-value.
func decode(k Key, kv *mvccpb.KeyValue) (*Record, error) {
	version, m, body, ok := split(kv.Value)
	if !ok {
		return nil, fmt.Errorf("record %s: %w: bad layout", k, ErrCorrupt)
	}
	r := &Record{Key: k, Revision: kv.ModRevision, Lease: kv.Lease}
	var err error
	switch version {
	case recordV2:
		err = r.decodeV2(m)
	case recordV1:
		err = r.decodeV1(m)
	default:
		err = fmt.Errorf("unknown version %d", version)
	}
	if err != nil {
		return nil, fmt.Errorf("record %s: %w: %v", k, ErrCorrupt, err)
	}
	if r.Token == 0 {
		r.Token = tokenOf(r.Epoch, kv.ModRevision)
	}
	switch r.State {
	case Moved:
		if len(body) != 0 || r.Outcome != nil || r.MovedTo == "" {
			return nil, fmt.Errorf("record %s: %w: a moved record names no shard, or has an outcome", k, ErrCorrupt)
		}
	case InFlight:
		if len(body) != 0 || r.Outcome != nil {
			return nil, fmt.Errorf("record %s: %w: in-flight record with an outcome", k, ErrCorrupt)
		}
	case Done:
		if r.Outcome == nil {
			r.Outcome = &Outcome{}
		}
		if len(body) > 0 {
			r.Outcome.Body = body
		}
	default:
		return nil, fmt.Errorf("record %s: %w: no state", k, ErrCorrupt)
	}
	return r, nil
}

func (r *Record) decodeV2(m []byte) error {
	fp := false
	for len(m) > 0 {
		num, v, b, rest, err := nextField(m)
		if err != nil {
			return err
		}
		m = rest
		fp = fp || num == fFP
		if err := r.setField(num, v, b); err != nil {
			return err
		}
	}
	if !fp {
		return fmt.Errorf("no fingerprint")
	}
	return nil
}

// nextField reads the field at the start of m: its number, and its value
// (a varint, or bytes); a field of another wire type is skipped.
func nextField(m []byte) (protowire.Number, uint64, []byte, []byte, error) {
	num, typ, n := protowire.ConsumeTag(m)
	if n < 0 {
		return 0, 0, nil, nil, protowire.ParseError(n)
	}
	m = m[n:]
	var v uint64
	var b []byte
	switch typ {
	case protowire.VarintType:
		v, n = protowire.ConsumeVarint(m)
	case protowire.BytesType:
		b, n = protowire.ConsumeBytes(m)
	default:
		n = protowire.ConsumeFieldValue(num, typ, m)
	}
	if n < 0 {
		return 0, 0, nil, nil, protowire.ParseError(n)
	}
	return num, v, b, m[n:], nil
}

// setField sets the record's field num to its value. Unknown fields are
// skipped: a later version may add some.
func (r *Record) setField(num protowire.Number, v uint64, b []byte) (err error) {
	switch num {
	case fState:
		return r.setState(v)
	case fFP:
		if len(b) != len(r.Fingerprint) {
			return fmt.Errorf("fingerprint of %d bytes", len(b))
		}
		copy(r.Fingerprint[:], b)
	case fOwner:
		r.Owner = string(b)
	case fAttempt:
		r.Attempt = string(b)
	case fToken:
		r.Token = fencing.Token(v)
	case fCreated:
		r.Created, err = fromMillis(v)
	case fExpires:
		r.Expires, err = fromMillis(v)
	case fDeadline:
		r.Deadline, err = fromMillis(v)
	case fCheckpoint:
		r.Checkpoint = b
	case fTakeovers:
		r.Takeovers = int(v)
	case fMovedTo:
		r.MovedTo = string(b)
	case fEpoch:
		if v >= 1<<(63-epochShift) {
			return fmt.Errorf("epoch %d", v)
		}
		r.Epoch = int64(v)
	case fFence:
		r.Fence = v == 1
	case fCutShort:
		r.CutShort = v == 1
	case fKind:
		r.Kind = storeKinds[kernel.Kind(v)] // a kind this reader does not know reads as none
	default:
		return r.setOutcomeField(num, v, b)
	}
	return err
}

func (r *Record) setState(v uint64) error {
	switch v {
	case 1:
		r.State = InFlight
	case 2:
		r.State = Done
	case 3:
		r.State = Moved
	default:
		return fmt.Errorf("state %d", v)
	}
	return nil
}

// setOutcomeField sets a field of the record's outcome.
func (r *Record) setOutcomeField(num protowire.Number, v uint64, b []byte) error {
	outcome := func() *Outcome {
		if r.Outcome == nil {
			r.Outcome = &Outcome{}
		}
		return r.Outcome
	}
	switch num {
	case fStatus:
		outcome().Status = int(v)
	case fHeader:
		name, value, err := decodeHeader(b)
		if err != nil {
			return err
		}
		o := outcome()
		if o.Header == nil {
			o.Header = make(map[string][]string)
		}
		o.Header[name] = append(o.Header[name], value)
	case fErr:
		outcome().Err = string(b)
	}
	return nil
}

func decodeHeader(b []byte) (name, value string, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.BytesType {
			return "", "", fmt.Errorf("bad header")
		}
		v, m := protowire.ConsumeBytes(b[n:])
		if m < 0 {
			return "", "", fmt.Errorf("bad header")
		}
		switch num {
		case 1:
			name = string(v)
		case 2:
			value = string(v)
		}
		b = b[n+m:]
	}
	return name, value, nil
}

// metaV1 is the JSON metadata of a version 1 record.
type metaV1 struct {
	State      State               `json:"s"`
	FP         string              `json:"fp"`
	Owner      string              `json:"o,omitempty"`
	Attempt    string              `json:"a,omitempty"`
	Token      int64               `json:"t,omitempty"`
	Created    int64               `json:"c"`
	Expires    int64               `json:"x"`
	Deadline   int64               `json:"d,omitempty"`
	Checkpoint []byte              `json:"cp,omitempty"`
	Takeovers  int                 `json:"n,omitempty"`
	Status     int                 `json:"st,omitempty"`
	Header     map[string][][]byte `json:"hb,omitempty"`
	Err        string              `json:"e,omitempty"`
	// Fields idem 0.1 did not have (and its reader ignores): a record of
	// a shard set (its epoch, where it moved) and a fence.
	Epoch    int64  `json:"ep,omitempty"`
	MovedTo  string `json:"mv,omitempty"`
	Fence    bool   `json:"f,omitempty"`
	Kind     Kind   `json:"k,omitempty"`
	CutShort bool   `json:"cs,omitempty"`
}

func (r *Record) decodeV1(js []byte) error {
	var m metaV1
	if err := json.Unmarshal(js, &m); err != nil {
		return err
	}
	fp, err := hex.DecodeString(m.FP)
	if err != nil || len(fp) != len(r.Fingerprint) {
		return fmt.Errorf("bad fingerprint")
	}
	copy(r.Fingerprint[:], fp)
	r.State, r.Owner, r.Attempt, r.Token = m.State, m.Owner, m.Attempt, fencing.Token(m.Token)
	r.Created, r.Expires = time.UnixMilli(m.Created), time.UnixMilli(m.Expires)
	if m.Deadline != 0 {
		r.Deadline = time.UnixMilli(m.Deadline)
	}
	r.Checkpoint, r.Takeovers = m.Checkpoint, m.Takeovers
	if m.Epoch < 0 || m.Epoch >= 1<<(63-epochShift) {
		return fmt.Errorf("epoch %d", m.Epoch)
	}
	r.Epoch, r.MovedTo, r.Fence, r.Kind, r.CutShort = m.Epoch, m.MovedTo, m.Fence, m.Kind, m.CutShort
	if m.State == Done {
		r.Outcome = &Outcome{Status: m.Status, Err: m.Err}
		for k, bs := range m.Header {
			if r.Outcome.Header == nil {
				r.Outcome.Header = make(map[string][]string, len(m.Header))
			}
			for _, b := range bs {
				r.Outcome.Header[k] = append(r.Outcome.Header[k], string(b))
			}
		}
	}
	return nil
}

// isDone reports whether an encoded record is done, without decoding it:
// the state is the metadata's first field.
func isDone(v []byte) bool {
	if len(v) >= 2 && v[0] == recordV3 {
		return v[1] == 2
	}
	version, m, _, ok := split(v)
	switch {
	case !ok:
		return false
	case version == recordV2:
		return len(m) >= 2 && m[0] == byte(fState)<<3 && m[1] == 2
	case version == recordV1:
		return len(m) >= 11 && string(m[:11]) == `{"s":"done"`
	}
	return false
}

// encoded reports whether an outcome's body is compressed already, by its
// Content-Encoding or its first bytes (gzip, zstd, zip, PNG, JPEG, WebP):
// compressing it again costs CPU and would not shrink the record.
func encoded(o *Outcome) bool {
	for k, vs := range o.Header {
		if strings.EqualFold(k, "Content-Encoding") {
			for _, v := range vs {
				if v != "" && !strings.EqualFold(v, "identity") {
					return true
				}
			}
		}
	}
	for _, magic := range compressedMagic {
		if bytes.HasPrefix(o.Body, magic) {
			return true
		}
	}
	return false
}

var compressedMagic = [][]byte{
	{0x1f, 0x8b},             // gzip
	{0x28, 0xb5, 0x2f, 0xfd}, // zstd
	{'P', 'K', 3, 4},         // zip (and docx, jar...)
	{0x89, 'P', 'N', 'G'},    // PNG
	{0xff, 0xd8, 0xff},       // JPEG
	[]byte("RIFF"),           // WebP (and other RIFF media)
}
