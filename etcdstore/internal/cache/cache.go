// Package cache holds done records in memory, so that replays need no etcd
// round trip. It is filled and invalidated by one Watch of every record, in
// revision order: a done record enters when its Put is seen, and leaves
// when a later event for its key is seen (an eviction, or a new claim after
// its retention), or when the cache is full (least recently used first).
// Done records never change in place, so a cached one is the record until
// an event says otherwise. When the watch breaks, the cache is emptied
// before it restarts, so no invalidation is ever missed.
//
// The cache answers only while its watch is known to be current: every
// quarter of the staleness bound it reads etcd's revision linearizably (a
// read-index round at the leader), then asks for a progress notification
// (RequestProgress), which etcd sends once the watch has delivered every
// event up to the revision it answers at. A hit is served only if an
// answer at or past the revision read, for a read begun at most the bound
// ago, has come back. The member the watch is on may lag, or be cut off
// without having noticed (it still believes in its leader and answers
// progress requests from its own old revision): its answers then stay
// below the revision read, and prove nothing. A watch
// whose connection stops moving bytes (a partition that keeps TCP open)
// gets no answers, so after the bound every claim goes to etcd again: a
// cut-off process never replays from memory for longer than the bound. A
// watch that gets no answer for twice the bound is started again, the
// cache emptied.
//
// What it does not guarantee: a record deleted (evicted) moments ago may
// still be replayed until the watch delivers the deletion, typically
// milliseconds, at most the staleness bound. Invalidate removes a record at
// once.
package cache

import (
	"container/list"
	"context"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/watch"
)

// Config configures a Cache.
type Config[V any] struct {
	Client *clientv3.Client
	Clock  clock.Clock
	Log    *slog.Logger
	// Prefix is the key prefix of the records watched.
	Prefix string
	// Bytes bounds the cache; Bound how far behind etcd it may answer.
	Bytes int64
	Bound time.Duration
	// Timeout bounds the read that starts each watch.
	Timeout time.Duration
	// Decode reads a cached record on its first use; IsDone tells, from
	// its etcd value, whether a record is done (cached) or not.
	Decode func(*mvccpb.KeyValue) (V, error)
	IsDone func(value []byte) bool
	// Applied, when set, is called after each watch event is applied.
	Applied func(rev int64)
}

// Cache is a cache of done records. Its methods are safe for concurrent
// use.
type Cache[V any] struct {
	cfg Config[V]

	// current is when (Clock time, in unix nanoseconds) the latest
	// answered progress request was sent: the cache has every event etcd
	// had committed then.
	current atomic.Int64

	mu    sync.Mutex
	size  int64
	order *list.List // front: most recently used
	byKey map[string]*list.Element
	// tombs holds keys invalidated with a revision at or after their
	// deletion, until the watch has passed it: an older Put still on its
	// way must not put the record back.
	tombs map[string]int64

	hits, misses, stale int64
}

type entry[V any] struct {
	key     string
	kv      *mvccpb.KeyValue // decoded on first use: most entries are never replayed
	rec     V
	decoded bool
	size    int64
}

const notCurrent = -1 << 62

// New returns an empty Cache; Run feeds it.
func New[V any](cfg Config[V]) *Cache[V] {
	c := &Cache[V]{cfg: cfg, order: list.New(), byKey: make(map[string]*list.Element), tombs: make(map[string]int64)}
	c.current.Store(notCurrent)
	return c
}

// fresh reports whether the cache was current less than its bound ago.
func (c *Cache[V]) fresh() bool {
	return time.Duration(c.cfg.Clock.Now().UnixNano()-c.current.Load()) <= c.cfg.Bound
}

