package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

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
	for i := 0; i < dictSamples; i++ {
		do(s, "warm-"+strconv.Itoa(i))
	}
	waitFor(t, "the dictionary to be published", func() bool {
		s.dicts.mu.Lock()
		defer s.dicts.mu.Unlock()
		return s.dicts.current != nil
	})
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
			r, err := adm.DecodeRecord(raw.Kvs[0])
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
	waitFor(t, "the other store's cache to be current", func() bool { return other.CacheStats().Lag < DefaultCacheStaleness/2 })
	do(s, "k2") // seen by the other store's cache watch, compressed
	waitFor(t, "the cache to replay the compressed record", func() bool {
		before := other.CacheStats().Hits
		res, err := other.Do(ctx, Key{ID: "k2"}, []byte(`{"p":1}`), nil)
		return err == nil && string(res.Body) == string(bodies["k2"]) && other.CacheStats().Hits > before
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

// Two processes publish at once: one dictionary becomes current, and both
// write with it.
func TestDictionaryPublishRace(t *testing.T) {
	prefix := testPrefix(t)
	a, b := newStore(t, client(t), prefix), newStore(t, client(t), prefix)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, st := range []*Store{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = st.dicts.publish([][]byte{paymentLike(i)}, nil)
		}()
	}
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatal(errs)
	}
	ctx := testCtx(t)
	resp, err := client(t).Get(ctx, prefix+"z/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 2 { // current and one dictionary: the loser deleted its own
		t.Fatalf("%d keys under z/; want current and one dictionary", len(resp.Kvs))
	}
	if a.dicts.current == nil || b.dicts.current == nil || a.dicts.current.id != b.dicts.current.id {
		t.Fatalf("stores write with different dictionaries: %v %v", a.dicts.current, b.dicts.current)
	}
}

// A dictionary is deleted once its successor is older than twice the
// retention, and not before; the current one never.
func TestDictionaryPrune(t *testing.T) {
	prefix := testPrefix(t)
	s := newStore(t, client(t), prefix, WithRetention(time.Hour))
	now := time.Now()
	var mu sync.Mutex
	s.dicts.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	var ids []uint32
	for i := 0; i < 3; i++ {
		if err := s.dicts.publish([][]byte{paymentLike(i)}, s.dicts.current); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, s.dicts.current.id)
		advance(90 * time.Minute)
	}
	// Now: d0 made at 0, d1 at 1.5 h, d2 at 3 h (current), clock 4.5 h.
	// d0's successor is 3 h old (> 2 h): gone at the last publish? It was
	// 1.5 h old then: kept. Publish again to prune.
	advance(time.Hour)
	if err := s.dicts.publish([][]byte{paymentLike(9)}, s.dicts.current); err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	have := map[uint32]bool{}
	resp, err := client(t).Get(ctx, prefix+"z/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		var id uint64
		if _, err := fmt.Sscanf(string(kv.Key), prefix+"z/%d", &id); err == nil {
			have[uint32(id)] = true
		}
	}
	if have[ids[0]] || have[ids[1]] || !have[ids[2]] || !have[s.dicts.current.id] {
		t.Fatalf("dictionaries left %v; want d0 and d1 pruned (successors 4 h and 2.5 h old), d2 and the current kept", have)
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
		_, err := adm.decode(Key{ID: "k"}, &mvccpb.KeyValue{Value: v, ModRevision: 3})
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: %v; want ErrCorrupt", name, err)
		}
	}
}
