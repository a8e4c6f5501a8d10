package etcdstore

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/idem-dev/idem/fencing"
)

func TestRecordRoundTrip(t *testing.T) {
	now := time.UnixMilli(time.Now().UnixMilli())
	for _, r := range []*Record{
		{State: InFlight, Owner: "o", Attempt: "a", Created: now, Expires: now.Add(time.Hour), Checkpoint: []byte{0, 1}},
		{State: InFlight, Owner: "", Attempt: "a", Created: now, Expires: now, Deadline: now.Add(time.Minute), Takeovers: 2},
		{State: Done, Created: now, Expires: now, Outcome: &Outcome{
			Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte{0xff, 0, '{'},
		}},
		{State: Done, Created: now, Expires: now, Outcome: &Outcome{Err: "insufficient funds"}},
		{State: InFlight, Attempt: "a", Created: now, Expires: now, Epoch: 3},
		{State: InFlight, Created: now, Expires: now, Fence: true},
		{State: Moved, Created: now, Expires: now, MovedTo: "b", Epoch: 2},
	} {
		for format, enc := range map[int]func(*Record, fencing.Token) []byte{1: encodeV1, 2: encode} {
			r.Fingerprint = Fingerprint{1, 2, 3}
			kv := &mvccpb.KeyValue{Value: enc(r, 7), ModRevision: 9}
			got, err := decode(Key{ID: "k"}, kv)
			if err != nil {
				t.Fatalf("format %d: decode(encode(%+v)): %v", format, r, err)
			}
			if got.State != r.State || got.Owner != r.Owner || got.Token != 7 || got.Revision != 9 ||
				!got.Created.Equal(r.Created) || !got.Expires.Equal(r.Expires) || !got.Deadline.Equal(r.Deadline) ||
				string(got.Checkpoint) != string(r.Checkpoint) || got.Takeovers != r.Takeovers || got.Fingerprint != r.Fingerprint ||
				got.Epoch != r.Epoch || got.MovedTo != r.MovedTo || got.Fence != r.Fence {
				t.Fatalf("format %d round trip:\n got %+v\nwant %+v", format, got, r)
			}
			if r.Outcome != nil && (got.Outcome.Status != r.Outcome.Status || string(got.Outcome.Body) != string(r.Outcome.Body) ||
				got.Outcome.Err != r.Outcome.Err || len(got.Outcome.Header) != len(r.Outcome.Header)) {
				t.Fatalf("format %d outcome round trip: got %+v want %+v", format, got.Outcome, r.Outcome)
			}
			// Token 0 means "the revision of this write", in the record's
			// epoch (a claim of a shard set's key).
			kv = &mvccpb.KeyValue{Value: enc(&Record{State: InFlight, Created: now, Expires: now, Epoch: 5}, 0), ModRevision: 42}
			if got, err := decode(Key{ID: "k"}, kv); err != nil || got.Token != tokenOf(5, 42) {
				t.Fatalf("format %d: token of a claim write in epoch 5 = %v, %v; want %d", format, got, err, tokenOf(5, 42))
			}
		}
	}
}

func TestDecodeRejectsCorruptRecords(t *testing.T) {
	good := encode(&Record{State: Done, Outcome: &Outcome{Body: []byte("x")}}, 1)
	_, meta, _, _ := split(good)
	for name, v := range map[string][]byte{
		"empty":           nil,
		"unknown version": append([]byte{9}, good[1:]...),
		"meta too long":   {recordV2, 0xff, 0x7f, 1},
		"bad wire format": {recordV2, 2, 0xff, 0xff},
		"no fingerprint":  {recordV2, 2, byte(fState) << 3, 2},
		"bad state":       append([]byte{recordV2, byte(len(meta))}, append([]byte{byte(fState) << 3, 7}, meta[2:]...)...),
		"v1 bad json":     {recordV1, 3, 'n', 'o', 't'},
		"in flight body":  append(encode(&Record{State: InFlight}, 1), 'x'),
	} {
		if _, err := decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: v}); err == nil {
			t.Errorf("%s: decode succeeded; want ErrCorrupt", name)
		}
	}
}

// Records written by an older idem (format version 1, JSON metadata) are
// read: a rolling upgrade replays them until their retention ends.
func TestDecodeVersion1(t *testing.T) {
	js, _ := json.Marshal(metaV1{State: Done, FP: Fingerprint{1, 2}.String(), Owner: "o", Attempt: "a-1", Token: 7,
		Created: 1000, Expires: 2000, Status: 201, Header: map[string][][]byte{"X-Id": {[]byte("ch_1")}}, Err: ""})
	v := append(binary.AppendUvarint([]byte{recordV1}, uint64(len(js))), js...)
	v = append(v, "body"...)
	r, err := decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: v, ModRevision: 9})
	if err != nil {
		t.Fatal(err)
	}
	want := &Record{Key: Key{ID: "k"}, State: Done, Fingerprint: Fingerprint{1, 2}, Owner: "o", Attempt: "a-1", Token: 7,
		Created: time.UnixMilli(1000), Expires: time.UnixMilli(2000), Revision: 9,
		Outcome: &Outcome{Status: 201, Header: map[string][]string{"X-Id": {"ch_1"}}, Body: []byte("body")}}
	if !reflect.DeepEqual(r, want) {
		t.Fatalf("v1 record = %+v\nwant %+v", r, want)
	}
	if !isDone(v) {
		t.Fatal("isDone misjudges a v1 done record")
	}
}

