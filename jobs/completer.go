package jobs

import (
	"container/heap"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
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

	mu    sync.Mutex
	st    *etcdstore.Store // the store (on a shard set, the shard) it follows; set once started
	shard string           // on a shard set, the shard's name
	id    int              // numbers the worker's advert beside others of its store (workerID)

	jobs   map[string]*entry          // in-flight jobs of registered kinds, by id
	owners map[string]bool            // live sessions
	events map[string]map[string]bool // events signalled, by job (id and creation) and name
	due    dueQueue                   // when each entry may be tried, by time
	free   int                        // slots for jobs
	kick   chan struct{}              // closed (and replaced) to wake dispatch

	// Limits: the concurrency slots taken, by slot prefix (a limit and
	// key) and name; the jobs held back because the index shows their
	// key full, by slot prefix; when each group of jobs (a limit's key)
	// last had a job started, for turns.
	slots    map[string]map[string]holder
	slotGen  map[string]uint64 // the tick of the last change of a prefix's held slots (none held: forgotten)
	slotTick uint64
	blocked  map[string]map[string]bool
	served   map[string]uint64
	tick     uint64

	workers map[string]advert // the live workers' adverts, by owner

	// Rates: each rate slot's time (unix ms), by slot prefix (a limit and
	// key) and name; and the attempts of each key this completer started
	// that run now (each may take a slot the index does not show yet).
	rates       map[string]map[string]int64
	ratePending map[string]int

	gated []dueItem // due, held back by the worker's gate until it wakes the completer
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
	awaiting  string    // the event it waits for: it is due when that comes
	created   time.Time // the record's creation, which names the job's events
	token     int64     // the record's fencing token
	limits    []keyedLimit
	limited   string            // the limit (label) whose slots were taken when it was last tried
	woken     bool              // a slot of that limit changed since
	tried     map[string]uint64 // when it was last started here: the generation of each of its limits' slots
	zone      string            // the zone that submitted it
	seenAt    time.Time         // when this completer first saw it at this revision
	// since: when this completer first found it due at once (its owner
	// died, its event came, a slot woke it), at this revision: a
	// fallback counts from there, not from each look.
	since time.Time

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

func newCompleter(w *Worker, st *etcdstore.Store, shard string) *completer {
	return &completer{w: w, st: st, shard: shard, jobs: map[string]*entry{}, owners: map[string]bool{}, events: map[string]map[string]bool{}, free: w.conc, kick: make(chan struct{}),
		slots: map[string]map[string]holder{}, slotGen: map[string]uint64{}, blocked: map[string]map[string]bool{}, served: map[string]uint64{}, workers: map[string]advert{},
		rates: map[string]map[string]int64{}, ratePending: map[string]int{}}
}

// start runs the completer's pieces of work until the worker stops. On a
// shard set, they start once the shard's store is connected.
func (c *completer) start() {
	clk := c.w.q.clock
	if c.st == nil {
		c.w.wg.Go(clk, c.w.stopping, "job completer connect "+c.shard, func(ctx context.Context) {
			for {
				if clock.Sleep(clk, ctx, time.Second) != nil {
					return
				}
				if st := c.w.q.set.Shard(c.shard); st != nil {
					c.mu.Lock()
					c.st = st
					c.mu.Unlock()
					break
				}
			}
			c.start()
		})
		return
	}
	c.id = workerID(c.st)
	c.w.wg.Go(clk, c.w.stopping, "job completer follow", c.follow)
	c.w.wg.Go(clk, c.w.stopping, "job completer dispatch", c.dispatch)
	if c.w.fallback > 0 {
		c.w.wg.Go(clk, c.w.stopping, "job worker advert", c.advertise)
	}
}

func (c *completer) wake() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wakeLocked()
}

func (c *completer) wakeLocked() {
	close(c.kick)
	c.kick = make(chan struct{})
}

// follow keeps the index current: a read of every record and session,
// then their changes from the revision of that read (a Feed); again
// whenever the feed breaks or stalls.
func (c *completer) follow(ctx context.Context) {
	for fails := 0; ctx.Err() == nil; fails++ {
		feed, err := storex.Follow(c.st, ctx, c.w.q.tenant, storex.FollowOptions{Sessions: true, Stall: stallAfter,
			Values: []string{eventPrefix(c.w.q.tenant), limitPrefix(c.w.q.tenant), advertPrefix(c.w.q.tenant)}})
		if err == nil {
			fails = 0
			c.load(feed)
			err = c.watch(ctx, feed)
			feed.Close()
		}
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			c.w.log.Info("idem: job completer re-reading the queue", "err", err)
		}
		clock.Sleep(c.w.q.clock, ctx, min(time.Duration(100<<min(fails, 6))*time.Millisecond, 5*time.Second))
	}
}

