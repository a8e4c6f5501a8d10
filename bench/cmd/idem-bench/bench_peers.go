package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/prometheus/client_golang/prometheus"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

// mixer issues the mix of fresh keys and retries of done keys.
type mixer struct {
	b     *bencher
	fresh keys
	mu    sync.Mutex
	done  []string // keys known done, for retries
}

// next returns the key of the next request, and whether it is a retry.
func (m *mixer) next(retries float64) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.done) > 0 && rand.Float64() < retries {
		return m.done[rand.IntN(len(m.done))], true
	}
	return m.fresh.next(), false
}

func (m *mixer) completed(key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.done) < 100000 {
		m.done = append(m.done, key)
	} else {
		m.done[rand.IntN(len(m.done))] = key
	}
}

// request runs one request of the mix through run, sending it twice at once
// with probability duplicates.
func (m *mixer) request(ctx context.Context, retries float64, run func(context.Context, string) (string, error)) (string, error) {
	key, _ := m.next(retries)
	if rand.Float64() < m.b.cfg.duplicates {
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); run(ctx, key) }()
		defer wg.Wait()
	}
	out, err := run(ctx, key)
	if err == nil && out == "claimed" {
		m.completed(key)
	}
	return out, err
}

// suiteMix: a realistic mix (50% retries) and fresh claims, idem against
// a PostgreSQL table of keys when --pg is given.
func suiteMix(ctx context.Context, b *bencher) ([]suiteReport, error) {
	var reps []suiteReport
	for _, m := range b.cfg.members.vals {
		n, err := strconv.Atoi(m)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--members %q", m)
		}
		rep, err := mixOn(ctx, b, n)
		if err != nil {
			return nil, err
		}
		reps = append(reps, rep...)
	}
	return reps, nil
}

