package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/internal/workload"
)

// suiteScale: size, throughput and latency as retained keys grow: bytes of
// etcd per retained key (after compaction and defragmentation) in record
// formats 2 and 3, side by side in the same run; then a bucket's expiry.
// Each retained key saves a distinct response (--body json: a 1 KiB
// payment object with random ids, and its headers), so that what
// compression saves is what it saves on a real service.
func suiteScale(ctx context.Context, b *bencher) ([]suiteReport, error) {
	t, err := b.open(ctx, 1, etcdtest.Options{Configure: func(c *embed.Config) { c.QuotaBackendBytes = 8 << 30 }})
	if err != nil {
		return nil, err
	}
	defer t.close()
	stores, err := t.newStores(ctx) // the default format, 3
	if err != nil {
		return nil, err
	}
	v2, err := t.newStores(ctx, etcdstore.WithPrefix(t.prefix+"v2/"), etcdstore.WithRecordFormat(2))
	if err != nil {
		return nil, err
	}
	cli := t.clients[0]
	ep := cli.Endpoints()[0]
	params := []byte(`{"amount":100}`)
	var reports []suiteReport
	have := 0
	for _, s := range b.cfg.scaleKeys.vals {
		want, err := strconv.Atoi(s)
		if err != nil || want < have {
			return nil, fmt.Errorf("--scale-keys %q must grow", s)
		}
		extra := map[string]string{}
		var perKey3 float64
		var valueBytes int
		for _, f := range []struct {
			format int
			stores []*etcdstore.Store
		}{{2, v2}, {3, stores}} {
			before, heapBefore, err := settledSize(ctx, cli, ep)
			if err != nil {
				return nil, err
			}
			start := time.Now()
			n, err := b.fill(ctx, f.stores, fmt.Sprintf("retained-%d-", f.format), have, want)
			if err != nil {
				return nil, err
			}
			fill := time.Since(start)
			after, heapAfter, err := settledSize(ctx, cli, ep)
			if err != nil {
				return nil, err
			}
			perKey := float64(after-before) / float64(want-have)
			prefix := t.prefix
			if f.format == 2 {
				prefix += "v2/"
			}
			valueBytes, err = meanValue(ctx, cli, prefix+fmt.Sprintf("k/default/retained-%d-", f.format))
			if err != nil {
				return nil, err
			}
			label := fmt.Sprintf("format %d", f.format)
			extra[label+": filled in"] = fmt.Sprintf("%v (%.0f keys/s)", fill.Round(time.Millisecond), float64(n)/fill.Seconds())
			extra[label+": record value bytes"] = fmt.Sprintf("%d (mean of the last 100)", valueBytes)
			extra[label+": db bytes per key"] = fmt.Sprintf("%.0f", perKey)
			extra[label+": process heap per key"] = fmt.Sprintf("%.0f bytes (incl. the embedded etcd's index)", float64(heapAfter-heapBefore)/float64(want-have))
			if f.format == 3 {
				perKey3 = perKey
			}
		}
		have = want
		// The line runs are compared on: the default format.
		extra["db bytes per key"] = fmt.Sprintf("%.0f (format 3, after compaction and defragmentation)", perKey3)
		extra["record value bytes"] = strconv.Itoa(valueBytes)
		extra["retained keys per 8 GiB cluster"] = fmt.Sprintf("%.1f M", 8*float64(1<<30)/perKey3/1e6)
		extra["claims/s sustainable at 24 h retention per 8 GiB cluster"] = fmt.Sprintf("%.0f", 8*float64(1<<30)/perKey3/86400)
		leases, err := cli.Leases(ctx)
		if err != nil {
			return nil, err
		}
		extra["leases in use"] = strconv.Itoa(len(leases.Leases))
		fk := &keys{prefix: fmt.Sprintf("fresh-%d-", want)}
		res := b.compare(ctx,
			side{"idem Do, new keys", func(ctx context.Context, w int) (string, error) {
				return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: fk.next()}, params, b.work()))
			}},
			side{"idem replay of a retained key", func(ctx context.Context, w int) (string, error) {
				id := "retained-3-" + strconv.Itoa(int(time.Now().UnixNano()%int64(want)))
				return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: id}, params, nil))
			}},
		)
		reports = append(reports, suiteReport{
			Suite: "scale", Title: fmt.Sprintf("%d retained keys (formats 2 and 3 each), %s, %d clients", want, t.name, b.cfg.concurrency),
			Results: res, Extra: extra,
		})
	}
	leaseIDs, err := recordLeases(ctx, cli, t.prefix+"k/")
	if err != nil {
		return nil, err
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
	for ctx.Err() == nil && rerr == nil {
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

// fill saves keys prefix+[from, to) through stores, each with a distinct
// response as --body says, from b.cfg.concurrency workers.
func (b *bencher) fill(ctx context.Context, stores []*etcdstore.Store, prefix string, from, to int) (int, error) {
	var next atomic.Int64
	next.Store(int64(from))
	var done atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	params := []byte(`{"amount":100}`)
	fp := fingerprint(params)
	for w := 0; w < b.cfg.concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= to || ctx.Err() != nil {
					return
				}
				out := b.outcome(i)
				_, err := stores[w%len(stores)].Run(ctx, etcdstore.Key{ID: prefix + strconv.Itoa(i)}, fp,
					func(context.Context, *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
						return out, etcdstore.EndSave
					})
				if err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return int(done.Load()), err
	}
	return int(done.Load()), nil
}

// outcome is the i-th saved response of the scale suite.
func (b *bencher) outcome(i int) etcdstore.Outcome {
	if b.cfg.body == "fill" {
		return etcdstore.Outcome{Status: 200, Body: payload(b.cfg.payload)}
	}
	return etcdstore.Outcome{Status: 201, Header: workload.PaymentHeaders(), Body: workload.Payment(i)}
}

func fingerprint(params []byte) etcdstore.Fingerprint {
	fp, _ := etcdstore.FingerprintOf(params)
	return fp
}

// settledSize compacts etcd to its current revision, defragments it, and
// returns the database's size and the process heap after a GC.
func settledSize(ctx context.Context, cli *clientv3.Client, ep string) (int64, uint64, error) {
	st, err := cli.Status(ctx, ep)
	if err != nil {
		return 0, 0, err
	}
	if _, err := cli.Compact(ctx, st.Header.Revision, clientv3.WithCompactPhysical()); err != nil && !errors.Is(err, rpctypes.ErrCompacted) {
		return 0, 0, err // (compacted already: nothing was written since)
	}
	if _, err := cli.Defragment(ctx, ep); err != nil {
		return 0, 0, err
	}
	if st, err = cli.Status(ctx, ep); err != nil {
		return 0, 0, err
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return st.DbSize, ms.HeapAlloc, nil
}

// meanValue is the mean value size of the last 100 keys written under
// prefix (the first ones were written before there was a dictionary).
func meanValue(ctx context.Context, cli *clientv3.Client, prefix string) (int, error) {
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithLimit(100),
		clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortDescend))
	if err != nil || len(resp.Kvs) == 0 {
		return 0, err
	}
	n := 0
	for _, kv := range resp.Kvs {
		n += len(kv.Value)
	}
	return n / len(resp.Kvs), nil
}

