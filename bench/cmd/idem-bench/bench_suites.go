package main

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/lease"
)

var suites map[string]func(context.Context, *bencher) ([]suiteReport, error)

func init() {
	suites = map[string]func(context.Context, *bencher) ([]suiteReport, error){
		"do": suiteDo, "replay": suiteReplay, "mix": suiteMix, "mutex": suiteMutex,
		"http": suiteHTTP, "scale": suiteScale, "wan": suiteWAN, "shards": suiteShards, "expiry": suiteExpiry,
	}
}

// target is an etcd cluster to measure on, and its clients.
type target struct {
	name    string
	cluster *etcdtest.Cluster // nil for --endpoints
	clients []*clientv3.Client
	prefix  string
	stores  []*etcdstore.Store
	opts    []etcdstore.Option // of every store (--record-format)
}

// clientPool is how many etcd clients the workers share.
const clientPool = 4

// open returns an embedded cluster of n members (or the --endpoints
// cluster) with a pool of clients on endpoints (default: every member).
func (b *bencher) open(ctx context.Context, n int, opts etcdtest.Options, endpoints ...string) (*target, error) {
	t := &target{prefix: fmt.Sprintf("/idem-bench/%d/", time.Now().UnixNano()),
		opts: []etcdstore.Option{etcdstore.WithRecordFormat(b.cfg.recordFormat), etcdstore.WithBatching(b.cfg.batching)}}
	if len(b.cfg.etcd.endpoints.vals) > 0 {
		t.name = "external etcd"
		endpoints = b.cfg.etcd.endpoints.vals
	} else {
		opts.Fsync = b.cfg.fsync
		c, err := etcdtest.New(fmt.Sprintf("%s/c%d", b.dir, time.Now().UnixNano()), n, opts)
		if err != nil {
			return nil, err
		}
		t.cluster = c
		t.name = fmt.Sprintf("%d member(s), fsync %v", n, b.cfg.fsync)
		if len(endpoints) == 0 {
			endpoints = c.Endpoints()
		}
	}
	for i := 0; i < clientPool; i++ {
		cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			t.close()
			return nil, err
		}
		t.clients = append(t.clients, cli)
	}
	return t, nil
}

// newStore makes one store on cli, under the target's prefix.
func (t *target) newStore(ctx context.Context, cli *clientv3.Client, opts ...etcdstore.Option) (*etcdstore.Store, error) {
	s, err := etcdstore.New(ctx, cli, append(append([]etcdstore.Option{etcdstore.WithPrefix(t.prefix)}, t.opts...), opts...)...)
	if err != nil {
		return nil, err
	}
	t.stores = append(t.stores, s)
	return s, nil
}

// newStores makes one store per client, under the target's prefix.
func (t *target) newStores(ctx context.Context, opts ...etcdstore.Option) ([]*etcdstore.Store, error) {
	var out []*etcdstore.Store
	for _, cli := range t.clients {
		s, err := etcdstore.New(ctx, cli, append(append([]etcdstore.Option{etcdstore.WithPrefix(t.prefix)}, t.opts...), opts...)...)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
		t.stores = append(t.stores, s)
	}
	return out, nil
}

func (t *target) close() {
	for _, s := range t.stores {
		s.Close()
	}
	for _, c := range t.clients {
		c.Close()
	}
	if t.cluster != nil {
		t.cluster.Close()
	}
}

// keys hands out fresh key names.
type keys struct {
	prefix string
	n      atomic.Int64
}

func (k *keys) next() string { return k.prefix + strconv.FormatInt(k.n.Add(1), 10) }

func payload(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a' + byte(i%26)
	}
	return b
}

func (b *bencher) work() etcdstore.Work {
	body := payload(b.cfg.payload)
	return func(context.Context, *etcdstore.Claim) ([]byte, error) { return body, nil }
}

func doOutcome(res etcdstore.Result, err error) (string, error) {
	switch {
	case err != nil:
		return "", err
	case res.Replayed:
		return "replayed", nil
	}
	return "claimed", nil
}

// rawPair is the raw etcd claim + fenced complete Txn pair idem is built on,
// writing values of the sizes idem's records have, so that the comparison
// measures idem's code and protocol, not the bytes.
func rawPair(cli func(int) *clientv3.Client, leaseID clientv3.LeaseID, k *keys, claimSize, doneSize int) op {
	claimVal, doneVal := string(payload(claimSize)), string(payload(doneSize))
	return func(ctx context.Context, w int) (string, error) {
		c, key := cli(w), k.next()
		r, err := c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, claimVal, clientv3.WithLease(leaseID))).Else(clientv3.OpGet(key)).Commit()
		if err != nil {
			return "", err
		}
		_, err = c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", r.Header.Revision)).
			Then(clientv3.OpPut(key, doneVal, clientv3.WithLease(leaseID))).Else(clientv3.OpGet(key)).Commit()
		return "pair", err
	}
}

