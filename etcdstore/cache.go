package etcdstore

import (
	"container/list"
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"
)

// doneCache holds done records in memory, so replays need no etcd round
// trip. It is filled and invalidated by one Watch of every record, in
// revision order: a done record enters when its Put is seen, and leaves when
// a later event for its key is seen (an eviction, or a new claim after its
// retention), or when the cache is full (least recently used first). Done
// records never change in place, so a cached one is the record until an
// event says otherwise. When the watch breaks, the cache is emptied before
// it restarts, so no invalidation is ever missed.
//
// The cache answers only while its watch is known to be current: every
// quarter of the staleness bound it asks etcd for a progress notification
// (RequestProgress), which etcd sends once the watch has delivered every
// event up to the revision it answers at. A hit is served only if such an
// answer, to a request sent at most the bound ago, has come back. A watch
// whose connection stops moving bytes (a partition that keeps TCP open)
// gets no answers, so after the bound every claim goes to etcd again (and
// fails there while etcd cannot be reached): a cut-off process never
// replays from memory for longer than the bound. A watch that gets no
// answer for twice the bound is started again, the cache emptied.
//
// What it does not guarantee: a record deleted (evicted) moments ago may
// still be replayed until the watch delivers the deletion, typically
// milliseconds, at most the staleness bound. Evictions through this store
// invalidate it at once.
type doneCache struct {
	max    int64         // bytes
	bound  time.Duration // the longest the cache may lag behind etcd
	decode func(Key, *mvccpb.KeyValue) (*Record, error)

	// current is when (time.Now, in nanoseconds since start) the latest
	// answered progress request was sent: the cache has every event etcd
	// had committed then.
	current atomic.Int64

	mu    sync.Mutex
	size  int64
	order *list.List // front: most recently used
	byKey map[string]*list.Element
	// tombs holds keys deleted through this store, with a revision at or
	// after the deletion, until the watch has passed it: an older Put
	// still on its way must not put the record back.
	tombs map[string]int64

	hits, misses, stale int64
}

type cacheEntry struct {
	key  string
	kv   *mvccpb.KeyValue // decoded on first use: most entries are never replayed
	rec  *Record
	size int64
}

func newDoneCache(max int64, bound time.Duration) *doneCache {
	c := &doneCache{max: max, bound: bound, decode: decode, order: list.New(), byKey: make(map[string]*list.Element), tombs: make(map[string]int64)}
	c.current.Store(-1 << 62) // not current until a progress answer says so
	return c
}

// cacheEpoch is the origin of doneCache.current: a monotonic clock.
var cacheEpoch = time.Now()

func sinceEpoch() int64 { return int64(time.Since(cacheEpoch)) }

// fresh reports whether the cache was current less than its bound ago.
func (c *doneCache) fresh() bool {
	return time.Duration(sinceEpoch()-c.current.Load()) <= c.bound
}

// get returns the cached done record of k, or nil (also when the cache may
// be staler than its bound). An entry is decoded on its first use, outside
// the lock (a compressed record may need its dictionary from etcd).
func (c *doneCache) get(ekey string, k Key) *Record {
	fresh := c.fresh()
	c.mu.Lock()
	if !fresh {
		c.stale++
		c.mu.Unlock()
		return nil
	}
	el, ok := c.byKey[ekey]
	if !ok {
		c.misses++
		c.mu.Unlock()
		return nil
	}
	e := el.Value.(*cacheEntry)
	rec, kv := e.rec, e.kv
	c.mu.Unlock()
	if rec == nil {
		var err error
		if rec, err = c.decode(k, kv); err != nil {
			c.mu.Lock()
			if cur, ok := c.byKey[ekey]; ok && cur == el {
				c.removeLocked(ekey)
			}
			c.misses++
			c.mu.Unlock()
			return nil
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.byKey[ekey]; ok && cur == el {
		e.rec, e.kv = rec, nil
		c.order.MoveToFront(el)
	} else if !ok {
		c.misses++ // invalidated meanwhile
		return nil
	}
	c.hits++
	return rec
}

// put caches a done record seen on the watch, undecoded.
func (c *doneCache) put(ekey string, kv *mvccpb.KeyValue) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.removeLocked(ekey)
	if rev, ok := c.tombs[ekey]; ok && kv.ModRevision <= rev {
		return // deleted through this store after this Put
	}
	e := &cacheEntry{key: ekey, kv: kv, size: int64(len(kv.Value) + len(ekey) + 256)}
	if e.size > c.max {
		return
	}
	c.byKey[ekey] = c.order.PushFront(e)
	c.size += e.size
	for c.size > c.max {
		c.removeLocked(c.order.Back().Value.(*cacheEntry).key)
	}
}

// seen forgets a tomb once the watch delivers an event at or past it.
func (c *doneCache) seen(ekey string, rev int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.tombs[ekey]; ok && rev >= t {
		delete(c.tombs, ekey)
	}
}

func (c *doneCache) remove(ekey string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.removeLocked(ekey)
}

// invalidate removes ekey, deleted at or before rev, and keeps it out until
// the watch has passed rev. rev 0 (unknown) only removes it.
func (c *doneCache) invalidate(ekey string, rev int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.removeLocked(ekey)
	if rev > 0 {
		c.tombs[ekey] = max(c.tombs[ekey], rev)
	}
}

func (c *doneCache) removeLocked(ekey string) {
	if el, ok := c.byKey[ekey]; ok {
		c.size -= el.Value.(*cacheEntry).size
		c.order.Remove(el)
		delete(c.byKey, ekey)
	}
}

func (c *doneCache) clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.order.Init()
	c.byKey = make(map[string]*list.Element)
	c.tombs = make(map[string]int64)
	c.size = 0
	c.current.Store(-1 << 62)
}

