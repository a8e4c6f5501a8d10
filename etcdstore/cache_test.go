package etcdstore

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// countingClient returns a client that counts its unary RPCs.
func countingClient(t *testing.T, calls *atomic.Int64) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: single.Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				calls.Add(1)
				return invoker(ctx, method, req, reply, cc, opts...)
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// waitFor polls cond: the cache is fed by a watch in another goroutine,
// with no event to wait on from outside.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	ctx := testCtx(t)
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func raftIndex(t *testing.T, cli *clientv3.Client) uint64 {
	t.Helper()
	st, err := cli.Status(context.Background(), single.Endpoints()[0])
	if err != nil {
		t.Fatal(err)
	}
	return st.RaftIndex
}

func TestCacheReplaysWithoutEtcd(t *testing.T) {
	var calls atomic.Int64
	cli := countingClient(t, &calls)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix, WithCache(1<<20))
	other := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	runs := 0
	work := func(context.Context, *Claim) ([]byte, error) { runs++; return []byte("ok"), nil }

	if _, err := other.Do(ctx, Key{ID: "k"}, []byte("p"), work); err != nil { // done by another process
		t.Fatal(err)
	}
	waitFor(t, "the watch to cache the record", func() bool { return s.CacheStats().Entries == 1 })
	before := calls.Load()
	res, err := s.Do(ctx, Key{ID: "k"}, []byte("p"), work)
	if err != nil || !res.Replayed || string(res.Body) != "ok" {
		t.Fatalf("replay = %+v, %v", res, err)
	}
	if _, err := s.Do(ctx, Key{ID: "k"}, []byte("other"), work); !errors.Is(err, ErrMismatch) {
		t.Fatalf("mismatch from the cache = %v", err)
	}
	if n := calls.Load() - before; n != 0 {
		t.Fatalf("a cached replay made %d etcd calls; want 0", n)
	}
	// Evicted elsewhere: the watch invalidates, and the key runs again.
	if err := other.Evict(ctx, Key{ID: "k"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the watch to invalidate the record", func() bool { return s.CacheStats().Entries == 0 })
	if res, err := s.Do(ctx, Key{ID: "k"}, []byte("p"), work); err != nil || res.Replayed || runs != 2 {
		t.Fatalf("after an eviction = %+v, %v (runs %d); want a new run", res, err, runs)
	}
	// Evicted here: invalidated at once, no waiting.
	waitFor(t, "the new record to be cached", func() bool { return s.CacheStats().Entries == 1 })
	if err := s.Evict(ctx, Key{ID: "k"}); err != nil {
		t.Fatal(err)
	}
	if res, err := s.Do(ctx, Key{ID: "k"}, []byte("p"), work); err != nil || res.Replayed || runs != 3 {
		t.Fatalf("after a local eviction = %+v, %v (runs %d); want a new run at once", res, err, runs)
	}
}

func TestCacheEvictsLeastRecentlyUsed(t *testing.T) {
	val := encode(&Record{State: Done, Outcome: &Outcome{Body: []byte("x")}}, 1)
	kv := func(size int) *mvccpb.KeyValue {
		return &mvccpb.KeyValue{Value: append(val, make([]byte, size)...), ModRevision: 1}
	}
	c := newDoneCache(3 * int64(len(val)+10+1+256))
	for _, k := range []string{"a", "b", "c"} {
		c.put(k, kv(10))
	}
	c.get("a", Key{ID: "a"}) // a is now the most recently used
	c.put("d", kv(10))
	if c.get("b", Key{ID: "b"}) != nil || c.get("a", Key{ID: "a"}) == nil || c.get("d", Key{ID: "d"}) == nil {
		t.Fatal("the least recently used entry was not the one evicted")
	}
	c.put("huge", kv(1<<20))
	if c.get("huge", Key{ID: "huge"}) != nil {
		t.Fatal("an entry larger than the cache was kept")
	}
	if !isDone(val) || isDone(encode(&Record{State: InFlight}, 1)) || isDone(nil) {
		t.Fatal("isDone misjudges a record's state")
	}
}

// On the read-first path a replay is not a raft write; on the write-first
// path it is (the claim Txn's Else runs, but the Txn is still proposed).
func TestReplayIsNotARaftWrite(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	reading := newStore(t, cli, prefix, WithClaimPath(ClaimPathReadFirst))
	writing := newStore(t, cli, prefix, WithClaimPath(ClaimPathWriteFirst))
	ctx := testCtx(t)
	work := func(context.Context, *Claim) ([]byte, error) { return []byte("ok"), nil }
	if _, err := reading.Do(ctx, Key{ID: "k"}, nil, work); err != nil {
		t.Fatal(err)
	}
	before := raftIndex(t, cli)
	if res, err := reading.Do(ctx, Key{ID: "k"}, nil, work); err != nil || !res.Replayed {
		t.Fatalf("replay = %+v, %v", res, err)
	}
	if after := raftIndex(t, cli); after != before {
		t.Fatalf("a read-first replay moved the raft index %d -> %d", before, after)
	}
	if res, err := writing.Do(ctx, Key{ID: "k"}, nil, work); err != nil || !res.Replayed {
		t.Fatalf("replay = %+v, %v", res, err)
	}
	if after := raftIndex(t, cli); after == before {
		t.Fatal("a write-first replay did not move the raft index: the comparison proves nothing")
	}
}

// The adaptive path switches to reading first when replays dominate, and
// back when new keys do.
func TestAdaptiveClaimPath(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t))
	ctx := testCtx(t)
	work := func(context.Context, *Claim) ([]byte, error) { return []byte("ok"), nil }
	if s.readFirst() {
		t.Fatal("a new store reads first")
	}
	if _, err := s.Do(ctx, Key{ID: "k"}, nil, work); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 40 && !s.readFirst(); i++ {
		if _, err := s.Do(ctx, Key{ID: "k"}, nil, work); err != nil {
			t.Fatal(err)
		}
	}
	if !s.readFirst() {
		t.Fatal("40 replays in a row did not switch to reading first")
	}
	for i := 0; i < 400 && s.readFirst(); i++ {
		if _, err := s.Do(ctx, Key{ID: "new-" + string(rune('a'+i%26)) + string(rune('a'+i/26))}, nil, work); err != nil {
			t.Fatal(err)
		}
	}
	if s.readFirst() {
		t.Fatal("400 new keys in a row did not switch back to writing first")
	}
}