func bucketLease(ctx context.Context, cli *clientv3.Client, prefix string) (clientv3.LeaseID, error) {
	bk, err := lease.NewBuckets(cli, prefix+"l/", etcdstore.DefaultRetention, etcdstore.DefaultBucketWidth)
	if err != nil {
		return 0, err
	}
	return bk.For(ctx, time.Now())
}

// suiteDo: idem Do against the raw Txn pair, on each cluster size.
func suiteDo(ctx context.Context, b *bencher) ([]suiteReport, error) {
	var reps []suiteReport
	for _, m := range b.cfg.members.vals {
		n, err := strconv.Atoi(m)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--members %q", m)
		}
		t, err := b.open(ctx, n, etcdtest.Options{})
		if err != nil {
			return nil, err
		}
		stores, err := t.newStores(ctx)
		if err != nil {
			t.close()
			return nil, err
		}
		id, err := bucketLease(ctx, t.clients[0], t.prefix+"raw/")
		if err != nil {
			t.close()
			return nil, err
		}
		k := &keys{prefix: t.prefix + "raw/k/"}
		ik := &keys{prefix: "do-"}
		params := []byte(`{"amount":100,"currency":"eur"}`)
		claimSize, doneSize, err := recordSizes(ctx, stores[0], t, params, b.work(), b.cfg.payload)
		if err != nil {
			t.close()
			return nil, err
		}
		var batchers []*rawBatcher
		for _, cli := range t.clients {
			batchers = append(batchers, &rawBatcher{cli: cli})
		}
		bk := &keys{prefix: t.prefix + "rawb/k/"}
		before := stores[0].Metrics().Batch
		res := b.compare(ctx,
			side{"raw txn pair", rawPair(func(w int) *clientv3.Client { return t.clients[w%clientPool] }, id, k, claimSize, doneSize)},
			side{"raw batched pair", rawBatchedPair(batchers, id, bk, claimSize, doneSize)},
			side{"idem Do", func(ctx context.Context, w int) (string, error) {
				return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: ik.next()}, params, b.work()))
			}},
		)
		after := stores[0].Metrics().Batch
		goalRaw, goalBatched := 1.5, 0.85
		if n > 1 {
			goalRaw = 1.8
		}
		if b.cfg.concurrency < 64 {
			goalRaw, goalBatched = 0, 0 // the goals are for a loaded store
		}
		rep := suiteReport{
			Suite: "do", Title: fmt.Sprintf("idem Do (claim, trivial work, complete) against the raw claim + fenced complete Txn pair, %s, %d clients", t.name, b.cfg.concurrency),
			Notes: []string{fmt.Sprintf("the raw pairs write %d- and %d-byte values, the sizes of idem's in-flight and done records", claimSize, doneSize),
				"raw batched pair: the same Txns, each the inner Txn of an outer one, batched as idem batches (what waits goes together, at most 64; a new batch when none is in flight, or when a full one waits, or once the hold idem's pacer derives from the measured round trips has passed since the last; at most 4 in flight)"},
			Results: res,
			Ratios: []ratio{ratioOf("idem Do / raw txn pair", res[2], res[0], goalRaw),
				ratioOf("idem Do / raw batched pair", res[2], res[1], goalBatched)},
			Extra: map[string]string{"idem writes per etcd request": fmt.Sprintf("%.1f",
				float64(after.Members-before.Members)/max(1, float64(after.Batches-before.Batches))),
				"idem batches sent beside others (full, after the hold)": fmt.Sprintf("%d, %d", after.Full-before.Full, after.Beside-before.Beside-(after.Full-before.Full)),
				"idem batch round trip, hold at the end":                 fmt.Sprintf("%v, %v", after.RoundTrip.Round(10*time.Microsecond), after.Hold.Round(10*time.Microsecond))},
		}
		if b.cfg.concurrency == 1 {
			rep.Ratios = append(rep.Ratios, latencyRatio("p50 latency idem Do / raw txn pair", res[2].P50, res[0].P50, 1.05))
		}
		if res[0].ClientCPU > 0 {
			rep.Ratios = append(rep.Ratios, ratio{Name: "client CPU per op, idem Do / raw txn pair", Value: math.Round(res[2].ClientCPU/res[0].ClientCPU*1000) / 1000})
		}
		reps = append(reps, rep)
		t.close()
	}
	return reps, nil
}