// Get returns the cached done record under ekey, or false (also when the
// cache may be staler than its bound). An entry is decoded on its first
// use, outside the lock (a compressed record may need its dictionary from
// etcd).
func (c *Cache[V]) Get(ekey string) (V, bool) {
	var zero V
	fresh := c.fresh()
	c.mu.Lock()
	if !fresh {
		c.stale++
		c.mu.Unlock()
		return zero, false
	}
	el, ok := c.byKey[ekey]
	if !ok {
		c.misses++
		c.mu.Unlock()
		return zero, false
	}
	e := el.Value.(*entry[V])
	rec, kv, decoded := e.rec, e.kv, e.decoded
	c.mu.Unlock()
	if !decoded {
		var err error
		if rec, err = c.cfg.Decode(kv); err != nil {
			c.mu.Lock()
			if cur, ok := c.byKey[ekey]; ok && cur == el {
				c.removeLocked(ekey)
			}
			c.misses++
			c.mu.Unlock()
			return zero, false
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.byKey[ekey]; ok && cur == el {
		e.rec, e.kv, e.decoded = rec, nil, true
		c.order.MoveToFront(el)
	} else if !ok {
		c.misses++ // invalidated meanwhile
		return zero, false
	}
	c.hits++
	return rec, true
}

// put caches a done record seen on the watch, undecoded.
func (c *Cache[V]) put(ekey string, kv *mvccpb.KeyValue) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.removeLocked(ekey)
	if rev, ok := c.tombs[ekey]; ok && kv.ModRevision <= rev {
		return // invalidated after this Put
	}
	e := &entry[V]{key: ekey, kv: kv, size: int64(len(kv.Value) + len(ekey) + 256)}
	if e.size > c.cfg.Bytes {
		return
	}
	c.byKey[ekey] = c.order.PushFront(e)
	c.size += e.size
	for c.size > c.cfg.Bytes {
		c.removeLocked(c.order.Back().Value.(*entry[V]).key)
	}
}

// seen forgets a tomb once the watch delivers an event at or past it.
func (c *Cache[V]) seen(ekey string, rev int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.tombs[ekey]; ok && rev >= t {
		delete(c.tombs, ekey)
	}
}

func (c *Cache[V]) remove(ekey string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.removeLocked(ekey)
}

// Invalidate removes ekey, deleted at or before rev, and keeps it out until
// the watch has passed rev. rev 0 (unknown) only removes it.
func (c *Cache[V]) Invalidate(ekey string, rev int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.removeLocked(ekey)
	if rev > 0 {
		c.tombs[ekey] = max(c.tombs[ekey], rev)
	}
}

func (c *Cache[V]) removeLocked(ekey string) {
	if el, ok := c.byKey[ekey]; ok {
		c.size -= el.Value.(*entry[V]).size
		c.order.Remove(el)
		delete(c.byKey, ekey)
	}
}

func (c *Cache[V]) clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.order.Init()
	c.byKey = make(map[string]*list.Element)
	c.tombs = make(map[string]int64)
	c.size = 0
	c.current.Store(notCurrent)
}

// Stats are a cache's counters. Stale counts the lookups it did not answer
// because it could not prove itself current within its bound; Lag is how
// long ago it last could.
type Stats struct {
	Entries             int
	Bytes               int64
	Hits, Misses, Stale int64
	Lag                 time.Duration
}

// Stats returns the cache's counters.
func (c *Cache[V]) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return Stats{Entries: len(c.byKey), Bytes: c.size, Hits: c.hits, Misses: c.misses, Stale: c.stale,
		Lag: time.Duration(max(0, c.cfg.Clock.Now().UnixNano()-c.current.Load()))}
}