// CacheStats reports the done-record cache. Stale counts the lookups it
// did not answer because it could not prove itself current within the
// staleness bound (WithCacheStaleness); Lag is how long ago it last could.
type CacheStats struct {
	Entries             int
	Bytes               int64
	Hits, Misses, Stale int64
	Lag                 time.Duration
}

// CacheStats returns the cache's counters; zero without WithCache.
func (s *Store) CacheStats() CacheStats {
	c := s.cache
	if c == nil {
		return CacheStats{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return CacheStats{Entries: len(c.byKey), Bytes: c.size, Hits: c.hits, Misses: c.misses, Stale: c.stale,
		Lag: time.Duration(max(0, sinceEpoch()-c.current.Load()))}
}

// feedCache keeps the cache in step with etcd until the store closes. It
// watches every record from the current revision; on any break it empties
// the cache and starts again.
func (s *Store) feedCache() {
	defer s.wg.Done()
	ctx, cancel := s.untilClosed()
	defer cancel()
	for try := 0; ctx.Err() == nil; try++ {
		s.cache.clear()
		gctx, gcancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), max(s.timeout, time.Second))
		resp, err := s.client.Get(gctx, s.ks.records(), clientv3.WithPrefix(), clientv3.WithCountOnly())
		gcancel()
		if err != nil {
			if !backoff(ctx, min(try, 5)) {
				return
			}
			continue
		}
		// From the read's own revision, not the next: etcd sends no
		// progress notification to a watch that starts in the future
		// (until the store reaches that revision), and the cache could not
		// prove itself current on a quiet prefix. An event at that revision
		// is state the read saw: applying it again is harmless.
		s.watchCache(ctx, resp.Header.Revision, try)
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// watchCache applies watch events from rev on until the watch ends, or
// until it has gone twice the staleness bound without proving itself
// current. Each watch has a gRPC stream of its own (its own metadata), so
// that progress requests and answers are its own, and a watch started
// again never hears an answer meant for the one before.
func (s *Store) watchCache(ctx context.Context, rev int64, gen int) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wctx := clientv3.WithRequireLeader(metadata.AppendToOutgoingContext(ctx, "idem-cache-watch", strconv.Itoa(gen)))
	wch := s.client.Watch(wctx, s.ks.records(), clientv3.WithPrefix(), clientv3.WithRev(rev))

	// Progress requests in flight, oldest first. etcd answers them in
	// order; an answer is credited to the oldest, which is never later
	// than the request it really answers (some may be lost with a broken
	// stream): the cache is never thought fresher than it is.
	var mu sync.Mutex
	var sent []int64
	go func() {
		t := time.NewTicker(max(s.cache.bound/4, 10*time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			now := sinceEpoch()
			mu.Lock()
			if len(sent) > 0 && time.Duration(now-sent[0]) > 2*s.cache.bound {
				mu.Unlock()
				cancel() // no answer for too long: start again
				return
			}
			if len(sent) < 64 {
				sent = append(sent, now)
			}
			mu.Unlock()
			if err := s.client.RequestProgress(wctx); err != nil && ctx.Err() == nil {
				s.log.Debug("idem: cache progress request", "err", err)
			}
		}
	}()
	for wr := range wch {
		if wr.Canceled || wr.Err() != nil {
			return
		}
		if wr.IsProgressNotify() {
			mu.Lock()
			if len(sent) > 0 {
				s.cache.current.Store(sent[0])
				sent = sent[1:]
			}
			mu.Unlock()
			continue
		}
		for _, ev := range wr.Events {
			ekey := string(ev.Kv.Key)
			if ev.Type == mvccpb.PUT && isDone(ev.Kv.Value) {
				s.cache.put(ekey, ev.Kv)
			} else {
				s.cache.remove(ekey) // deleted, or a claim: not a replay
			}
			s.cache.seen(ekey, ev.Kv.ModRevision)
			if testHookCacheApplied != nil {
				testHookCacheApplied(ev.Kv.ModRevision)
			}
		}
	}
}

// testHookCacheApplied, when set by a test, is called after the cache has
// applied each watch event.
var testHookCacheApplied func(rev int64)