// load rebuilds the index from what a feed started from.
func (c *completer) load(feed storex.Feed) {
	owners := map[string]bool{}
	for _, o := range feed.Owners() {
		owners[o] = true
	}
	events := map[string]map[string]bool{}
	slots := map[string]map[string]holder{}
	rates := map[string]map[string]int64{}
	workers := map[string]advert{}
	for _, v := range feed.Values() {
		if strings.HasPrefix(v.Name, limitPrefix(c.w.q.tenant)) {
			setSlot(slots, v)
			setRate(rates, v)
			continue
		}
		if owner, ok := strings.CutPrefix(v.Name, advertPrefix(c.w.q.tenant)); ok {
			var a advert
			if json.Unmarshal(v.Value, &a) == nil {
				workers[owner] = a
			}
			continue
		}
		if id, created, name, ok := parseEvent(v.Name[len(eventPrefix(c.w.q.tenant)):]); ok {
			job := eventJob(id, created)
			if events[job] == nil {
				events[job] = map[string]bool{}
			}
			events[job][name] = true
		}
	}
	jobs := map[string]*entry{}
	for _, rec := range feed.Records() {
		if e := c.entryOf(rec); e != nil {
			jobs[e.id] = e
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, old := range c.jobs {
		if e := jobs[id]; e != nil && old.running {
			e.running, e.held = true, old.held
		}
	}
	c.jobs, c.owners, c.events, c.due, c.slots, c.blocked, c.workers = jobs, owners, events, nil, slots, map[string]map[string]bool{}, workers
	c.rates = rates
	for _, e := range jobs {
		c.blockLimited(e)
		c.schedule(e)
	}
	c.wakeLocked()
}

// watch applies a feed's changes until it breaks or stalls, or ctx ends.
func (c *completer) watch(ctx context.Context, feed storex.Feed) error {
	for {
		changes, err := feed.Next(ctx)
		if err != nil {
			return err
		}
		c.mu.Lock()
		for _, ch := range changes {
			switch {
			case ch.Value != nil && strings.HasPrefix(ch.Value.Name, limitPrefix(c.w.q.tenant)):
				c.slotChanged(ch.Value)
			case ch.Value != nil && strings.HasPrefix(ch.Value.Name, advertPrefix(c.w.q.tenant)):
				c.advertChanged(ch.Value)
			case ch.Value != nil:
				c.eventChanged(ch.Value)
			case ch.Owner != "" && ch.Alive:
				c.owners[ch.Owner] = true
			case ch.Owner != "":
				delete(c.owners, ch.Owner)
				for _, e := range c.jobs {
					if e.owner == ch.Owner {
						e.held = 0 // its owner is dead now: try again
						c.schedule(e)
					}
				}
			default:
				c.recordChanged(ch)
			}
		}
		c.wakeLocked()
		c.mu.Unlock()
	}
}

// recordChanged applies one change of a job record.
func (c *completer) recordChanged(ch storex.Change) {
	c.unblockHeldBy(ch.Key.ID)
	e := c.entryOf(ch.Record)
	if e == nil {
		c.drop(ch.Key.ID)
		return
	}
	if old := c.jobs[e.id]; old != nil {
		e.running, e.held, e.fails, e.version, e.tried = old.running, old.held, old.fails, old.version, old.tried
		if old.rev == e.rev {
			e.seenAt = old.seenAt
		}
	}
	c.jobs[e.id] = e
	c.blockLimited(e)
	c.schedule(e)
}

// eventChanged notes an event signalled (or deleted, its retention past),
// and wakes the job that waits for it.
func (c *completer) eventChanged(v *storex.Value) {
	id, created, name, ok := parseEvent(strings.TrimPrefix(v.Name, eventPrefix(c.w.q.tenant)))
	if !ok {
		return
	}
	job := eventJob(id, created)
	switch {
	case v.Revision == 0 && c.events[job] != nil:
		delete(c.events[job], name)
		if len(c.events[job]) == 0 {
			delete(c.events, job)
		}
	case v.Revision != 0:
		if c.events[job] == nil {
			c.events[job] = map[string]bool{}
		}
		c.events[job][name] = true
	}
	if e := c.jobs[id]; e != nil && e.awaiting == name && e.created.UnixMilli() == created {
		c.schedule(e)
	}
}

// eventJob names a job in the completer's events: its id and creation.
func eventJob(id string, created int64) string { return id + "/" + strconv.FormatInt(created, 10) }

func (c *completer) drop(id string) {
	if e := c.jobs[id]; e != nil {
		e.version++
		delete(c.jobs, id)
	}
}

// entryOf returns the entry of an in-flight job record of a registered
// kind, or nil.
func (c *completer) entryOf(rec *etcdstore.Record) *entry {
	if rec == nil || rec.State != etcdstore.InFlight {
		return nil
	}
	st, err := decodeState(rec.Checkpoint)
	if err != nil || c.w.kinds[st.Kind] == nil {
		return nil
	}
	k := c.w.kinds[st.Kind]
	e := &entry{id: rec.Key.ID, fp: rec.Fingerprint, kind: k, rev: rec.Revision, owner: rec.Owner,
		deadline: rec.Deadline, expires: rec.Expires, parked: st.Parked, awaiting: st.Awaiting, created: rec.Created,
		token: int64(rec.Token), limited: st.Limited, zone: st.Zone, seenAt: c.w.q.clock.Now()}
	e.limits, _ = k.limitsOf(st.Params) // (an error fails the job when it is tried)
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
	free := true // nobody holds it: its preferred worker tries it first
	switch {
	case e.owner == "" && e.awaiting != "" && c.events[eventJob(e.id, e.created.UnixMilli())][e.awaiting]:
		t = e.dueSince(now) // its event came
	case e.owner == "" && e.woken:
		t = e.dueSince(now) // a slot of the limit that held it back changed (a rate's time is its NotBefore)
	case e.owner == "": // queued, abandoned, scheduled for later, waiting for an event until its timeout
		t = e.notBefore
		if t.IsZero() {
			// First come, first served (not by id): when it was created,
			// or when this completer saw it, if that is sooner (another
			// clock wrote it).
			t = e.created
			if e.seenAt.Before(t) {
				t = e.seenAt
			}
		}
	case !c.owners[e.owner] && e.owner != c.st.Owner():
		t = e.dueSince(now) // its worker's session is gone
	case !e.deadline.IsZero():
		free = false
		t = e.deadline
	default:
		// A live owner. (This process's own claims all end, on every
		// path: the store retries an end it could not write, and reaps a
		// claim whose write had an unknown outcome. A claim of ours seen
		// here is one whose end has not reached the watch yet.)
		return time.Time{}, false
	}
	if d := c.fallbackFor(e); free && d > 0 {
		// Another worker is preferred: this one takes the job only if
		// that one has not, d after it became due (as this worker saw it).
		t = maxTime(t, e.seenAt).Add(d)
	}
	if e.retryAt.After(t) {
		t = e.retryAt
	}
	return t, true
}

// dueSince returns when e was first found due at once (now, the first
// time): a fixed instant, so that a fallback counted from it comes.
// (Found by review: counted from each look, it never came.)
func (e *entry) dueSince(now time.Time) time.Time {
	if e.since.IsZero() {
		e.since = now
	}
	return e.since
}

// schedule (re)queues e at the time it may be tried.
func (c *completer) schedule(e *entry) {
	e.version++
	if t, ok := c.when(e, c.w.q.clock.Now()); ok {
		heap.Push(&c.due, dueItem{at: t, id: e.id, version: e.version})
	}
}

// dispatch starts due jobs while slots are free.
func (c *completer) dispatch(ctx context.Context) {
	for {
		c.mu.Lock()
		now := c.w.q.clock.Now()
		var next time.Time
		var ready []*entry
		var readyAt []time.Time // when each was due: a job not started keeps its place
		for _, it := range c.gated {
			heap.Push(&c.due, it)
		}
		c.gated = nil
		for c.free > 0 && len(c.due) > 0 && !c.due[0].at.After(now) {
			it := heap.Pop(&c.due).(dueItem)
			e := c.jobs[it.id]
			if e == nil || e.version != it.version {
				continue // changed or gone since it was queued
			}
			if t, ok := c.when(e, now); !ok || t.After(now) {
				c.schedule(e)
				continue
			}
			if p := c.room(e); p != "" {
				c.block(e, p) // its key's slots are all taken: until one frees
				continue
			}
			ready, readyAt = append(ready, e), append(readyAt, it.at)
		}
		// Turns: the group (a limit's key) whose job started longest ago
		// goes first, so that one key with many jobs due does not hold
		// the others back.
		for c.free > 0 && len(ready) > 0 {
			best := 0
			for i, e := range ready {
				if c.served[group(e)] < c.served[group(ready[best])] {
					best = i
				}
			}
			e, at := ready[best], readyAt[best]
			ready, readyAt = slices.Delete(ready, best, best+1), slices.Delete(readyAt, best, best+1)
			if c.w.gate != nil && !c.w.gate(e.kind.Name, e.id) {
				// No remote worker of its kind waits: until one comes
				// (the gate's owner wakes the completer).
				c.gated = append(c.gated, dueItem{at: at, id: e.id, version: e.version})
				continue
			}
			if p, at := c.rateRoom(e, now); p != "" {
				if c.w.ungate != nil {
					c.w.ungate(e.kind.Name, e.id)
				}
				// Its key's rate slots are used (or about to be, by
				// attempts running): not before the soonest is free again,
				// or a slot of the key changes. (Found by review: every
				// job held back by a rate was claimed at the same time.)
				c.block(e, p)
				heap.Push(&c.due, dueItem{at: at, id: e.id, version: e.version})
				continue
			}
			for _, p := range rateSlotsOf(c.w.q.tenant, e) {
				c.ratePending[p]++
			}
			c.tick++
			c.served[group(e)] = c.tick
			if e.owner == "" && c.fallbackFor(e) > 0 {
				c.w.log.Debug("idem: job taken in its preferred worker's place", "job", c.w.q.Key(e.id).Digest(), "zone", e.zone)
			}
			e.running = true
			e.tried = map[string]uint64{}
			for _, kl := range e.limits {
				p := kl.slots(c.w.q.tenant, "c")
				e.tried[p] = c.slotGen[p]
			}
			c.free--
			job := *e
			// Not ctx: a running job has Close's drain to finish.
			c.w.wg.Go(c.w.q.clock, context.WithoutCancel(ctx), "job "+e.id, func(context.Context) { c.run(job) })
		}
		for i, e := range ready {
			// At the time it was due, not now: pushed back as now, a job
			// left over lost its place to every job due since, and a
			// job of a busy group could wait for ever (found by the 3-DC
			// scenario: a refund queued for a minute behind reports).
			heap.Push(&c.due, dueItem{at: readyAt[i], id: e.id, version: e.version})
		}
		if len(c.served) > 2*len(c.jobs)+64 {
			// Forget the turns of keys with no job left, so that the map
			// does not grow with every key ever seen.
			keep := map[string]uint64{}
			for _, e := range c.jobs {
				if t, ok := c.served[group(e)]; ok {
					keep[group(e)] = t
				}
			}
			c.served = keep
		}
		if len(c.due) > 0 && c.free > 0 {
			next = c.due[0].at
		}
		kick := c.kick
		c.mu.Unlock()
		var stop func() bool
		if !next.IsZero() {
			stop = c.w.q.clock.AfterFunc(next.Sub(now), c.wake)
		}
		err := c.w.q.clock.Wait(ctx, kick)
		if stop != nil {
			stop()
		}
		if err != nil {
			return
		}
	}
}

// run tries one job, then sets when it may be tried again.
func (c *completer) run(e entry) {
	err := c.w.execute(context.Background(), e.id, e.fp, e.kind)
	if c.w.ungate != nil {
		c.w.ungate(e.kind.Name, e.id)
	}
	c.mu.Lock()
	defer func() {
		c.free++
		c.wakeLocked()
		c.mu.Unlock()
	}()
	for _, p := range rateSlotsOf(c.w.q.tenant, &e) {
		if c.ratePending[p]--; c.ratePending[p] <= 0 {
			delete(c.ratePending, p)
		}
	}
	cur := c.jobs[e.id]
	if cur == nil {
		return
	}
	cur.running = false
	switch {
	case errors.Is(err, errReplayed):
		// The claim replayed an ended job while this index holds it
		// queued: either its end's event is on its way (and drops it), or
		// the store read a record deleted since. Try again soon; a replay
		// is never counted as a run.
		cur.fails++
		cur.retryAt = c.w.q.clock.Now().Add(min(time.Duration(100<<min(cur.fails, 6))*time.Millisecond, 5*time.Second))
	case errors.Is(err, etcdstore.ErrConflict) && !c.owners[cur.owner]:
		// Held by an owner this index has not seen alive (its session's
		// event is still on its way, or it died meanwhile): try again
		// soon rather than wait for an event that may have come already.
		cur.fails++
		cur.retryAt = c.w.q.clock.Now().Add(min(time.Duration(100<<min(cur.fails, 6))*time.Millisecond, 5*time.Second))
	case err == nil || errors.Is(err, etcdstore.ErrConflict) || errors.Is(err, etcdstore.ErrFenced):
		// Ran, or held by a live owner: the record has changed, or will
		// change, and its events (or its owner's death, or its deadline)
		// say what next.
		cur.held, cur.fails, cur.retryAt = e.rev, 0, time.Time{}
	default:
		cur.fails++
		cur.retryAt = c.w.q.clock.Now().Add(min(time.Duration(100<<min(cur.fails, 8))*time.Millisecond, 30*time.Second))
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

func (q dueQueue) Len() int { return len(q) }
func (q dueQueue) Less(i, j int) bool {
	// Ties by id: jobs due at once start in one order, whatever order
	// they were queued in (maps' order), as a replayed simulation needs.
	return q[i].at.Before(q[j].at) || q[i].at.Equal(q[j].at) && q[i].id < q[j].id
}
func (q dueQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *dueQueue) Push(x any)   { *q = append(*q, x.(dueItem)) }
func (q *dueQueue) Pop() any {
	old := *q
	it := old[len(old)-1]
	*q = old[:len(old)-1]
	return it
}

// group names the turn a job takes among due jobs: its first limit's key
// ("" for a job without limits).
func group(e *entry) string {
	if len(e.limits) == 0 {
		return ""
	}
	return e.limits[0].label()
}

// rateSuffix ends the label of a rate limit that held a job back.
const rateSuffix = " (rate)"

// setSlot notes a concurrency slot's value (a deletion: Revision 0) in
// slots, by its prefix (a limit and key).
func setSlot(slots map[string]map[string]holder, v storex.Value) {
	i := strings.LastIndex(v.Name, "/c/")
	if i < 0 {
		return // a rate slot
	}
	prefix := v.Name[:i+3]
	if v.Revision == 0 {
		delete(slots[prefix], v.Name)
		if len(slots[prefix]) == 0 {
			delete(slots, prefix)
		}
		return
	}
	var h holder
	if json.Unmarshal(v.Value, &h) != nil {
		return // damaged: whoever tries takes it
	}
	if slots[prefix] == nil {
		slots[prefix] = map[string]holder{}
	}
	slots[prefix][v.Name] = h
}

// slotChanged notes a slot taken or freed, and lets the jobs held back by
// its key try again.
func (c *completer) slotChanged(v *storex.Value) {
	setSlot(c.slots, *v)
	if i := strings.LastIndex(v.Name, "/r/"); i >= 0 {
		setRate(c.rates, *v)
		c.unblock(v.Name[:i+3])
		return
	}
	if i := strings.LastIndex(v.Name, "/c/"); i >= 0 {
		// A tick no earlier change had: an attempt that saw another
		// generation knows its key's slots changed since.
		p := v.Name[:i+3]
		c.slotTick++
		c.slotGen[p] = c.slotTick
		if len(c.slotGen) > 4096 {
			// Forget the keys with no slot held and no job held back. (A
			// job tried when its key's tick was forgotten may miss a
			// wakeup: it is tried again at its poll, limitPoll later.)
			for q := range c.slotGen {
				if len(c.slots[q]) == 0 && len(c.blocked[q]) == 0 {
					delete(c.slotGen, q)
				}
			}
		}
		c.unblock(v.Name[:i+3])
	}
}

// room returns the slot prefix of the first of e's concurrency limits
// whose slots the index shows all held by live claims, or "" when each has
// room. A holder counts while the index knows its job in flight, owned, at
// the slot's token: a slot whose claim is over (its release lost) does not
// hold a job back; the attempt frees it.
func (c *completer) room(e *entry) string {
	for _, kl := range e.limits {
		if kl.Concurrency == 0 {
			continue
		}
		prefix := kl.slots(c.w.q.tenant, "c")
		live := 0
		for _, h := range c.slots[prefix] {
			if j := c.jobs[h.Job]; h.Job != e.id && j != nil && j.owner != "" && j.token == h.Token {
				live++
			}
		}
		if live >= kl.Concurrency {
			return prefix
		}
	}
	return ""
}

// block holds e back until a slot under prefix changes, or a job holding
// one does.
func (c *completer) block(e *entry, prefix string) {
	if c.blocked[prefix] == nil {
		c.blocked[prefix] = map[string]bool{}
	}
	c.blocked[prefix][e.id] = true
}

// blockLimited holds back a job that an attempt found limited by a
// concurrency limit until a slot of its key changes (or its NotBefore, a
// poll, comes).
func (c *completer) blockLimited(e *entry) {
	if e.owner != "" || e.limited == "" || strings.HasSuffix(e.limited, rateSuffix) {
		return
	}
	for _, kl := range e.limits {
		if kl.label() != e.limited {
			continue
		}
		p := kl.slots(c.w.q.tenant, "c")
		if gen, ok := e.tried[p]; ok && gen != c.slotGen[p] {
			// Its slots changed since this worker tried it (a release
			// seen before the record that says it was held back): try
			// again now, or that release's wakeup is lost.
			e.woken = true
			return
		}
		c.block(e, p)
	}
}

// unblock lets the jobs held back by prefix's slots try again.
func (c *completer) unblock(prefix string) {
	for id := range c.blocked[prefix] {
		if e := c.jobs[id]; e != nil {
			e.woken = true
			c.schedule(e)
		}
	}
	delete(c.blocked, prefix)
}

// unblockHeldBy unblocks the keys whose slots job id holds: its claim
// changed, and may be over.
func (c *completer) unblockHeldBy(id string) {
	for prefix, hs := range c.slots {
		if len(c.blocked[prefix]) == 0 {
			continue
		}
		for _, h := range hs {
			if h.Job == id {
				c.unblock(prefix)
				break
			}
		}
	}
}

// Explain says what the worker's completers know of job id, and when they
// would try it: for an operator, or a test, asking why a job does not run.
// (One line per completer: on a shard set, one per shard.)
func (w *Worker) Explain(id string) string {
	if len(w.comps) == 0 {
		return "no completer (Concurrency 0): the worker runs only what Run asks"
	}
	w.mu.Lock()
	running := make([]string, 0, len(w.running))
	for r := range w.running {
		running = append(running, r)
	}
	w.mu.Unlock()
	slices.Sort(running)
	out := []string{fmt.Sprintf("running here: %v", running)}
	for _, c := range w.comps {
		out = append(out, c.explain(id))
	}
	return strings.Join(out, "\n")
}

func (c *completer) explain(id string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	where := ""
	if c.shard != "" {
		where = "shard " + c.shard + ": "
	}
	if c.st == nil {
		return where + "not connected yet"
	}
	e := c.jobs[id]
	if e == nil {
		return where + "not in the index: not in flight here, or of a kind this worker does not run"
	}
	now := c.w.q.clock.Now()
	at, ok := c.when(e, now)
	queued, dueNow := false, 0
	for _, it := range c.due {
		queued = queued || it.id == id && it.version == e.version
		if !it.at.After(now) {
			dueNow++
		}
	}
	ms := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.Sub(now).Round(time.Millisecond).String()
	}
	return fmt.Sprintf("%srev %d owner %q (alive %v, ours %v) running=%v parked=%v held=%v awaiting=%q notBefore=%s retryAt=%s fails=%d limited=%q blocked=%q fallback=%v tryAt=%s (ok %v) queued=%v (due now: %d, stale items included) free=%d/%d workers=%d",
		where, e.rev, e.owner, c.owners[e.owner], e.owner != "" && e.owner == c.st.Owner(), e.running, e.parked, e.held == e.rev, e.awaiting,
		ms(e.notBefore), ms(e.retryAt), e.fails, e.limited, c.room(e), c.fallbackFor(e), ms(at), ok, queued, dueNow, c.free, c.w.conc, len(c.workers))
}
