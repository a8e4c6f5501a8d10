package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/shard"
)

// suiteShards: keys spread over three one-member etcd clusters by package
// shard, against one store on one of them: how the load spreads (claims
// and bytes per shard) and what routing costs per request. On one machine
// the three clusters share its CPUs and disk, so the spread, not the sum,
// is the figure to read.
func suiteShards(ctx context.Context, b *bencher) ([]suiteReport, error) {
	if len(b.cfg.etcd.endpoints.vals) > 0 {
		return nil, fmt.Errorf("the shards suite starts its own clusters (no --endpoints)")
	}
	var targets []*target
	defer func() {
		for _, t := range targets {
			t.close()
		}
	}()
	cfg := shard.Config{}
	for _, n := range []string{"a", "b", "c"} {
		t, err := b.open(ctx, 1, etcdtest.Options{})
		if err != nil {
			return nil, err
		}
		targets = append(targets, t)
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: n, Client: t.clients[0]})
	}
	prefix := targets[0].prefix
	sharded, err := shard.New(ctx, cfg, append(targets[0].opts, etcdstore.WithPrefix(prefix))...)
	if err != nil {
		return nil, err
	}
	defer sharded.Close()
	single, err := targets[0].newStores(ctx, etcdstore.WithPrefix(prefix+"single/"))
	if err != nil {
		return nil, err
	}
	params := []byte(`{"amount":100}`)
	sk, ok := &keys{prefix: "single-"}, &keys{prefix: "sharded-"}
	res := b.compare(ctx,
		side{"one store, one cluster", func(ctx context.Context, w int) (string, error) {
			return doOutcome(single[w%clientPool].Do(ctx, etcdstore.Key{ID: sk.next()}, params, b.work()))
		}},
		side{"shard.Store over 3 clusters", func(ctx context.Context, w int) (string, error) {
			return doOutcome(sharded.Do(ctx, etcdstore.Key{ID: ok.next()}, params, b.work()))
		}},
	)
	extra := map[string]string{}
	for i, n := range sharded.Shards() {
		st, err := storex.ReadStats(sharded.Shard(n), ctx, 0)
		if err != nil {
			return nil, err
		}
		cli := targets[i].clients[0]
		s, err := cli.Status(ctx, cli.Endpoints()[0])
		if err != nil {
			return nil, err
		}
		extra["shard "+n] = fmt.Sprintf("%d records (%.1f%% of the sharded ones), db %d bytes", st.Records,
			100*float64(st.Records)/float64(max(1, ok.n.Load())), s.DbSize)
	}
	const places = 1_000_000
	start := time.Now()
	for i := 0; i < places; i++ {
		sharded.Place(etcdstore.Key{ID: "k" + strconv.Itoa(i)})
	}
	extra["placement, per key"] = fmt.Sprintf("%.0f ns (rendezvous over 3 shards; %d keys)", float64(time.Since(start).Nanoseconds())/places, places)
	return []suiteReport{{
		Suite: "shards", Title: fmt.Sprintf("Do on one store against shard.Store over 3 one-member clusters, fsync %v, %d clients", b.cfg.fsync, b.cfg.concurrency),
		Notes:   []string{"the three clusters share this machine's CPUs and disk: read the spread, not the sum"},
		Results: res, Extra: extra,
		Ratios: []ratio{ratioOf("sharded Do / one store's Do", res[1], res[0], 0)},
	}}, nil
}
