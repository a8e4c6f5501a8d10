package etcdstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore/internal/dict"
	"github.com/idem-dev/idem/internal/workload"
)

// paymentLike is a 1 KiB JSON answer like a payment API's, with random ids.
func paymentLike(n int) []byte { return workload.Payment(n) }

// Records are compressed against a dictionary the first process publishes
// from its saved outcomes; a process that never saw the dictionary reads
// them (it fetches the dictionary once), and so does an Admin, a cached
// replay, and a store that writes format 2 during an upgrade.
func TestCompressedRecords(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	ctx := testCtx(t)
	bodies := map[string][]byte{}
	do := func(st *Store, id string) {
		t.Helper()
		body := paymentLike(len(bodies))
		bodies[id] = body
		if _, err := st.Do(ctx, Key{ID: id}, []byte(`{"p":1}`), func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < dict.Samples; i++ {
		do(s, "warm-"+strconv.Itoa(i))
	}
	waitFor(t, "the dictionary to be published", func() bool { return s.Metrics().Dictionaries.Published == 1 })
	do(s, "k")
	raw, err := cli.Get(ctx, s.ks.record(Key{ID: "k"}))
	if err != nil || len(raw.Kvs) != 1 {
		t.Fatal(err)
	}
	v := raw.Kvs[0].Value
	if v[0] != recordV3 || !isDone(v) {
		t.Fatalf("record format %d (done %v); want 3, done", v[0], isDone(v))
	}
	rec, err := s.Get(ctx, Key{ID: "k"})
	if err != nil {
		t.Fatal(err)
	}
	plain := encode(rec, rec.Token)
	if id, n := uvarint(v[2:]); id == 0 || n <= 0 {
		t.Fatalf("record names dictionary %d; want the published one", id)
	}
	t.Logf("1 KiB payment-like body: record %d bytes compressed, %d as format 2", len(v), len(plain))
	if len(v)*2 > len(plain) {
		t.Fatalf("compressed record %d bytes, format 2 %d: want at most half", len(v), len(plain))
	}

	// A fresh process, an Admin, a cache and a format-2 writer all read it.
	other := newStore(t, client(t), prefix, WithCache(1<<20), WithRecordFormat(2))
	adm, err := NewAdmin(client(t), WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	for name, get := range map[string]func() ([]byte, error){
		"another store": func() ([]byte, error) {
			res, err := other.Do(ctx, Key{ID: "k"}, []byte(`{"p":1}`), nil)
			return res.Body, err
		},
		"an admin": func() ([]byte, error) {
			r, err := adm.Get(ctx, Key{ID: "k"})
			if err != nil {
				return nil, err
			}
			return r.Outcome.Body, nil
		},
		"DecodeRecord": func() ([]byte, error) {
			r, err := adm.decodeRecord(raw.Kvs[0])
			if err != nil {
				return nil, err
			}
			return r.Outcome.Body, nil
		},
	} {
		if body, err := get(); err != nil || string(body) != string(bodies["k"]) {
			t.Fatalf("%s read %q, %v; want the saved body", name, body, err)
		}
	}
	do(other, "written-as-2")
	raw2, err := cli.Get(ctx, s.ks.record(Key{ID: "written-as-2"}))
	if err != nil || raw2.Kvs[0].Value[0] != recordV2 {
		t.Fatalf("WithRecordFormat(2) wrote format %d, %v", raw2.Kvs[0].Value[0], err)
	}
	if res, err := s.Do(ctx, Key{ID: "written-as-2"}, []byte(`{"p":1}`), nil); err != nil || string(res.Body) != string(bodies["written-as-2"]) {
		t.Fatalf("format 3 store reading format 2: %v", err)
	}
	waitFor(t, "the other store's cache to be current", func() bool { return other.Metrics().Cache.Lag < DefaultCacheStaleness/2 })
	do(s, "k2") // seen by the other store's cache watch, compressed
	waitFor(t, "the cache to replay the compressed record", func() bool {
		before := other.Metrics().Cache.Hits
		res, err := other.Do(ctx, Key{ID: "k2"}, []byte(`{"p":1}`), nil)
		return err == nil && string(res.Body) == string(bodies["k2"]) && other.Metrics().Cache.Hits > before
	})
}

func uvarint(b []byte) (uint64, int) {
	var v uint64
	for i, c := range b {
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, i + 1
		}
	}
	return 0, -1
}

// warm saves dict.Samples compressible outcomes through st, which then
// publishes a dictionary (or adopts another process's).
func warm(t *testing.T, st *Store, prefix string) {
	t.Helper()
	ctx := testCtx(t)
	for i := 0; i < dict.Samples; i++ {
		body := paymentLike(i)
		if _, err := st.Do(ctx, Key{ID: fmt.Sprintf("warm-%s-%d", st.Owner(), i)}, nil, func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
			t.Fatal(err)
		}
	}
}

// dictionaryOf returns the dictionary id key's record names (0: none).
func dictionaryOf(t *testing.T, cli *clientv3.Client, st *Store, key Key) uint64 {
	t.Helper()
	raw, err := cli.Get(testCtx(t), st.ks.record(key))
	if err != nil || len(raw.Kvs) != 1 || raw.Kvs[0].Value[0] != recordV3 {
		t.Fatalf("record of %s: %v, %v; want one of format 3", key, raw, err)
	}
	id, _ := uvarint(raw.Kvs[0].Value[2:])
	return id
}

// Two processes publish at once: one dictionary becomes current, and both
// write with it.
func TestDictionaryPublishRace(t *testing.T) {
	prefix := testPrefix(t)
	cli := client(t)
	a, b := newStore(t, client(t), prefix), newStore(t, client(t), prefix)
	var wg sync.WaitGroup
	for _, st := range []*Store{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			warm(t, st, prefix)
		}()
	}
	wg.Wait()
	waitFor(t, "one dictionary to be current in both", func() bool {
		ma, mb := a.Metrics().Dictionaries, b.Metrics().Dictionaries
		return ma.Published+mb.Published == 1 && ma.Published+ma.Raced+mb.Published+mb.Raced >= 1
	})
	ctx := testCtx(t)
	ids := map[uint64]bool{}
	for i, st := range []*Store{a, b} {
		key := Key{ID: fmt.Sprintf("after-%d", i)}
		waitFor(t, "both to write with the current dictionary", func() bool {
			st.Evict(ctx, key)
			body := paymentLike(100 + i)
			if _, err := st.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
				t.Fatal(err)
			}
			id := dictionaryOf(t, cli, st, key)
			if id != 0 {
				ids[id] = true
			}
			return id != 0
		})
	}
	if len(ids) != 1 {
		t.Fatalf("the stores write with dictionaries %v; want one", ids)
	}
}

