package cache

import (
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/idem-dev/idem/clock"
)

func TestEvictsLeastRecentlyUsed(t *testing.T) {
	kv := func(size int) *mvccpb.KeyValue { return &mvccpb.KeyValue{Value: make([]byte, size), ModRevision: 1} }
	c := New(Config[int]{Clock: clock.Real, Bytes: 3 * (10 + 1 + 256), Bound: time.Hour,
		Decode: func(kv *mvccpb.KeyValue) (int, error) { return len(kv.Value), nil }})
	c.current.Store(time.Now().UnixNano()) // as if a progress answer had just come
	for _, k := range []string{"a", "b", "c"} {
		c.put(k, kv(10))
	}
	c.Get("a") // a is now the most recently used
	c.put("d", kv(10))
	_, b := c.Get("b")
	_, a := c.Get("a")
	_, d := c.Get("d")
	if b || !a || !d {
		t.Fatalf("after d came: b %v, a %v, d %v cached; want the least recently used (b) evicted", b, a, d)
	}
	c.put("huge", kv(1<<20))
	if _, ok := c.Get("huge"); ok {
		t.Fatal("an entry larger than the cache was kept")
	}
}

// A cache that has not proved itself current within its bound answers
// nothing, however full it is.
func TestStaleCacheAnswersNothing(t *testing.T) {
	c := New(Config[int]{Clock: clock.Real, Bytes: 1 << 20, Bound: time.Second,
		Decode: func(kv *mvccpb.KeyValue) (int, error) { return len(kv.Value), nil }})
	c.put("a", &mvccpb.KeyValue{Value: []byte("x"), ModRevision: 1})
	if _, ok := c.Get("a"); ok {
		t.Fatal("a cache never proved current answered")
	}
	c.current.Store(time.Now().Add(-2 * time.Second).UnixNano())
	if _, ok := c.Get("a"); ok {
		t.Fatal("a cache last current 2 s ago (bound 1 s) answered")
	}
	c.current.Store(time.Now().UnixNano())
	if _, ok := c.Get("a"); !ok {
		t.Fatal("a current cache did not answer")
	}
	if st := c.Stats(); st.Stale != 2 || st.Hits != 1 {
		t.Fatalf("stats %+v; want 2 stale lookups, 1 hit", st)
	}
}