// recordLeases returns the leases the records under prefix are on.
func recordLeases(ctx context.Context, cli *clientv3.Client, prefix string) (map[clientv3.LeaseID]bool, error) {
	ids := map[clientv3.LeaseID]bool{}
	key, end := prefix, clientv3.GetPrefixRangeEnd(prefix)
	for {
		// (WithKeysOnly would leave the lease out.)
		resp, err := cli.Get(ctx, key, clientv3.WithRange(end), clientv3.WithLimit(2000))
		if err != nil {
			return nil, err
		}
		for _, kv := range resp.Kvs {
			if kv.Lease != 0 {
				ids[clientv3.LeaseID(kv.Lease)] = true
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return ids, nil
		}
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// suiteWAN: 3 members 50 ms apart: a claim against one raft round.
func suiteWAN(ctx context.Context, b *bencher) ([]suiteReport, error) {
	if len(b.cfg.etcd.endpoints.vals) > 0 {
		return nil, fmt.Errorf("the wan suite needs embedded members (no --endpoints)")
	}
	t, err := b.open(ctx, 3, etcdtest.Options{Proxies: true, TickMs: 50, ElectionMs: 1000})
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
	// Clients on the leader first: a write then costs one raft round, no
	// forwarding. Then clients in a follower's data centre, whose idem
	// talks to its local member: etcd forwards each write to the leader.
	round := map[int]float64{} // p50 of a raw Put from the leader's DC, by clients
	var reps []suiteReport
	for _, place := range []string{"leader", "follower"} {
		member := lead
		if place == "follower" {
			member = (lead + 1) % len(t.cluster.Members)
		}
		for _, c := range t.clients {
			c.SetEndpoints(t.cluster.Members[member].ClientURL)
		}
		stores, err := t.newStores(ctx)
		if err != nil {
			return nil, err
		}
		rk, ck, dk := &keys{prefix: t.prefix + place + "/raw/"}, &keys{prefix: place + "-claim-"}, &keys{prefix: place + "-do-"}
		params := []byte(`{"amount":100}`)
		for _, conc := range []int{1, b.cfg.concurrency} {
			saved := b.cfg.concurrency
			b.cfg.concurrency = conc
			res := b.compare(ctx,
				side{"raw Put from the " + place + "'s DC", func(ctx context.Context, w int) (string, error) {
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
			if place == "leader" {
				round[conc] = res[0].P50
			}
			rep := suiteReport{
				Suite: "wan", Title: fmt.Sprintf("3 members 50 ms apart (peer links delayed 25 ms each way), clients in the %s's data centre, %d client(s)", place, conc),
				Results: res,
				Ratios: []ratio{
					latencyRatio("p50 claim / p50 raft round", res[1].P50, round[conc], map[string]float64{"leader": 1.1, "follower": 1.6}[place]),
					latencyRatio("p50 Do / p50 raft round", res[2].P50, round[conc], 0),
				},
			}
			if place == "follower" {
				rep.Notes = []string{"a raft round is the p50 of a raw Put from the leader's data centre, measured above with as many clients; a raw Put from the follower's is the floor of a claim there"}
				rep.Ratios = append(rep.Ratios, latencyRatio("p50 raw Put from the follower's DC / p50 raft round (the floor)", res[0].P50, round[conc], 0))
			}
			after := stores[0].Metrics().Batch
			rep.Extra = map[string]string{"idem batch round trip, hold at the end": fmt.Sprintf("%v, %v", after.RoundTrip.Round(10*time.Microsecond), after.Hold.Round(10*time.Microsecond))}
			reps = append(reps, rep)
		}
		for _, st := range stores {
			st.Close()
		}
	}
	return reps, nil
}