// Run keeps the cache in step with etcd until ctx ends. It watches every
// record from the current revision; on any break it empties the cache and
// starts again.
func (c *Cache[V]) Run(ctx context.Context) {
	for try := 0; ctx.Err() == nil; try++ {
		c.clear()
		gctx, gcancel := c.cfg.Clock.WithTimeout(clientv3.WithRequireLeader(ctx), max(c.cfg.Timeout, time.Second))
		resp, err := c.cfg.Client.Get(gctx, c.cfg.Prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		gcancel()
		if err != nil {
			if clock.Sleep(c.cfg.Clock, ctx, time.Duration(25<<min(try, 5))*time.Millisecond) != nil {
				return
			}
			continue
		}
		// From the read's own revision, not the next: etcd sends no
		// progress notification to a watch that starts in the future
		// (until the store reaches that revision), and the cache could not
		// prove itself current on a quiet prefix. An event at that revision
		// is state the read saw: applying it again is harmless.
		c.watch(ctx, resp.Header.Revision, try)
		if clock.Sleep(c.cfg.Clock, ctx, 50*time.Millisecond) != nil {
			return
		}
	}
}

// watch applies watch events from rev on until the watch ends, or until it
// has gone twice the staleness bound without proving itself current. Each
// watch has a gRPC stream of its own (its own metadata), so that progress
// requests and answers are its own, and a watch started again never hears
// an answer meant for the one before.
func (c *Cache[V]) watch(ctx context.Context, rev int64, gen int) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wctx := clientv3.WithRequireLeader(metadata.AppendToOutgoingContext(ctx, "idem-cache-watch", strconv.Itoa(gen)))
	stream := watch.New(c.cfg.Clock)
	stream.Add(c.cfg.Client.Watch(wctx, c.cfg.Prefix, clientv3.WithPrefix(), clientv3.WithRev(rev)))

	// Progress requests in flight, oldest first. etcd answers them in
	// order; an answer is credited to the oldest, which is never later
	// than the request it really answers (some may be lost with a broken
	// stream): the cache is never thought fresher than it is.
	p := &progress{}
	var group clock.Group
	defer func() {
		cancel()
		group.Wait(c.cfg.Clock, context.WithoutCancel(ctx))
	}()
	group.Go(c.cfg.Clock, ctx, "cache progress", func(ctx context.Context) { c.askProgress(ctx, wctx, cancel, p) })
	for {
		r, err := stream.Next(ctx)
		if err != nil || r.Closed || r.Canceled || r.Err() != nil {
			return
		}
		if r.IsProgressNotify() {
			// Every read at or below the revision the watch has delivered
			// up to is proven; the newest of them is when the cache was
			// last current. A read above it waits for a later answer.
			p.mu.Lock()
			for len(p.sent) > 0 && p.sent[0].rev <= r.Header.Revision {
				c.current.Store(p.sent[0].at)
				p.sent = p.sent[1:]
			}
			p.mu.Unlock()
			continue
		}
		for _, ev := range r.Events {
			ekey := string(ev.Kv.Key)
			if ev.Type == mvccpb.PUT && c.cfg.IsDone(ev.Kv.Value) {
				c.put(ekey, ev.Kv)
			} else {
				c.remove(ekey) // deleted, or a claim: not a replay
			}
			c.seen(ekey, ev.Kv.ModRevision)
			if c.cfg.Applied != nil {
				c.cfg.Applied(ev.Kv.ModRevision)
			}
		}
	}
}

// progress holds a watch's progress requests in flight, oldest first.
type progress struct {
	mu   sync.Mutex
	sent []pending
}

// askProgress asks, every quarter of the bound, for a progress answer
// after a linearizable revision read; it cancels the watch (through
// cancel) when no answer proved it current for twice the bound.
func (c *Cache[V]) askProgress(ctx, wctx context.Context, cancel context.CancelFunc, p *progress) {
	every := max(c.cfg.Bound/4, 10*time.Millisecond)
	for clock.Sleep(c.cfg.Clock, ctx, every) == nil {
		now := c.cfg.Clock.Now().UnixNano()
		p.mu.Lock()
		if len(p.sent) > 0 && time.Duration(now-p.sent[0].at) > 2*c.cfg.Bound {
			p.mu.Unlock()
			cancel() // no answer for too long: start again
			return
		}
		p.mu.Unlock()
		rev, err := c.revision(ctx)
		if err != nil {
			if ctx.Err() == nil {
				c.cfg.Log.Debug("idem: cache revision read", "err", err)
			}
			continue
		}
		p.mu.Lock()
		if len(p.sent) < 64 {
			p.sent = append(p.sent, pending{at: now, rev: rev})
		}
		p.mu.Unlock()
		if err := c.cfg.Client.RequestProgress(wctx); err != nil && ctx.Err() == nil {
			c.cfg.Log.Debug("idem: cache progress request", "err", err)
		}
	}
}

// pending is a progress request: when the revision read before it began,
// and the revision it read.
type pending struct {
	at  int64 // unix ns
	rev int64
}

// revision reads etcd's current revision linearizably (a Get of a key
// nobody writes), within the staleness bound.
func (c *Cache[V]) revision(ctx context.Context) (int64, error) {
	ctx, cancel := c.cfg.Clock.WithTimeout(ctx, c.cfg.Bound)
	defer cancel()
	resp, err := c.cfg.Client.Get(ctx, c.cfg.Prefix+"\x00revision")
	if err != nil {
		return 0, err
	}
	return resp.Header.Revision, nil
}