// recordSizes runs one Do and returns the sizes of idem's in-flight and
// done records.
func recordSizes(ctx context.Context, s *etcdstore.Store, t *target, params []byte, work etcdstore.Work, payload int) (int, int, error) {
	size := func(id string) (int, error) {
		r, err := t.clients[0].Get(ctx, t.prefix+"k/"+etcdstore.DefaultTenant+"/"+id)
		if err != nil || len(r.Kvs) != 1 {
			return 0, fmt.Errorf("size probe %s: %v", id, err)
		}
		return len(r.Kvs[0].Value), nil
	}
	if _, err := s.Do(ctx, etcdstore.Key{ID: "size-probe"}, params, work); err != nil {
		return 0, 0, err
	}
	done, err := size("size-probe")
	if err != nil {
		return 0, 0, err
	}
	fp, err := etcdstore.FingerprintOf(params)
	if err != nil {
		return 0, 0, err
	}
	c, _, err := s.Claim(ctx, etcdstore.Key{ID: "size-probe-claim"}, fp)
	if err != nil {
		return 0, 0, err
	}
	defer c.Release(ctx)
	claim, err := size("size-probe-claim")
	return claim, done, err
}

// populate completes count keys through s, concurrently.
func (b *bencher) populate(ctx context.Context, s *etcdstore.Store, name func(int) string, params []byte, count int) error {
	var next atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= count || ctx.Err() != nil {
					return
				}
				if _, err := s.Do(ctx, etcdstore.Key{ID: name(i)}, params, b.work()); err != nil {
					once.Do(func() { firstErr = err })
					return
				}
			}
		}()
	}
	wg.Wait()
	return firstErr
}

// suiteReplay: replays of done keys against a raw linearizable Get, with
// and without the cache.
func suiteReplay(ctx context.Context, b *bencher) ([]suiteReport, error) {
	var reps []suiteReport
	for _, m := range b.cfg.members.vals {
		n, _ := strconv.Atoi(m)
		t, err := b.open(ctx, n, etcdtest.Options{})
		if err != nil {
			return nil, err
		}
		// One cached store, as one process has (created before the keys
		// exist, so its watch sees them).
		cachedStore, err := t.newStore(ctx, t.clients[0], etcdstore.WithCache(512<<20))
		if err != nil {
			t.close()
			return nil, err
		}
		plain, err := t.newStores(ctx)
		if err != nil {
			t.close()
			return nil, err
		}
		params := []byte(`{"amount":100}`)
		name := func(i int) string { return "replay-" + strconv.Itoa(i) }
		if err := b.populate(ctx, plain[0], name, params, b.cfg.keys); err != nil {
			t.close()
			return nil, err
		}
		for cachedStore.Metrics().Cache.Entries < b.cfg.keys && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond) // the watch fills the cache
		}
		// Warm the adaptive claim path: replays make it read first.
		for _, s := range plain {
			for i := 0; i < 200; i++ {
				if _, err := s.Do(ctx, etcdstore.Key{ID: name(i)}, params, b.work()); err != nil {
					t.close()
					return nil, err
				}
			}
		}
		pick := func() etcdstore.Key { return etcdstore.Key{ID: name(rand.IntN(b.cfg.keys))} }
		rec := t.prefix + "k/" + etcdstore.DefaultTenant + "/"
		res := b.compare(ctx,
			side{"raw linearizable Get", func(ctx context.Context, w int) (string, error) {
				_, err := t.clients[w%clientPool].Get(ctx, rec+name(rand.IntN(b.cfg.keys)))
				return "get", err
			}},
			side{"idem replay", func(ctx context.Context, w int) (string, error) {
				return doOutcome(plain[w%clientPool].Do(ctx, pick(), params, b.work()))
			}},
			side{"idem replay, cached", func(ctx context.Context, w int) (string, error) {
				return doOutcome(cachedStore.Do(ctx, pick(), params, b.work()))
			}},
		)
		cs := cachedStore.Metrics().Cache
		reps = append(reps, suiteReport{
			Suite: "replay", Title: fmt.Sprintf("replay of %d done keys against a raw linearizable Get, %s, %d clients", b.cfg.keys, t.name, b.cfg.concurrency),
			Results: res,
			Ratios: []ratio{
				ratioOf("idem replay / raw Get", res[1], res[0], 1),
				ratioOf("idem replay, cached / raw Get", res[2], res[0], 10),
			},
			Extra: map[string]string{"cache": fmt.Sprintf("%d entries, %d bytes, %d hits, %d misses", cs.Entries, cs.Bytes, cs.Hits, cs.Misses)},
		})
		t.close()
	}
	return reps, nil
}
