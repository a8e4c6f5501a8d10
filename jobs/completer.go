package jobs

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"

	"github.com/idem-dev/idem/etcdstore"
)

// completer finds the jobs a worker may run without anyone asking: queued
// ones, ones whose retry is due, and ones whose worker died (its session
// key is gone) or whose claim's deadline passed. It follows the queue's
// records and the live sessions on two etcd Watches, after one read of
// both at start and after every break of a watch (a compaction, a lost
// leader); it never scans on a timer. Claiming decides: the index only says
// when to try, and the store's claim Txn (a takeover, which only one
// worker wins) says whether.
type completer struct {
	w *Worker

	mu     sync.Mutex
	jobs   map[string]*entry // in-flight jobs of registered kinds, by id
	owners map[string]bool   // live sessions
	due    dueQueue          // when each entry may be tried, by time
	free   int               // slots for jobs
	kick   chan struct{}
	gen    int // watch streams opened, to give each its own
}

// entry is what the completer knows of one in-flight job.
type entry struct {
	id        string
	fp        etcdstore.Fingerprint
	kind      *Kind
	rev       int64 // the record's ModRevision
	owner     string
	deadline  time.Time
	notBefore time.Time
	expires   time.Time
	parked    bool

	// held: a claim at this revision found the job held by a live owner,
	// or this worker already tried it at this revision: not again until
	// the record changes or its owner dies.
	held    int64
	retryAt time.Time // after an etcd error, not before
	fails   int
	running bool
	version int // bumps with every change, to skip stale queue items
}

// stallAfter is how long the completer's watch stream may deliver nothing,
// progress notifications included, before it is given up.
const stallAfter = 10 * time.Second

func newCompleter(w *Worker) *completer {
	return &completer{w: w, jobs: map[string]*entry{}, owners: map[string]bool{}, free: w.conc, kick: make(chan struct{}, 1)}
}

func (c *completer) start() {
	ctx, cancel := context.WithCancel(context.Background())
	c.w.wg.Add(2)
	go func() {
		defer c.w.wg.Done()
		<-c.w.stopping
		cancel()
	}()
	go func() {
		defer c.w.wg.Done()
		c.follow(ctx)
	}()
	c.w.wg.Add(1)
	go func() {
		defer c.w.wg.Done()
		c.dispatch(ctx)
	}()
}

func (c *completer) wake() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// follow keeps the index current: a read of every record and session,
// then the watches from the revision after it; again whenever a watch
// breaks.
func (c *completer) follow(ctx context.Context) {
	for fails := 0; ctx.Err() == nil; fails++ {
		rev, err := c.load(ctx)
		if err == nil {
			fails = 0
			err = c.watch(ctx, rev)
		}
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			c.w.log.Info("idem: job completer re-reading the queue", "err", err)
		}
		c.w.q.clock.sleep(ctx, min(time.Duration(100<<min(fails, 6))*time.Millisecond, 5*time.Second))
	}
}

