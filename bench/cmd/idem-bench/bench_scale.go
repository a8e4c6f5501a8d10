package main

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/etcdcluster"
	"github.com/idem-dev/idem/lease"
)

// suiteScale: throughput, latency and size as retained keys grow; leases
// in use; a bucket's expiry.
func suiteScale(ctx context.Context, b *bencher) ([]suiteReport, error) {
	t, err := b.open(ctx, 1, etcdcluster.Options{Configure: func(c *embed.Config) { c.QuotaBackendBytes = 8 << 30 }})
	if err != nil {
		return nil, err
	}
	defer t.close()
	stores, err := t.newStores(ctx)
	if err != nil {
		return nil, err
	}
	cli := t.clients[0]
	ep := cli.Endpoints()[0]
	params := []byte(`{"amount":100}`)
	// A real record to copy: retained keys are made at bulk speed by
	// writing its bytes under many names, on the same retention lease.
	if _, err := stores[0].Do(ctx, etcdstore.Key{ID: "template"}, params, b.work()); err != nil {
		return nil, err
	}
	tmpl, err := cli.Get(ctx, t.prefix+"k/default/template")
	if err != nil || len(tmpl.Kvs) != 1 {
		return nil, fmt.Errorf("template record: %v", err)
	}
	value := string(tmpl.Kvs[0].Value)
	// Retained keys take their leases as idem does: a bucket's lease rolls
	// over every lease.DefaultMaxUses writes.
	buckets, err := lease.NewBuckets(cli, t.prefix+"l/", etcdstore.DefaultRetention, etcdstore.DefaultBucketWidth)
	if err != nil {
		return nil, err
	}
	leaseIDs := map[clientv3.LeaseID]bool{}
	var reports []suiteReport
	have := 0
	var last suiteReport
	for _, s := range b.cfg.scaleKeys.vals {
		want, err := strconv.Atoi(s)
		if err != nil || want < have {
			return nil, fmt.Errorf("--scale-keys %q must grow", s)
		}
		before, err := cli.Status(ctx, ep)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		if err := bulkPut(ctx, cli, buckets, leaseIDs, t.prefix+"k/default/retained-", value, have, want); err != nil {
			return nil, err
		}
		fill := time.Since(start)
		st, err := cli.Status(ctx, ep)
		if err != nil {
			return nil, err
		}
		perKey := float64(st.DbSize-before.DbSize) / float64(want-have)
		have = want
		leases, err := cli.Leases(ctx)
		if err != nil {
			return nil, err
		}
		fk := &keys{prefix: fmt.Sprintf("fresh-%d-", want)}
		res := b.compare(ctx,
			side{"idem Do, new keys", func(ctx context.Context, w int) (string, error) {
				return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: fk.next()}, params, b.work()))
			}},
			side{"idem replay of a retained key", func(ctx context.Context, w int) (string, error) {
				id := "retained-" + strconv.Itoa(int(time.Now().UnixNano()%int64(want)))
				return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: id}, params, b.work()))
			}},
		)
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		last = suiteReport{
			Suite: "scale", Title: fmt.Sprintf("%d retained keys, %s, %d clients", want, t.name, b.cfg.concurrency),
			Results: res,
			Extra: map[string]string{
				"filled in":                          fill.Round(time.Millisecond).String(),
				"etcd db size":                       fmt.Sprintf("%d bytes (%d in use) after the fill", st.DbSize, st.DbSizeInUse),
				"db bytes per key":                   fmt.Sprintf("%.0f (growth of the db file over the fill, per key)", perKey),
				"record value bytes":                 strconv.Itoa(len(value)),
				"leases in use":                      strconv.Itoa(len(leases.Leases)),
				"process heap (incl. embedded etcd)": fmt.Sprintf("%d MiB", ms.HeapAlloc>>20),
			},
		}
		reports = append(reports, last)
	}
	// A bucket's expiry: revoke every lease of the retained keys, as etcd
	// does when they expire together (they share the bucket's end), while
	// clients keep working.
	var during []time.Duration
	var mu sync.Mutex
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var ops atomic.Int64
	ek := &keys{prefix: "during-expiry-"}
	for w := 0; w < b.cfg.concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				if _, err := stores[w%clientPool].Do(ctx, etcdstore.Key{ID: ek.next()}, params, b.work()); err == nil {
					ops.Add(1)
					mu.Lock()
					during = append(during, time.Since(t0))
					mu.Unlock()
				}
			}
		}()
	}
	t0 := time.Now()
	var rerr error
	var rwg sync.WaitGroup
	ids := make(chan clientv3.LeaseID, len(leaseIDs))
	for id := range leaseIDs {
		ids <- id
	}
	close(ids)
	for w := 0; w < 4; w++ { // etcd's lessor revokes expired leases in batches
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			for id := range ids {
				if _, err := cli.Revoke(ctx, id); err != nil {
					rerr = err
				}
			}
		}()
	}
	rwg.Wait()
	revoke := time.Since(t0)
	// Wait for the deletions to be applied: the retained keys are gone.
	for ctx.Err() == nil {
		r, err := cli.Get(ctx, t.prefix+"k/default/retained-", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil && r.Count == 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	gone := time.Since(t0)
	close(stop)
	wg.Wait()
	sort.Slice(during, func(i, j int) bool { return during[i] < during[j] })
	exp := map[string]string{
		"revoke of the bucket's leases": fmt.Sprintf("%v for %d keys on %d leases (err %v)", revoke.Round(time.Millisecond), have, len(leaseIDs), rerr),
		"until every key was gone":      gone.Round(time.Millisecond).String(),
	}
	if n := len(during); n > 0 {
		exp["idem Do meanwhile"] = fmt.Sprintf("%d ops, %.0f ops/s, p50 %.2f ms, p99 %.2f ms, max %.2f ms", n, float64(n)/gone.Seconds(),
			ms(during[n/2]), ms(during[min(n-1, n*99/100)]), ms(during[n-1]))
	}
	reports = append(reports, suiteReport{Suite: "scale", Title: fmt.Sprintf("expiry of a retention bucket of %d keys", have), Extra: exp})
	return reports, nil
}

// bulkPut writes keys prefix+[from, to) with value, each on the lease the
// buckets hand out (recorded in ids), 100 per Txn, 16 Txns at a time.
func bulkPut(ctx context.Context, cli *clientv3.Client, buckets *lease.Buckets, ids map[clientv3.LeaseID]bool, prefix, value string, from, to int) error {
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr atomic.Value
	for w := 0; w < 16; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				lo := int(next.Add(100)) - 100
				if lo >= to || ctx.Err() != nil {
					return
				}
				ops := make([]clientv3.Op, 0, 100)
				for i := lo; i < min(lo+100, to); i++ {
					id, err := buckets.For(ctx, time.Now())
					if err != nil {
						firstErr.CompareAndSwap(nil, err)
						return
					}
					mu.Lock()
					ids[id] = true
					mu.Unlock()
					ops = append(ops, clientv3.OpPut(prefix+strconv.Itoa(i), value, clientv3.WithLease(id)))
				}
				if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return err
	}
	return nil
}

