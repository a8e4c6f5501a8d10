package lease

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
)

// MinTTL is the shortest lease etcd honours: shorter TTLs are raised to about
// 1.5 election timeouts by the server.
const MinTTL = 2 * time.Second

// Buckets hands out shared retention leases, one or more per time bucket. It is safe
// for concurrent use. It starts no goroutines.
type Buckets struct {
	client    *clientv3.Client
	prefix    string
	retention time.Duration
	width     time.Duration
	maxUses   int64 // writes on one lease before the bucket rolls to the next
	grace     time.Duration
	clock     clock.Clock

	// Request, when set, prepares the context of each etcd request For
	// makes (a timeout, say). It is not called when the bucket's lease is
	// already known. Set it before the Buckets are used.
	Request func(context.Context) (context.Context, context.CancelFunc)

	mu      sync.Mutex
	buckets map[int64]*bucket // the current lease of each bucket
}

type bucket struct {
	shard int64         // leases of one bucket, in the order this process used them
	uses  int64         // writes handed this lease, under Buckets.mu
	stale bool          // resolving failed or the lease is gone: resolve the shard again (under Buckets.mu)
	ready chan struct{} // closed when id or err is set
	id    clientv3.LeaseID
	err   error
}

// DefaultMaxUses is how many writes one retention lease takes before its
// bucket moves to a fresh lease. etcd deletes all of a lease's keys in one
// raft entry when it expires, and nothing else is applied meanwhile: a
// lease with a million keys stalls the cluster for seconds. Leases of at
// most this many keys expire in steps other requests can slip between.
const DefaultMaxUses = 20000

// CheckBuckets reports whether NewBuckets would refuse retention and
// width.
func CheckBuckets(retention, width time.Duration) error {
	switch {
	case retention < time.Second || retention%time.Second != 0:
		return fmt.Errorf("lease buckets: retention %v must be a whole number of seconds, at least 1s", retention)
	case width < time.Second || width%time.Second != 0:
		return fmt.Errorf("lease buckets: bucket width %v must be a whole number of seconds, at least 1s", width)
	case width > retention:
		return fmt.Errorf("lease buckets: bucket width %v is longer than retention %v", width, retention)
	}
	return nil
}

// NewBuckets returns Buckets that keep records for at least retention, with
// buckets width wide, and bucket keys under prefix (for example "/idem/l/").
// A bucket's lease takes DefaultMaxUses writes from this process before the
// bucket moves on to another lease (SetMaxUses).
func NewBuckets(client *clientv3.Client, prefix string, retention, width time.Duration, opts ...Option) (*Buckets, error) {
	switch {
	case client == nil:
		return nil, errors.New("lease buckets: nil etcd client")
	case prefix == "":
		return nil, errors.New("lease buckets: empty key prefix")
	}
	if err := CheckBuckets(retention, width); err != nil {
		return nil, err
	}
	return &Buckets{
		client:    client,
		prefix:    prefix,
		retention: retention,
		width:     width,
		maxUses:   DefaultMaxUses,
		clock:     applyOptions(opts).clock,
		buckets:   make(map[int64]*bucket),
	}, nil
}

// SetMaxUses sets how many writes one lease takes before its bucket moves
// to a fresh one (at least 1). Call it before the Buckets are used.
func (b *Buckets) SetMaxUses(n int64) { b.maxUses = max(1, n) }

// SetGrace keeps each lease grace longer than its records need: time for a
// sweeper to delete them a few at a time before etcd deletes what is left
// all at once when the lease expires. Call it before the Buckets are used.
func (b *Buckets) SetGrace(grace time.Duration) { b.grace = max(0, grace) }

// Width returns the width of a bucket.
func (b *Buckets) Width() time.Duration { return b.width }

// Bucket is what a bucket key says of its lease.
type Bucket struct {
	Retention, Width time.Duration
	Index, Shard     int64
}

// End returns when the bucket's time span ends: its records all expire by
// End plus Retention.
func (k Bucket) End() time.Time { return time.Unix(0, (k.Index+1)*int64(k.Width)) }