// A dictionary outlives every record that names it, whatever retention the
// process that wrote the record had: here a process with a 2 s retention
// publishes dictionaries (one a second) and sweeps its own records and
// leases quickly, and a process with an hour's retention writes a record
// against the first one, which must stay readable while the short-lived
// process publishes successors, races over them, and has all its own
// records and leases swept. (Until 0.5 a dictionary was deleted once its
// successor was older than twice the retention of the process that
// published the successor, and the record became ErrCorrupt.)
func TestDictionaryOutlivesItsRecords(t *testing.T) {
	prefix := testPrefix(t)
	short := newStore(t, client(t), prefix, WithRetention(2*time.Second), withDictionaryRefresh(time.Second),
		withSweepPace(500*time.Millisecond, time.Second, nil))
	long := newStore(t, client(t), prefix, WithRetention(time.Hour))
	ctx := testCtx(t)
	warm(t, short, prefix)
	waitFor(t, "a dictionary", func() bool { return short.Metrics().Dictionaries.Published == 1 })
	key := Key{ID: "kept-an-hour"}
	body := paymentLike(1000)
	var first uint64
	waitFor(t, "the long-lived store to write with the dictionary", func() bool {
		long.Evict(ctx, key)
		if _, err := long.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
			t.Fatal(err)
		}
		first = dictionaryOf(t, client(t), long, key)
		return first != 0
	})
	// Successors, a race over one (another short-lived store), and every
	// record and lease of the short-lived stores swept.
	racer := newStore(t, client(t), prefix, WithRetention(2*time.Second), withDictionaryRefresh(time.Second),
		withSweepPace(500*time.Millisecond, time.Second, nil))
	for round := 0; round < 3; round++ {
		time.Sleep(1100 * time.Millisecond) // the refresh interval: a real wait
		var wg sync.WaitGroup
		for _, st := range []*Store{short, racer} {
			wg.Add(1)
			go func() { defer wg.Done(); warm(t, st, prefix) }()
		}
		wg.Wait()
	}
	waitFor(t, "the short-lived stores' first leases to be swept", func() bool {
		return short.Metrics().Sweep.Leases+racer.Metrics().Sweep.Leases >= 2
	})
	m := short.Metrics().Dictionaries
	m = m.add(racer.Metrics().Dictionaries)
	if m.Published < 2 {
		t.Fatalf("dictionaries %+v; want successors published", m)
	}
	fresh, err := NewAdmin(client(t), WithPrefix(prefix)) // has met no dictionary
	if err != nil {
		t.Fatal(err)
	}
	rec, err := fresh.Get(ctx, key)
	if err != nil || string(rec.Outcome.Body) != string(body) {
		t.Fatalf("the record compressed against dictionary %d reads %v, %v; want its body", first, rec, err)
	}
}

// A compressed record whose dictionary is gone, or whose frame is damaged,
// is corrupt, and never overwritten.
func TestCorruptCompressedRecords(t *testing.T) {
	adm, err := NewAdmin(client(t), WithPrefix(testPrefix(t)))
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string][]byte{
		"unknown dictionary": {recordV3, 2, 0x85, 0x01, 1, 2, 3},
		"damaged frame":      {recordV3, 2, 0, 0xde, 0xad, 0xbe, 0xef},
		"no id":              {recordV3, 2},
	} {
		_, err := adm.decode(testCtx(t), Key{ID: "k"}, &mvccpb.KeyValue{Value: v, ModRevision: 3})
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: %v; want ErrCorrupt", name, err)
		}
	}
}

