package etcdstore

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// FuzzKeyEncoding checks the isolation invariant: a key that validates is
// encoded under exactly its tenant's prefix and decodes back to itself.
func FuzzKeyEncoding(f *testing.F) {
	for _, s := range [][2]string{
		{"acme", "order-1"}, {"", "k"}, {"a", "../b/k"}, {"a.b", "/"}, {"a-b", ".."},
		{"a/b", "k"}, {"..", "k"}, {"a", "k\x00"}, {"a", ""}, {"x", strings.Repeat("k", 256)},
	} {
		f.Add(s[0], s[1])
	}
	ks := keyspace{prefix: "/idem/"}
	f.Fuzz(func(t *testing.T, tenant, id string) {
		k := Key{Tenant: tenant, ID: id}
		if err := k.Validate(); err != nil {
			return
		}
		enc := ks.record(k)
		tp := ks.tenant(k.tenant())
		if !strings.HasPrefix(enc, tp) {
			t.Fatalf("%v encodes to %q, outside its tenant prefix %q", k, enc, tp)
		}
		back, ok := ks.parseRecord(enc)
		if !ok || back.Tenant != k.tenant() || back.ID != id {
			t.Fatalf("%v encodes to %q which decodes to %v", k, enc, back)
		}
		// No other tenant's prefix contains it.
		for _, other := range []string{k.tenant() + "x", k.tenant()[:len(k.tenant())-1], "default"} {
			if other != k.tenant() && other != "" && strings.HasPrefix(enc, ks.tenant(other)) {
				t.Fatalf("%v is inside tenant %q's prefix", k, other)
			}
		}
	})
}

func TestRecordRoundTrip(t *testing.T) {
	now := time.UnixMilli(time.Now().UnixMilli())
	for _, r := range []*Record{
		{State: InFlight, Owner: "o", Attempt: "a", Created: now, Expires: now.Add(time.Hour), Checkpoint: []byte{0, 1}},
		{State: InFlight, Owner: "", Attempt: "a", Created: now, Expires: now, Deadline: now.Add(time.Minute), Takeovers: 2},
		{State: Done, Owner: "o", Attempt: "a", Created: now, Expires: now, Outcome: &Outcome{
			Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte{0xff, 0, '{'},
		}},
		{State: Done, Created: now, Expires: now, Outcome: &Outcome{Err: "insufficient funds"}},
	} {
		r.Fingerprint = Fingerprint{1, 2, 3}
		kv := &mvccpb.KeyValue{Value: encode(r, 7), ModRevision: 9}
		got, err := decode(Key{ID: "k"}, kv)
		if err != nil {
			t.Fatalf("decode(encode(%+v)): %v", r, err)
		}
		if got.State != r.State || got.Owner != r.Owner || got.Token != 7 || got.Revision != 9 ||
			!got.Created.Equal(r.Created) || !got.Expires.Equal(r.Expires) || !got.Deadline.Equal(r.Deadline) ||
			string(got.Checkpoint) != string(r.Checkpoint) || got.Takeovers != r.Takeovers || got.Fingerprint != r.Fingerprint {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, r)
		}
		if r.Outcome != nil && (got.Outcome.Status != r.Outcome.Status || string(got.Outcome.Body) != string(r.Outcome.Body) ||
			got.Outcome.Err != r.Outcome.Err || len(got.Outcome.Header) != len(r.Outcome.Header)) {
			t.Fatalf("outcome round trip: got %+v want %+v", got.Outcome, r.Outcome)
		}
	}
	// Token 0 means "the revision of this write".
	kv := &mvccpb.KeyValue{Value: encode(&Record{State: InFlight, Created: now, Expires: now}, 0), ModRevision: 42}
	if got, err := decode(Key{ID: "k"}, kv); err != nil || got.Token != 42 {
		t.Fatalf("token of a claim write = %v, %v; want its revision 42", got, err)
	}
}

func TestDecodeRejectsCorruptRecords(t *testing.T) {
	good := encode(&Record{State: Done, Outcome: &Outcome{Body: []byte("x")}}, 1)
	for name, v := range map[string][]byte{
		"empty":           nil,
		"unknown version": append([]byte{2}, good[1:]...),
		"meta too long":   {1, 0xff, 0x7f, '{'},
		"bad json":        {1, 3, 'n', 'o', 't'},
		"bad state":       encode(&Record{State: "pending"}, 1),
		"bad fingerprint": []byte("\x01\x0b{\"s\":\"done\"}"),
		"in flight body":  append(encode(&Record{State: InFlight}, 1), 'x'),
	} {
		if _, err := decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: v}); err == nil {
			t.Errorf("%s: decode succeeded; want ErrCorrupt", name)
		}
	}
}

func TestAppendMetaAgreesWithEncodingJSON(t *testing.T) {
	for _, m := range []meta{
		{State: InFlight, FP: "ab", Created: 1, Expires: 2},
		{State: Done, FP: "cd", Owner: "o", Attempt: "a-1", Token: 7, Created: -5, Expires: 9, Deadline: 3,
			Checkpoint: []byte{0, 1, 2, 255}, Takeovers: 2, Status: 201, Err: "bad \"quote\" \\ \n\t\x01 é <&> \u2028",
			Header: map[string][][]byte{"X-B": {[]byte("2"), []byte("\xff")}, "A": {[]byte("é<>&")}}},
		{State: Done, FP: "", Header: map[string][][]byte{"Empty": {}}},
	} {
		// Same meaning as encoding/json's (which also escapes <, > and &
		// for HTML; records never go into HTML).
		got := appendMeta(nil, &m)
		var back meta
		if err := json.Unmarshal(got, &back); err != nil {
			t.Fatalf("appendMeta wrote invalid JSON %s: %v", got, err)
		}
		want, _ := json.Marshal(&m)
		again, _ := json.Marshal(&back)
		if string(again) != string(want) {
			t.Errorf("appendMeta:\n got %s\nwhich reads back as %s\nwant %s", got, again, want)
		}
	}
}

// parseMeta reads what appendMeta writes exactly as encoding/json does, and
// declines what it does not write.
func TestParseMeta(t *testing.T) {
	for _, m := range []meta{
		{State: InFlight, FP: "ab", Created: 1, Expires: 2},
		{State: Done, FP: "cd", Owner: "o", Attempt: "a-1", Token: 7, Created: -5, Expires: 9, Deadline: 3,
			Checkpoint: []byte{0, 1, 2, 255}, Takeovers: 2, Status: 201, Err: "plain error text"},
	} {
		var got meta
		if !parseMeta(appendMeta(nil, &m), &got) {
			t.Fatalf("parseMeta declined %s", appendMeta(nil, &m))
		}
		want, _ := json.Marshal(&m)
		back, _ := json.Marshal(&got)
		if string(back) != string(want) {
			t.Errorf("parseMeta:\n got %s\nwant %s", back, want)
		}
	}
	for _, js := range []string{
		`{"s":"done","fp":"x","e":"with \"escapes\""}`,
		`{"fp":"x","s":"done"}`,
		`{"s":"done","fp":"x","hb":{"A":["eA=="]}}`,
		`{"s":"done","fp":"x","zz":1}`,
		`{"s":"done","fp":"x"} `,
	} {
		var m meta
		if parseMeta([]byte(js), &m) {
			t.Errorf("parseMeta accepted %s; want it left to encoding/json", js)
		}
	}
}
