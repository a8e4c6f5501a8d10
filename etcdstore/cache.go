package etcdstore

import (
	"container/list"
	"context"

	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
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
// What it does not guarantee: a record deleted (evicted) moments ago may
// still be replayed until the watch delivers the deletion, typically
// milliseconds. Evictions through this store invalidate it at once.
type doneCache struct {
	max int64 // bytes

	mu    sync.Mutex
	size  int64
	order *list.List // front: most recently used
	byKey map[string]*list.Element
	// tombs holds keys deleted through this store, with a revision at or
	// after the deletion, until the watch has passed it: an older Put
	// still on its way must not put the record back.
	tombs map[string]int64

	hits, misses int64
}

type cacheEntry struct {
	key  string
	kv   *mvccpb.KeyValue // decoded on first use: most entries are never replayed
	rec  *Record
	size int64
}

func newDoneCache(max int64) *doneCache {
	return &doneCache{max: max, order: list.New(), byKey: make(map[string]*list.Element), tombs: make(map[string]int64)}
}

// get returns the cached done record of k, or nil.
func (c *doneCache) get(ekey string, k Key) *Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[ekey]
	if !ok {
		c.misses++
		return nil
	}
	e := el.Value.(*cacheEntry)
	if e.rec == nil {
		rec, err := decode(k, e.kv)
		if err != nil {
			c.removeLocked(ekey)
			c.misses++
			return nil
		}
		e.rec, e.kv = rec, nil
	}
	c.hits++
	c.order.MoveToFront(el)
	return e.rec
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
}

// CacheStats reports the done-record cache.
type CacheStats struct {
	Entries      int
	Bytes        int64
	Hits, Misses int64
}

// CacheStats returns the cache's counters; zero without WithCache.
func (s *Store) CacheStats() CacheStats {
	c := s.cache
	if c == nil {
		return CacheStats{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return CacheStats{Entries: len(c.byKey), Bytes: c.size, Hits: c.hits, Misses: c.misses}
}

// feedCache keeps the cache in step with etcd until the store closes. It
// watches every record from the current revision; on any break it empties
// the cache and starts again.
func (s *Store) feedCache() {
	defer s.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-s.closing
		cancel()
	}()
	for try := 0; ctx.Err() == nil; try++ {
		s.cache.clear()
		resp, err := s.client.Get(clientv3.WithRequireLeader(ctx), s.ks.records(), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			if !backoff(ctx, min(try, 5)) {
				return
			}
			continue
		}
		s.watchCache(ctx, resp.Header.Revision+1)
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// watchCache applies watch events from rev on until the watch ends.
func (s *Store) watchCache(ctx context.Context, rev int64) {
	wch := s.client.Watch(clientv3.WithRequireLeader(ctx), s.ks.records(), clientv3.WithPrefix(), clientv3.WithRev(rev))
	for wr := range wch {
		if wr.Canceled || wr.Err() != nil {
			return
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
