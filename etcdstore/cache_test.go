package etcdstore

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

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
	waitFor(t, "the watch to cache the record and prove itself current", func() bool {
		st := s.Metrics().Cache
		return st.Entries == 1 && st.Lag < DefaultCacheStaleness/2
	})
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
	waitFor(t, "the watch to invalidate the record", func() bool { return s.Metrics().Cache.Entries == 0 })
	if res, err := s.Do(ctx, Key{ID: "k"}, []byte("p"), work); err != nil || res.Replayed || runs != 2 {
		t.Fatalf("after an eviction = %+v, %v (runs %d); want a new run", res, err, runs)
	}
	// Evicted here: invalidated at once, no waiting.
	waitFor(t, "the new record to be cached", func() bool { return s.Metrics().Cache.Entries == 1 })
	if err := s.Evict(ctx, Key{ID: "k"}); err != nil {
		t.Fatal(err)
	}
	if res, err := s.Do(ctx, Key{ID: "k"}, []byte("p"), work); err != nil || res.Replayed || runs != 3 {
		t.Fatalf("after a local eviction = %+v, %v (runs %d); want a new run at once", res, err, runs)
	}
}

func TestIsDone(t *testing.T) {
	val := encode(&Record{State: Done, Outcome: &Outcome{Body: []byte("x")}}, 1)
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

// A process whose link to etcd stops moving bytes (TCP kept open, as in a
// partition) stops replaying from its cache once it cannot prove the cache
// current within the staleness bound: an outcome evicted and replaced
// elsewhere meanwhile is neither replayed nor held against the new
// parameters; the claim goes to etcd and fails there as unavailable. Once
// the link heals, the new outcome is what it sees.
func TestCutOffCacheStopsReplaying(t *testing.T) {
	const bound = 500 * time.Millisecond
	proxy := newProxy(t, single.Endpoints()[0])
	prefix := testPrefix(t)
	cut := newStore(t, single.MustClient(t, proxy.URL()), prefix, WithCache(1<<20), WithCacheStaleness(bound), WithRequestTimeout(time.Second))
	other := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	k := Key{ID: "k"}
	work := func(out string) func(context.Context, *Claim) ([]byte, error) {
		return func(context.Context, *Claim) ([]byte, error) { return []byte(out), nil }
	}
	if _, err := other.Do(ctx, k, []byte(`{"v":1}`), work("first")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the cut store's cache to hold the record, current", func() bool {
		st := cut.Metrics().Cache
		return st.Entries == 1 && st.Lag < bound/2
	})
	if res, err := cut.Do(ctx, k, []byte(`{"v":1}`), work("never")); err != nil || string(res.Body) != "first" {
		t.Fatalf("cached replay = %q, %v", res.Body, err)
	}

	proxy.Blackhole()
	cutAt := time.Now()
	if err := other.Evict(ctx, k); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Do(ctx, k, []byte(`{"v":2}`), work("second")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the cache to pass its staleness bound", func() bool { return cut.Metrics().Cache.Lag > bound })
	t.Logf("cut off: the cache stopped answering %v after the cut (bound %v)", time.Since(cutAt).Round(time.Millisecond), bound)
	for _, params := range []string{`{"v":1}`, `{"v":2}`} {
		res, err := cut.Do(ctx, k, []byte(params), work("never"))
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("cut off, past the bound, params %s: %q replayed=%v, %v; want ErrUnavailable", params, res.Body, res.Replayed, err)
		}
	}
	st := cut.Metrics().Cache
	if st.Stale == 0 {
		t.Fatalf("cache stats %+v: want lookups refused as stale", st)
	}

	proxy.Heal()
	waitFor(t, "the cut store to see the new outcome", func() bool {
		res, err := cut.Do(ctx, k, []byte(`{"v":2}`), work("never"))
		return err == nil && string(res.Body) == "second"
	})
}