// ParseBucketKey reads a bucket key under prefix (the Buckets' prefix),
// whatever retention and width it was made with.
func ParseBucketKey(prefix, key string) (Bucket, bool) {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok {
		return Bucket{}, false
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 4 || !strings.HasSuffix(parts[0], "s") || !strings.HasSuffix(parts[1], "s") {
		return Bucket{}, false
	}
	r, err1 := strconv.ParseInt(strings.TrimSuffix(parts[0], "s"), 10, 64)
	w, err2 := strconv.ParseInt(strings.TrimSuffix(parts[1], "s"), 10, 64)
	idx, err3 := strconv.ParseInt(parts[2], 10, 64)
	shard, err4 := strconv.ParseInt(parts[3], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil || r <= 0 || w <= 0 {
		return Bucket{}, false
	}
	return Bucket{Retention: time.Duration(r) * time.Second, Width: time.Duration(w) * time.Second, Index: idx, Shard: shard}, true
}

// ParseLeaseID reads the lease id a bucket key holds.
func ParseLeaseID(key string, v []byte) (clientv3.LeaseID, error) { return parseLeaseID(key, v) }

// For returns the lease to attach a record written at now to. The lease
// expires no earlier than now + retention (on the etcd leader's clock, see the
// package documentation). The first call in a bucket costs up to four etcd
// round trips (look the bucket key up, grant, claim the bucket key, and
// revoke when another process won); later calls in the same bucket are
// served from memory.
func (b *Buckets) For(ctx context.Context, now time.Time) (clientv3.LeaseID, error) {
	return b.Until(ctx, now, now)
}

// Until is For for a record that may have to outlive now + retention: the
// lease expires no earlier than the later of now + retention and expires
// (a record in flight under a deadline longer than the retention lives
// until its deadline).
func (b *Buckets) Until(ctx context.Context, now, expires time.Time) (clientv3.LeaseID, error) {
	at := now
	if e := expires.Add(-b.retention); e.After(at) {
		at = e // a later bucket, whose lease ends a retention after it
	}
	idx := at.UnixNano() / int64(b.width)
	cur := now.UnixNano() / int64(b.width)
	b.mu.Lock()
	bk, ok := b.buckets[idx]
	fresh := !ok || bk.stale || bk.uses >= b.maxUses
	if fresh {
		shard := int64(0)
		switch {
		case ok && bk.stale:
			shard = bk.shard // keep counting shards from where this process is
		case ok:
			shard = bk.shard + 1 // this lease has its share of keys: roll over
		}
		bk = &bucket{shard: shard, ready: make(chan struct{})}
		b.buckets[idx] = bk
		for old := range b.buckets {
			if old < cur-1 {
				delete(b.buckets, old)
			}
		}
	}
	bk.uses++
	b.mu.Unlock()
	if fresh {
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if b.Request != nil {
			rctx, cancel = b.Request(ctx)
		}
		bk.id, bk.err = b.resolve(rctx, idx, bk.shard, now)
		cancel()
		if bk.err != nil {
			b.mu.Lock()
			bk.stale = true // the next For resolves this shard again
			b.mu.Unlock()
		}
		close(bk.ready)
	}
	if err := b.clock.Wait(ctx, bk.ready); err != nil {
		return clientv3.NoLease, fmt.Errorf("retention lease: %w", err)
	}
	return bk.id, bk.err
}

// Invalidate forgets id, so the next For looks its bucket's shard up again. Call it
// when etcd answers that the lease does not exist (it was revoked by hand, or
// the clock jumped).
func (b *Buckets) Invalidate(id clientv3.LeaseID) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, bk := range b.buckets {
		select {
		case <-bk.ready:
			if bk.id == id {
				bk.stale = true
			}
		default:
		}
	}
}

// key names a lease of a bucket. Retention and width are part of it, so
// processes configured differently never share a lease with the wrong TTL;
// processes that agree share shard n of a bucket.
func (b *Buckets) key(idx, shard int64) string {
	return b.prefix + strconv.FormatInt(int64(b.retention/time.Second), 10) + "s/" +
		strconv.FormatInt(int64(b.width/time.Second), 10) + "s/" + strconv.FormatInt(idx, 10) + "/" + strconv.FormatInt(shard, 10)
}

func (b *Buckets) resolve(ctx context.Context, idx, shard int64, now time.Time) (clientv3.LeaseID, error) {
	key := b.key(idx, shard)
	// Fast path: another process already made this bucket's lease.
	if id, ok, err := b.lookup(ctx, key); err != nil || ok {
		return id, err
	}
	end := time.Unix(0, (idx+1)*int64(b.width))
	ttl := end.Add(b.retention + b.grace).Sub(now)
	ttl = (ttl + time.Second - 1).Truncate(time.Second) // round up
	if ttl < MinTTL {
		ttl = MinTTL
	}
	g, err := b.client.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return clientv3.NoLease, fmt.Errorf("retention lease %s: grant: %w", key, err)
	}
	resp, err := b.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, strconv.FormatInt(int64(g.ID), 16), clientv3.WithLease(g.ID))).
		Else(clientv3.OpGet(key)).
		Commit()
	if err != nil {
		// Unknown outcome: the lease may or may not be the bucket's now, so
		// it cannot be revoked. If it is not, it holds no keys and expires
		// with the bucket (up to retention plus a bucket from now); this
		// happens at most once per bucket per failure. The next call looks
		// the bucket up again.
		return clientv3.NoLease, fmt.Errorf("retention lease %s: claim: %w", key, err)
	}
	if resp.Succeeded {
		return g.ID, nil
	}
	// Another process won the bucket: use its lease and give ours back.
	// A failed revoke is harmless: the unused lease has no keys and expires
	// on its own.
	_, _ = b.client.Revoke(ctx, g.ID)
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return clientv3.NoLease, fmt.Errorf("retention lease %s: bucket key vanished during claim", key)
	}
	return parseLeaseID(key, kvs[0].Value)
}

func (b *Buckets) lookup(ctx context.Context, key string) (clientv3.LeaseID, bool, error) {
	resp, err := b.client.Get(ctx, key)
	if err != nil {
		return clientv3.NoLease, false, fmt.Errorf("retention lease %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return clientv3.NoLease, false, nil
	}
	id, err := parseLeaseID(key, resp.Kvs[0].Value)
	return id, err == nil, err
}

func parseLeaseID(key string, v []byte) (clientv3.LeaseID, error) {
	n, err := strconv.ParseInt(string(v), 16, 64)
	if err != nil || n == 0 {
		return clientv3.NoLease, fmt.Errorf("retention lease %s: corrupt lease id %q", key, v)
	}
	return clientv3.LeaseID(n), nil
}