// A field a later version adds is skipped by this one.
func TestDecodeSkipsUnknownFields(t *testing.T) {
	v := encode(&Record{State: InFlight, Fingerprint: Fingerprint{3}, Attempt: "a"}, 5)
	_, meta, _, _ := split(v)
	meta = protowire.AppendString(protowire.AppendTag(meta, 99, protowire.BytesType), "from the future")
	meta = protowire.AppendVarint(protowire.AppendTag(meta, 98, protowire.VarintType), 42)
	v = append(binary.AppendUvarint([]byte{recordV2}, uint64(len(meta))), meta...)
	r, err := decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: v})
	if err != nil || r.Attempt != "a" || r.Token != 5 {
		t.Fatalf("decode with unknown fields = %+v, %v", r, err)
	}
}

// FuzzDecodeRecord: decoding never panics, and what decodes encodes back
// to a record that decodes to the same.
func FuzzDecodeRecord(f *testing.F) {
	f.Add(encode(&Record{State: Done, Fingerprint: Fingerprint{1}, Outcome: &Outcome{Status: 200, Body: []byte("b"),
		Header: map[string][]string{"A": {"1", "2"}}}}, 3))
	f.Add(encode(&Record{State: InFlight, Owner: "o", Checkpoint: []byte("cp"), Deadline: time.UnixMilli(5)}, 0))
	f.Fuzz(func(t *testing.T, v []byte) {
		r, err := decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: v, ModRevision: 7})
		if err != nil {
			return
		}
		again, err := decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: encode(r, r.Token), ModRevision: 7})
		if err != nil {
			t.Fatalf("re-encoded record does not decode: %v", err)
		}
		if again.Outcome != nil && len(again.Outcome.Header) == 0 {
			again.Outcome.Header = nil
		}
		if r.Outcome != nil && len(r.Outcome.Header) == 0 {
			r.Outcome.Header = nil
		}
		if !reflect.DeepEqual(normal(r), normal(again)) {
			t.Fatalf("round trip changed the record:\n%+v %+v\n%+v %+v", r, r.Outcome, again, again.Outcome)
		}
	})
}

// normal puts a decoded record in the form encode gives it, for compare.
func normal(r *Record) *Record {
	c := *r
	if c.State == Done {
		c.Owner, c.Attempt = "", "" // a done record keeps neither
	}
	if len(c.Checkpoint) == 0 {
		c.Checkpoint = nil
	}
	if c.Outcome != nil {
		o := *c.Outcome
		if len(o.Body) == 0 {
			o.Body = nil
		}
		c.Outcome = &o
	}
	return &c
}

// Header values that are not UTF-8 replay byte for byte.
func TestHeaderBytesReplayExactly(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t))
	ctx := testCtx(t)
	hdr := map[string][]string{"Content-Disposition": {"attachment; filename=\"caf\xe9.txt\""}}
	work := func(context.Context, *Claim) (Outcome, End) { return Outcome{Status: 200, Header: hdr}, EndSave }
	if _, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work); err != nil {
		t.Fatal(err)
	}
	res, err := s.Run(ctx, Key{ID: "k"}, fpOf(t, "p"), work)
	if err != nil || !res.Replayed || res.Header["Content-Disposition"][0] != hdr["Content-Disposition"][0] {
		t.Fatalf("replayed header = %q, %v; want %q", res.Header["Content-Disposition"], err, hdr["Content-Disposition"][0])
	}
}

// A store told to write format 1 (while a deployment upgrades from idem
// 0.1) writes records a format-1 reader decodes, and reads them back.
func TestWriteFormat1(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t), WithRecordFormat(1))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	if _, err := s.Do(ctx, key, []byte(`{"a":1}`), func(context.Context, *Claim) ([]byte, error) { return []byte("v1"), nil }); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, s.ks.record(key))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("%v %v", resp, err)
	}
	if v := resp.Kvs[0].Value; v[0] != recordV1 || !isDone(v) {
		t.Fatalf("record written in format %d; want 1, done", v[0])
	}
	res, err := s.Do(ctx, key, []byte(`{"a":1}`), nil)
	if err != nil || !res.Replayed || string(res.Body) != "v1" {
		t.Fatalf("replay = %q %v %v", res.Body, res.Replayed, err)
	}
	if _, err := New(ctx, cli, WithRecordFormat(4)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("format 4 = %v; want ErrInvalidArgument", err)
	}
}