// mixOn runs the mix suite on an embedded cluster of n members.
func mixOn(ctx context.Context, b *bencher, n int) ([]suiteReport, error) {
	t, err := b.open(ctx, n, etcdtest.Options{})
	if err != nil {
		return nil, err
	}
	defer t.close()
	// One store with its cache, as one idem process has: the cache's watch
	// is per store.
	store, err := t.newStore(ctx, t.clients[0], etcdstore.WithCache(512<<20))
	if err != nil {
		return nil, err
	}
	plain, err := t.newStores(ctx)
	if err != nil {
		return nil, err
	}
	params := []byte(`{"amount":100,"currency":"eur"}`)
	idemRun := func(ctx context.Context, key string) (string, error) {
		return doOutcome(store.Do(ctx, etcdstore.Key{ID: key}, params, b.work()))
	}
	plainRun := func(ctx context.Context, key string) (string, error) {
		return doOutcome(plain[rand.IntN(clientPool)].Do(ctx, etcdstore.Key{ID: key}, params, b.work()))
	}
	sides := func(retries float64, pg *pgSeed, rs []*redisSeed) []side {
		im := &mixer{b: b, fresh: keys{prefix: fmt.Sprintf("mix-%v-", retries)}}
		nm := &mixer{b: b, fresh: keys{prefix: fmt.Sprintf("nocache-%v-", retries)}}
		s := []side{
			{"idem, cache", func(ctx context.Context, w int) (string, error) { return im.request(ctx, retries, idemRun) }},
			{"idem, no cache", func(ctx context.Context, w int) (string, error) { return nm.request(ctx, retries, plainRun) }},
		}
		if pg != nil {
			pm := &mixer{b: b, fresh: keys{prefix: fmt.Sprintf("mix-%v-", retries)}}
			s = append(s, side{"postgresql key table", func(ctx context.Context, w int) (string, error) {
				return pm.request(ctx, retries, func(ctx context.Context, key string) (string, error) {
					return pg.run(ctx, key, params, payload(b.cfg.payload))
				})
			}})
		}
		for _, r := range rs {
			rm := &mixer{b: b, fresh: keys{prefix: fmt.Sprintf("mix-%v-", retries)}}
			s = append(s, side{r.name(), func(ctx context.Context, w int) (string, error) {
				return rm.request(ctx, retries, func(ctx context.Context, key string) (string, error) {
					return r.run(ctx, key, params, payload(b.cfg.payload))
				})
			}})
		}
		return s
	}
	var pg *pgSeed
	notes := []string{fmt.Sprintf("%s; idem with its cache (one store, as one process) and without (adaptive claim path); %d clients; duplicates %.0f%%", t.name, b.cfg.concurrency, b.cfg.duplicates*100)}
	if b.cfg.pg != "" {
		if pg, err = openPG(ctx, b.cfg.pg, b.cfg.concurrency); err != nil {
			return nil, err
		}
		defer pg.close()
		notes = append(notes, "PostgreSQL: a table of keys (INSERT ... ON CONFLICT DO NOTHING claim, UPDATE ... WHERE locked_at = mine), "+pg.settings)
	} else {
		notes = append(notes, "no --pg given (bench/bench-pg.sh runs the comparison with PostgreSQL)")
	}
	var rs []*redisSeed
	for _, addr := range b.cfg.redis.vals {
		r, err := openRedis(ctx, addr, b.cfg.concurrency, 24*time.Hour)
		if err != nil {
			return nil, err
		}
		defer r.close()
		rs = append(rs, r)
	}
	if len(rs) > 0 {
		notes = append(notes, "Redis: SET NX PX claims, a Lua script completes only while the claim holds, GET replays. "+redisGuarantees(rs))
	}
	// The raw Txn pair idem is built on, as the limit of fresh claims on
	// this cluster: the goals are ratios to PostgreSQL, and this row says
	// where raw etcd itself stands against it in the same run.
	id, err := bucketLease(ctx, t.clients[0], t.prefix+"raw/")
	if err != nil {
		return nil, err
	}
	claimSize, doneSize, err := recordSizes(ctx, plain[0], t, params, b.work(), b.cfg.payload)
	if err != nil {
		return nil, err
	}
	raw := side{"raw etcd txn pair", rawPair(func(w int) *clientv3.Client { return t.clients[w%clientPool] }, id,
		&keys{prefix: t.prefix + "raw/k/"}, claimSize, doneSize)}
	mix := b.compare(ctx, sides(b.cfg.retries, pg, rs)...)
	fresh := b.compare(ctx, append(sides(0, pg, rs), raw)...)
	for _, r := range mix {
		r.Name += fmt.Sprintf(", %.0f%% retries", b.cfg.retries*100)
	}
	for _, r := range fresh {
		r.Name += ", fresh claims"
	}
	rep := suiteReport{Suite: "mix", Title: "a realistic mix and fresh claims, " + t.name, Notes: notes, Results: append(mix, fresh...)}
	// The sides in order: idem with and without its cache, PostgreSQL,
	// each Redis; fresh claims end with the raw pair.
	rawAt := len(fresh) - 1
	peer := 2
	if pg != nil {
		rep.Ratios = append(rep.Ratios,
			ratioOf("idem (cache) / postgresql, mix", mix[0], mix[peer], 2),
			ratioOf("idem (no cache) / postgresql, mix", mix[1], mix[peer], 0),
			ratioOf("idem (cache) / postgresql, fresh claims", fresh[0], fresh[peer], 1.2),
			ratioOf("idem (no cache) / postgresql, fresh claims", fresh[1], fresh[peer], 1.2),
			ratioOf("raw etcd txn pair / postgresql, fresh claims (the limit)", fresh[rawAt], fresh[peer], 0))
		peer++
	}
	for _, r := range rs {
		rep.Ratios = append(rep.Ratios,
			ratioOf("idem (cache) / "+r.name()+", mix", mix[0], mix[peer], 0),
			ratioOf("idem (cache) / "+r.name()+", fresh claims", fresh[0], fresh[peer], 0),
			ratioOf("raw etcd txn pair / "+r.name()+", fresh claims (the limit)", fresh[rawAt], fresh[peer], 0))
		peer++
	}
	rep.Ratios = append(rep.Ratios, ratioOf("idem (cache) / raw etcd txn pair, fresh claims", fresh[0], fresh[rawAt], 0))
	// What fsync cost etcd in this run: the ratio to PostgreSQL moves with
	// the machine's fsync, which bench-pg.sh measures for PostgreSQL.
	if mean, n := walFsync(); n > 0 {
		rep.Extra = map[string]string{"etcd WAL fsync (this run)": fmt.Sprintf("mean %.2f ms over %d fsyncs", mean*1000, n)}
	}
	return []suiteReport{rep}, nil
}

// walFsync returns the mean and count of the embedded etcd's WAL fsyncs
// (etcd_disk_wal_fsync_duration_seconds), from the process's registry.
func walFsync() (float64, uint64) {
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		return 0, 0
	}
	for _, mf := range mfs {
		if mf.GetName() != "etcd_disk_wal_fsync_duration_seconds" {
			continue
		}
		var sum float64
		var n uint64
		for _, m := range mf.GetMetric() {
			sum += m.GetHistogram().GetSampleSum()
			n += m.GetHistogram().GetSampleCount()
		}
		if n > 0 {
			return sum / float64(n), n
		}
	}
	return 0, 0
}

// pgSeed is an idempotency table of keys on PostgreSQL, as Brandur Leach describes it.
type pgSeed struct {
	pool     *pgxpool.Pool
	settings string
}