// A claim etcd refused (the key holds a done record) whose answer names a
// dictionary this process cannot fetch did not land: the claim fails, and
// no reaper is started for a write that etcd said it did not apply.
// (Until 0.5 the failed dictionary read counted as "may have landed".)
func TestRefusedClaimWithAnUnreadableDictionaryIsNotReaped(t *testing.T) {
	prefix := testPrefix(t)
	writer := newStore(t, client(t), prefix)
	warm(t, writer, prefix)
	ctx := testCtx(t)
	key := Key{ID: "compressed"}
	body := paymentLike(7)
	waitFor(t, "a record compressed against a dictionary", func() bool {
		writer.Evict(ctx, key)
		if _, err := writer.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
			t.Fatal(err)
		}
		return dictionaryOf(t, client(t), writer, key) != 0
	})
	var failed atomic.Int64
	dicts := prefix + "z/"
	reader := newStore(t, hookedClient(t, func(method string, req any, invoke func() error) error {
		if r, ok := req.(*pb.RangeRequest); ok && strings.HasPrefix(string(r.Key), dicts) {
			failed.Add(1)
			return errLost
		}
		return invoke()
	}), prefix)
	fp, err := FingerprintOf(nil)
	if err != nil {
		t.Fatal(err)
	}
	_, done, err := reader.Claim(ctx, key, fp)
	if err == nil || done != nil {
		t.Fatalf("claim of a record whose dictionary cannot be read: %v, %v; want an error", done, err)
	}
	if failed.Load() == 0 {
		t.Fatalf("claim: %v, and no dictionary read failed: the test did not test", err)
	}
	if m := reader.Metrics(); m.Pending != 0 {
		t.Fatalf("after a claim etcd refused: %d background writes pending; want none (the claim did not land)", m.Pending)
	}
}

// A closed store's Admin methods say the store is closed; they do not call
// its compressed records corrupt. (Until 0.5 List answered ErrCorrupt.)
func TestClosedStoreIsNotCorrupt(t *testing.T) {
	prefix := testPrefix(t)
	st := newStore(t, client(t), prefix)
	warm(t, st, prefix)
	ctx := testCtx(t)
	key := Key{ID: "compressed"}
	waitFor(t, "a record compressed against a dictionary", func() bool {
		st.Evict(ctx, key)
		if _, err := st.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return paymentLike(3), nil }); err != nil {
			t.Fatal(err)
		}
		return dictionaryOf(t, client(t), st, key) != 0
	})
	st.Close()
	if _, err := st.Get(ctx, key); !errors.Is(err, ErrClosed) || errors.Is(err, ErrCorrupt) {
		t.Errorf("Get on a closed store: %v; want ErrClosed", err)
	}
	if _, err := st.List(ctx, "", ListOptions{}); !errors.Is(err, ErrClosed) || errors.Is(err, ErrCorrupt) {
		t.Errorf("List on a closed store: %v; want ErrClosed", err)
	}
	if _, err := st.stats(ctx, 0); !errors.Is(err, ErrClosed) {
		t.Errorf("Stats on a closed store: %v; want ErrClosed", err)
	}
}

// A body that is compressed already (its Content-Encoding says so, or its
// first bytes) is not compressed again: the attempt costs CPU and would
// not shrink the record. A body like it in plain JSON is.
func TestEncodedBodiesAreNotCompressedAgain(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	ctx := testCtx(t)
	for i := 0; i < dict.Samples; i++ {
		body := paymentLike(i)
		if _, err := s.Do(ctx, Key{ID: "warm-" + strconv.Itoa(i)}, []byte(`{"p":1}`), func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the dictionary to be published", func() bool { return s.Metrics().Dictionaries.Published == 1 })
	for _, c := range []struct {
		id     string
		header map[string][]string
		body   []byte
		format byte
	}{
		{"plain", map[string][]string{"Content-Type": {"application/json"}}, paymentLike(1000), recordV3},
		{"identity", map[string][]string{"Content-Encoding": {"identity"}}, paymentLike(1001), recordV3},
		{"said-gzip", map[string][]string{"content-encoding": {"gzip"}}, paymentLike(1002), recordV2},
		{"gzip-bytes", nil, append([]byte{0x1f, 0x8b}, paymentLike(1003)...), recordV2},
	} {
		if _, err := s.Run(ctx, Key{ID: c.id}, Fingerprint{}, func(context.Context, *Claim) (Outcome, End) {
			return Outcome{Status: 200, Header: c.header, Body: c.body}, EndSave
		}); err != nil {
			t.Fatal(err)
		}
		raw, err := cli.Get(ctx, s.ks.record(Key{ID: c.id}))
		if err != nil || len(raw.Kvs) != 1 {
			t.Fatal(err)
		}
		if got := raw.Kvs[0].Value[0]; got != c.format {
			t.Errorf("%s: record format %d, want %d", c.id, got, c.format)
		}
		if rec, err := s.Get(ctx, Key{ID: c.id}); err != nil || !bytes.Equal(rec.Outcome.Body, c.body) {
			t.Errorf("%s: read back %v", c.id, err)
		}
	}
}