// load reads every live session and every job record at one revision and
// rebuilds the index from them.
func (c *completer) load(ctx context.Context) (int64, error) {
	st := c.w.q.store
	cli := st.Client()
	rctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), 30*time.Second)
	defer cancel()
	resp, err := cli.Get(rctx, st.OwnerPrefix(), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return 0, err
	}
	rev := resp.Header.Revision
	owners := map[string]bool{}
	for _, kv := range resp.Kvs {
		owners[strings.TrimPrefix(string(kv.Key), st.OwnerPrefix())] = true
	}
	prefix := st.TenantPrefix(c.w.q.tenant)
	end := clientv3.GetPrefixRangeEnd(prefix)
	jobs := map[string]*entry{}
	for from := prefix; ; {
		resp, err := cli.Get(rctx, from, clientv3.WithRange(end), clientv3.WithRev(rev), clientv3.WithLimit(500))
		if err != nil {
			return 0, err
		}
		for _, kv := range resp.Kvs {
			if e := c.entryOf(kv); e != nil {
				jobs[e.id] = e
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, old := range c.jobs {
		if e := jobs[id]; e != nil && old.running {
			e.running, e.held = true, old.held
		}
	}
	c.jobs, c.owners, c.due = jobs, owners, nil
	for _, e := range jobs {
		c.schedule(e)
	}
	c.wake()
	return rev, nil
}

// watch follows the records and the sessions from rev until a watch
// breaks, stalls, or ctx ends.
//
// A watch whose connection stops moving bytes delivers nothing and reports
// no error, so "no event" cannot mean "nothing changed": both watches share
// a gRPC stream of their own, on which the completer asks etcd for a
// progress notification every stallAfter/4; a stream that answers nothing
// for stallAfter is given up, and the queue read again. The watches start
// at the read's own revision, not the next: etcd answers no progress
// request of a watch that starts in the future. (Events at rev are state
// the read saw: applying them again changes nothing.)
func (c *completer) watch(ctx context.Context, rev int64) error {
	st := c.w.q.store
	cli := st.Client()
	c.gen++
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(metadata.AppendToOutgoingContext(ctx, "idem-jobs-watch", strconv.Itoa(c.gen))))
	defer cancel()
	recs := cli.Watch(wctx, st.TenantPrefix(c.w.q.tenant), clientv3.WithPrefix(), clientv3.WithRev(rev))
	owners := cli.Watch(wctx, st.OwnerPrefix(), clientv3.WithPrefix(), clientv3.WithRev(rev))
	var heard atomic.Int64 // when the stream last delivered anything
	heard.Store(time.Now().UnixNano())
	stalled := make(chan struct{})
	go func() {
		t := time.NewTicker(stallAfter / 4)
		defer t.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case <-t.C:
			}
			if time.Since(time.Unix(0, heard.Load())) > stallAfter {
				close(stalled)
				return
			}
			cli.RequestProgress(wctx)
		}
	}()
	for {
		select {
		case <-stalled:
			return fmt.Errorf("the watch delivered nothing for %v", stallAfter)
		case wr, ok := <-recs:
			if !ok || wr.Err() != nil {
				return watchErr(wr, ok)
			}
			heard.Store(time.Now().UnixNano())
			c.mu.Lock()
			for _, ev := range wr.Events {
				c.recordChanged(ev)
			}
			c.mu.Unlock()
		case wr, ok := <-owners:
			if !ok || wr.Err() != nil {
				return watchErr(wr, ok)
			}
			heard.Store(time.Now().UnixNano())
			c.mu.Lock()
			for _, ev := range wr.Events {
				id := strings.TrimPrefix(string(ev.Kv.Key), st.OwnerPrefix())
				if ev.Type == mvccpb.PUT {
					c.owners[id] = true
					continue
				}
				delete(c.owners, id)
				for _, e := range c.jobs {
					if e.owner == id {
						e.held = 0 // its owner is dead now: try again
						c.schedule(e)
					}
				}
			}
			c.mu.Unlock()
		}
		c.wake()
	}
}

func watchErr(wr clientv3.WatchResponse, ok bool) error {
	if !ok {
		return errors.New("watch closed")
	}
	return wr.Err()
}

// recordChanged applies one event of a job record.
func (c *completer) recordChanged(ev *clientv3.Event) {
	if ev.Type == mvccpb.DELETE {
		if id, ok := c.idOf(ev.Kv.Key); ok {
			c.drop(id)
		}
		return
	}
	e := c.entryOf(ev.Kv)
	if e == nil {
		if id, ok := c.idOf(ev.Kv.Key); ok {
			c.drop(id)
		}
		return
	}
	if old := c.jobs[e.id]; old != nil {
		e.running, e.held, e.fails, e.version = old.running, old.held, old.fails, old.version
	}
	c.jobs[e.id] = e
	c.schedule(e)
}

func (c *completer) idOf(key []byte) (string, bool) {
	return strings.CutPrefix(string(key), c.w.q.store.TenantPrefix(c.w.q.tenant))
}

func (c *completer) drop(id string) {
	if e := c.jobs[id]; e != nil {
		e.version++
		delete(c.jobs, id)
	}
}

// entryOf returns the entry of an in-flight job record of a registered
// kind, or nil.
func (c *completer) entryOf(kv *mvccpb.KeyValue) *entry {
	rec, err := c.w.q.store.DecodeRecord(kv)
	if err != nil || rec.State != etcdstore.InFlight {
		return nil
	}
	st, err := decodeState(rec.Checkpoint)
	if err != nil || c.w.kinds[st.Kind] == nil {
		return nil
	}
	e := &entry{id: rec.Key.ID, fp: rec.Fingerprint, kind: c.w.kinds[st.Kind], rev: rec.Revision, owner: rec.Owner,
		deadline: rec.Deadline, expires: rec.Expires, parked: st.Parked}
	if st.NotBefore != 0 {
		e.notBefore = time.UnixMilli(st.NotBefore)
	}
	return e
}