func openPG(ctx context.Context, dsn string, conns int) (*pgSeed, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("--pg: %w", err)
	}
	cfg.MaxConns = int32(conns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("--pg: %w", err)
	}
	p := &pgSeed{pool: pool}
	var fsync, sync string
	if err := pool.QueryRow(ctx, "SHOW fsync").Scan(&fsync); err != nil {
		pool.Close()
		return nil, fmt.Errorf("--pg: %w", err)
	}
	pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&sync)
	p.settings = fmt.Sprintf("fsync %s, synchronous_commit %s", fsync, sync)
	_, err = pool.Exec(ctx, `DROP TABLE IF EXISTS idempotency_keys;
CREATE TABLE idempotency_keys (
  key          TEXT PRIMARY KEY,
  fingerprint  TEXT NOT NULL,
  status       TEXT NOT NULL,
  response     BYTEA,
  locked_at    BIGINT NOT NULL
)`)
	if err != nil {
		pool.Close()
		return nil, err
	}
	return p, nil
}

func (p *pgSeed) close() { p.pool.Close() }

// run claims by INSERT ... ON CONFLICT DO NOTHING, run
// the work, save the response fenced on locked_at; or replay, or conflict.
func (p *pgSeed) run(ctx context.Context, key string, params, resp []byte) (string, error) {
	fp := strconv.FormatUint(hash(params), 16)
	lockedAt := time.Now().UnixNano() + rand.Int64N(1000)
	tag, err := p.pool.Exec(ctx, `INSERT INTO idempotency_keys (key, fingerprint, status, locked_at)
VALUES ($1, $2, 'in_flight', $3) ON CONFLICT (key) DO NOTHING`, key, fp, lockedAt)
	if err != nil {
		return "", err
	}
	if tag.RowsAffected() == 1 {
		tag, err = p.pool.Exec(ctx, `UPDATE idempotency_keys SET status = 'done', response = $2
WHERE key = $1 AND status = 'in_flight' AND locked_at = $3`, key, resp, lockedAt)
		if err != nil {
			return "", err
		}
		if tag.RowsAffected() != 1 {
			return "", errors.New("fenced out")
		}
		return "claimed", nil
	}
	var gotFP, status string
	var saved []byte
	err = p.pool.QueryRow(ctx, `SELECT fingerprint, status, response FROM idempotency_keys WHERE key = $1`, key).Scan(&gotFP, &status, &saved)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return "conflict", nil
	case err != nil:
		return "", err
	case gotFP != fp:
		return "mismatch", nil
	case status == "done":
		return "replayed", nil
	}
	return "conflict", nil
}

func hash(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h = (h ^ uint64(c)) * 1099511628211
	}
	return h
}

// suiteMutex: idem Do against lock-then-check with concurrency.Mutex.
func suiteMutex(ctx context.Context, b *bencher) ([]suiteReport, error) {
	t, err := b.open(ctx, 1, etcdtest.Options{})
	if err != nil {
		return nil, err
	}
	defer t.close()
	stores, err := t.newStores(ctx)
	if err != nil {
		return nil, err
	}
	sessions := make([]*concurrency.Session, clientPool)
	for i, cli := range t.clients {
		if sessions[i], err = concurrency.NewSession(cli, concurrency.WithTTL(10)); err != nil {
			return nil, err
		}
		defer sessions[i].Close()
	}
	body := string(payload(b.cfg.payload))
	mk, ik := &keys{prefix: t.prefix + "mutex/"}, &keys{prefix: "do-"}
	params := []byte(`{"amount":100}`)
	res := b.compare(ctx,
		side{"concurrency.Mutex, then check", func(ctx context.Context, w int) (string, error) {
			cli, key := t.clients[w%clientPool], mk.next()
			m := concurrency.NewMutex(sessions[w%clientPool], key+"/lock")
			if err := m.Lock(ctx); err != nil {
				return "", err
			}
			defer m.Unlock(context.WithoutCancel(ctx))
			got, err := cli.Get(ctx, key+"/record")
			if err != nil {
				return "", err
			}
			if len(got.Kvs) > 0 {
				return "replayed", nil
			}
			_, err = cli.Put(ctx, key+"/record", body)
			return "claimed", err
		}},
		side{"idem Do", func(ctx context.Context, w int) (string, error) {
			return doOutcome(stores[w%clientPool].Do(ctx, etcdstore.Key{ID: ik.next()}, params, b.work()))
		}},
	)
	return []suiteReport{{
		Suite: "mutex", Title: fmt.Sprintf("idem Do against lock-then-check with etcd's concurrency.Mutex (lock, read, write, unlock), %s, %d clients", t.name, b.cfg.concurrency),
		Results: res, Ratios: []ratio{ratioOf("idem Do / mutex", res[1], res[0], 3)},
	}}, nil
}
