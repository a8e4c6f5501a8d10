package main

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

// suiteExpiry: keys written at a steady rate with a short retention, and a
// claim load running while they expire, by etcd's real expiry (or the
// store's sweeper), never an explicit revoke. It reports the claim load's
// p99 while keys expire against before, and the longest stretch in which no
// request completed.
func suiteExpiry(ctx context.Context, b *bencher) ([]suiteReport, error) {
	n, err := strconv.Atoi(b.cfg.members.vals[0])
	if err != nil || n < 1 {
		return nil, fmt.Errorf("--members %q", b.cfg.members.vals[0])
	}
	t, err := b.open(ctx, n, etcdtest.Options{})
	if err != nil {
		return nil, err
	}
	defer t.close()
	retention, width := b.cfg.expiryRetention, b.cfg.expiryWidth
	stores, err := t.newStores(ctx, etcdstore.WithRetention(retention), etcdstore.WithBucketWidth(width),
		etcdstore.WithExpirySweep(b.cfg.sweep))
	if err != nil {
		return nil, err
	}
	cli := t.clients[0]
	rev, err := cli.Get(ctx, "/none")
	if err != nil {
		return nil, err
	}
	// Deletions of the written keys, as etcd applies them.
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	var firstDelete, lastDelete atomic.Int64
	var deleted atomic.Int64
	go func() {
		for wr := range cli.Watch(wctx, t.prefix+"k/default/exp-", clientv3.WithPrefix(), clientv3.WithRev(rev.Header.Revision+1)) {
			now := time.Now().UnixNano()
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					firstDelete.CompareAndSwap(0, now)
					lastDelete.Store(now)
					deleted.Add(1)
				}
			}
		}
	}()

	total := b.cfg.expiryKeys
	rate := b.cfg.expiryRate
	start := time.Now()
	var mu sync.Mutex
	type sample struct {
		at  int64 // completion, unix ns
		lat time.Duration
	}
	var probes []sample
	var completions []int64 // of every request, writers' and probes'
	record := func(at int64, lat time.Duration, probe bool) {
		mu.Lock()
		completions = append(completions, at)
		if probe {
			probes = append(probes, sample{at, lat})
		}
		mu.Unlock()
	}
	params := []byte(`{"amount":100}`)
	// The writers: total keys at rate keys/s, then on at the same rate
	// (fresh keys that expire after the run) until the first total have
	// expired, so the load is the same before and during the expiry.
	tokens := make(chan struct{}, 4096)
	stop := make(chan struct{})
	go func() {
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		due := 0.0
		for {
			select {
			case <-stop:
				close(tokens)
				return
			case <-tick.C:
			}
			due += float64(rate) / 1000
			for ; due >= 1; due-- {
				select {
				case tokens <- struct{}{}:
				default: // the writers are behind: the rate is not met
				}
			}
		}
	}()
	var written atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < b.cfg.concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range tokens {
				i := written.Add(1)
				id := "exp-" + strconv.FormatInt(i, 10)
				if i > int64(total) {
					id = "late-" + strconv.FormatInt(i, 10)
				}
				t0 := time.Now()
				if _, err := stores[w%len(stores)].Do(ctx, etcdstore.Key{ID: id}, params, b.work()); err == nil {
					record(time.Now().UnixNano(), time.Since(t0), false)
				}
			}
		}()
	}
	// The claim load being measured: 16 clients, fresh keys.
	pk := &keys{prefix: "probe-"}
	for w := 0; w < 16; w++ {
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
				if _, err := stores[w%len(stores)].Do(ctx, etcdstore.Key{ID: pk.next()}, params, b.work()); err == nil {
					record(time.Now().UnixNano(), time.Since(t0), true)
				}
			}
		}()
	}
	// Until every written key of the first total has been deleted (or a
	// generous bound).
	limit := start.Add(retention + 2*width + time.Duration(float64(total)/float64(rate)*float64(time.Second))*2 + 2*time.Minute)
	for deleted.Load() < int64(total) && time.Now().Before(limit) && ctx.Err() == nil {
		time.Sleep(100 * time.Millisecond) // the run's own duration: keys expire in real time
	}
	close(stop)
	wg.Wait()
	wcancel()
	elapsed := time.Since(start)

	fd, ld := firstDelete.Load(), lastDelete.Load()
	var steady, during []time.Duration
	warm := start.Add(5 * time.Second).UnixNano()
	for _, p := range probes {
		switch {
		case p.at >= warm && (fd == 0 || p.at < fd):
			steady = append(steady, p.lat)
		case fd != 0 && p.at >= fd && p.at <= ld:
			during = append(during, p.lat)
		}
	}
	sort.Slice(completions, func(i, j int) bool { return completions[i] < completions[j] })
	var stall time.Duration
	for i := 1; i < len(completions); i++ {
		if completions[i] >= fd && completions[i-1] <= ld {
			stall = max(stall, time.Duration(completions[i]-completions[i-1]))
		}
	}
	p99 := func(l []time.Duration) time.Duration {
		if len(l) == 0 {
			return 0
		}
		sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
		return l[min(len(l)-1, len(l)*99/100)]
	}
	leases, err := cli.Get(ctx, t.prefix+"l/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return nil, err
	}
	sw := etcdstore.SweepMetrics{}
	for _, s := range stores {
		st := s.Metrics().Sweep
		sw.Leases += st.Leases
		sw.Records += st.Records
	}
	ratioV := 0.0
	if ps := p99(steady); ps > 0 {
		ratioV = float64(p99(during)) / float64(ps)
	}
	met := ratioV <= 2 && stall <= 250*time.Millisecond
	extra := map[string]string{
		"keys expired":                   fmt.Sprintf("%d of %d written at %d/s (%.0f/s achieved), retention %v, bucket width %v, sweeper %v", deleted.Load(), total, rate, float64(written.Load())/elapsed.Seconds(), retention, width, b.cfg.sweep),
		"expiry lasted":                  fmt.Sprintf("%v", time.Duration(ld-fd).Round(time.Millisecond)),
		"probe p99 steady":               fmt.Sprintf("%.2f ms over %d requests", ms(p99(steady)), len(steady)),
		"probe p99 during expiry":        fmt.Sprintf("%.2f ms over %d requests", ms(p99(during)), len(during)),
		"leases at the end":              fmt.Sprintf("%d bucket leases live (retention/width x shards)", leases.Count),
		"swept by the stores":            fmt.Sprintf("%d records from %d leases", sw.Records, sw.Leases),
		"p99 during expiry / steady p99": fmt.Sprintf("%.2f", ratioV),
		"longest stall ms":               fmt.Sprintf("%.0f", ms(stall)),
		"goals (X <= 2, Y <= 250)":       map[bool]string{true: "met", false: "NOT met"}[met],
	}
	return []suiteReport{{Suite: "expiry", Title: fmt.Sprintf("%d keys expiring under a claim load, %s", total, t.name), Extra: extra}}, nil
}