// when returns when e may be tried, or false while it must wait for an
// event (a live owner, parked, running here).
func (c *completer) when(e *entry, now time.Time) (time.Time, bool) {
	if e.running || e.parked || !now.Before(e.expires) {
		return time.Time{}, false
	}
	if e.held == e.rev {
		// A live owner holds it: only its death (which clears held) or
		// its deadline can make it due.
		if e.deadline.IsZero() || e.owner == "" {
			return time.Time{}, false
		}
		return maxTime(e.deadline, e.retryAt), true
	}
	var t time.Time
	switch {
	case e.owner == "": // queued, abandoned, or scheduled for later
		t = e.notBefore
	case !c.owners[e.owner] && e.owner != c.w.q.store.Owner():
		t = now // its worker's session is gone
	case !e.deadline.IsZero():
		t = e.deadline
	default:
		// A live owner. (This process's own claims all end, on every
		// path: the store retries an end it could not write, and reaps a
		// claim whose write had an unknown outcome. A claim of ours seen
		// here is one whose end has not reached the watch yet.)
		return time.Time{}, false
	}
	if e.retryAt.After(t) {
		t = e.retryAt
	}
	return t, true
}

// schedule (re)queues e at the time it may be tried.
func (c *completer) schedule(e *entry) {
	e.version++
	if t, ok := c.when(e, c.w.q.clock.now()); ok {
		heap.Push(&c.due, dueItem{at: t, id: e.id, version: e.version})
	}
}

// dispatch starts due jobs while slots are free.
func (c *completer) dispatch(ctx context.Context) {
	for {
		c.mu.Lock()
		now := c.w.q.clock.now()
		var next time.Time
		for c.free > 0 && len(c.due) > 0 {
			it := c.due[0]
			if it.at.After(now) {
				next = it.at
				break
			}
			heap.Pop(&c.due)
			e := c.jobs[it.id]
			if e == nil || e.version != it.version {
				continue // changed or gone since it was queued
			}
			if t, ok := c.when(e, now); !ok || t.After(now) {
				c.schedule(e)
				continue
			}
			e.running = true
			c.free--
			c.w.wg.Add(1)
			go c.run(*e) // not ctx: a running job has Close's drain to finish
		}
		c.mu.Unlock()
		var stop func() bool
		if !next.IsZero() {
			stop = c.w.q.clock.after(next.Sub(now), c.wake)
		}
		select {
		case <-ctx.Done():
			if stop != nil {
				stop()
			}
			return
		case <-c.kick:
		}
		if stop != nil {
			stop()
		}
	}
}

// run tries one job, then sets when it may be tried again.
func (c *completer) run(e entry) {
	defer c.w.wg.Done()
	err := c.w.execute(context.Background(), e.id, e.fp, e.kind)
	c.mu.Lock()
	defer func() {
		c.free++
		c.mu.Unlock()
		c.wake()
	}()
	cur := c.jobs[e.id]
	if cur == nil {
		return
	}
	cur.running = false
	switch {
	case errors.Is(err, etcdstore.ErrConflict) && !c.owners[cur.owner]:
		// Held by an owner this index has not seen alive (its session's
		// event is still on its way, or it died meanwhile): try again
		// soon rather than wait for an event that may have come already.
		cur.fails++
		cur.retryAt = c.w.q.clock.now().Add(min(time.Duration(100<<min(cur.fails, 6))*time.Millisecond, 5*time.Second))
	case err == nil || errors.Is(err, etcdstore.ErrConflict) || errors.Is(err, etcdstore.ErrFenced):
		// Ran, or held by a live owner: the record has changed, or will
		// change, and its events (or its owner's death, or its deadline)
		// say what next.
		cur.held, cur.fails, cur.retryAt = e.rev, 0, time.Time{}
	default:
		cur.fails++
		cur.retryAt = c.w.q.clock.now().Add(min(time.Duration(100<<min(cur.fails, 8))*time.Millisecond, 30*time.Second))
		c.w.log.Info("idem: job attempt failed to start or end; retrying later", "job", c.w.q.Key(e.id).Digest(), "err", err)
	}
	c.schedule(cur)
}

// dueItem is a job that may be tried at a time.
type dueItem struct {
	at      time.Time
	id      string
	version int
}

type dueQueue []dueItem

func (q dueQueue) Len() int           { return len(q) }
func (q dueQueue) Less(i, j int) bool { return q[i].at.Before(q[j].at) }
func (q dueQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *dueQueue) Push(x any)        { *q = append(*q, x.(dueItem)) }
func (q *dueQueue) Pop() any {
	old := *q
	it := old[len(old)-1]
	*q = old[:len(old)-1]
	return it
}