// suiteWAN: 3 members 50 ms apart: a claim against one raft round.
func suiteWAN(ctx context.Context, b *bencher) ([]suiteReport, error) {
	if len(b.cfg.etcd.endpoints.vals) > 0 {
		return nil, fmt.Errorf("the wan suite needs embedded members (no --endpoints)")
	}
	t, err := b.open(ctx, 3, etcdcluster.Options{Proxies: true, TickMs: 50, ElectionMs: 1000})
	if err != nil {
		return nil, err
	}
	defer t.close()
	for _, m := range t.cluster.Members {
		m.PeerProxy.Delay(25*time.Millisecond, 0) // every message crosses one proxy: 50 ms RTT
	}
	lead, err := t.cluster.WaitLeader(ctx, t.cluster.All())
	if err != nil {
		return nil, err
	}
	// Clients on the leader: a write then costs one raft round, no forwarding.
	for _, c := range t.clients {
		c.SetEndpoints(t.cluster.Members[lead].ClientURL)
	}
	stores, err := t.newStores(ctx)
	if err != nil {
		return nil, err
	}
	rk, ck, dk := &keys{prefix: t.prefix + "raw/"}, &keys{prefix: "claim-"}, &keys{prefix: "do-"}
	params := []byte(`{"amount":100}`)
	var reps []suiteReport
	for _, conc := range []int{1, b.cfg.concurrency} {
		saved := b.cfg.concurrency
		b.cfg.concurrency = conc
		res := b.compare(ctx,
			side{"raw Put (one raft round)", func(ctx context.Context, w int) (string, error) {
				_, err := t.clients[w%clientPool].Put(ctx, rk.next(), "x")
				return "put", err
			}},
			side{"idem Claim", func(ctx context.Context, w int) (string, error) {
				c, _, err := stores[w%clientPool].Claim(ctx, etcdstore.Key{ID: ck.next()}, etcdstore.Fingerprint{})
				if err != nil {
					return "", err
				}
				go c.Release(context.Background()) // not timed
				return "claimed", nil
			}},
			side{"idem Do (claim + complete)", func(ctx context.Context, w int) (string, error) {
				return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: dk.next()}, params, b.work()))
			}},
		)
		b.cfg.concurrency = saved
		reps = append(reps, suiteReport{
			Suite: "wan", Title: fmt.Sprintf("3 members 50 ms apart (peer links delayed 25 ms each way), clients on the leader, %d client(s)", conc),
			Results: res,
			Extra: map[string]string{
				"p50 claim / p50 raft round": fmt.Sprintf("%.2f", res[1].P50/res[0].P50),
				"p50 Do / p50 raft round":    fmt.Sprintf("%.2f", res[2].P50/res[0].P50),
			},
		})
	}
	return reps, nil
}
