package check

import (
	"encoding/binary"
	"slices"
	"time"

	"github.com/idem-dev/idem/internal/etcdmodel"
	"github.com/idem-dev/idem/internal/kernel"
)

// Scope is the size of the worlds explored: how many processes and keys,
// and how many of each fault a world may suffer. Every interleaving within
// it is explored.
type Scope struct {
	Name     string
	Procs    int // 2 or 3 processes, each running one client
	Keys     int // 1 or 2 keys; client i works on key i % Keys
	Faults   int // Txns whose answer is lost, held in the network, never sent, or given up on
	Crashes  int // processes killed (and restarted with a new session)
	Expiries int // sessions that expire in etcd (the process was cut off)
	Ticks    int // how far the clock moves, in seconds
	Skew     []int64
	// Deadline gives every claim a deadline of that many seconds (0: none);
	// Retention is the store's (in seconds).
	Deadline, Retention int
	Checkpoint          bool // clients save a recovery point between their two effects
	Retries             int  // how often a client claims its key again after a conflict or an error
	Epochs              bool // the store is a shard: claims compare its epoch
	Raises              int  // epoch raises
	Sweep               bool // a sweeper deletes records of expired retention buckets
	Evict               bool // an operator (a drain, a schedule) deletes records past their retention with EvictIf
	Clients             int  // clients per process (default 1), on keys in turn
	Hangs               int  // clients that stop for good while they hold a claim (a stuck handler)
	// Shards makes the world a shard set of two clusters, each with its own
	// revisions: the keys live on the first under the first shard set; a
	// nemesis installs the second, which hands them over to the second
	// cluster (Forward, the epoch raised, ReplaceMoved), and processes learn
	// it late.
	Shards    bool
	ReadFirst bool // clients look for a done record without a write before they claim
}

// MaxDelay bounds how long a Txn that left its process may take to land:
// etcd applies a request within its election timeouts or never, and a
// second is more than that in the model's worlds, whose retentions are
// longer.
const MaxDelay = 1

// Step is the unit of time: a scope's deadlines, retention and ticks are
// counted in it.
const Step = time.Second

var epoch0 = time.Date(2027, 3, 28, 1, 0, 0, 0, time.UTC)

const prefix = "/idem/"

var keys = kernel.Keys{Prefix: prefix}

var recordKeys = [...]string{keys.Record("t", "k0"), keys.Record("t", "k1"), keys.Record("t", "k2")}

func recordKey(i int) string { return recordKeys[i] }

func fingerprint(i int) [32]byte { return [32]byte{byte(i + 1)} }

// world is one state: etcd, the processes, the network, the sink
// downstream, and what the invariants remember of the past.
type world struct {
	now     int64              // seconds since epoch0
	etcds   []*etcdmodel.Store // the clusters: one, or a shard set's two
	buckets []bucket           // retention leases by the second they outlive
	procs   []*proc
	net     []held // Txns that left their process and may land later, or never
	sink    []effect
	keys    []keyHist
	used    budget
	dead    []deadLease // the session leases of crashed incarnations, until they expire
	sweep   *sweepState // what the sweeper listed, to delete next
	evict   *evictState // what an operator read, to delete next
}

// budget counts the faults a world has suffered.
type budget struct{ faults, crashes, expiries, ticks, raises, hangs int }

type bucket struct {
	cl    int   // its cluster
	until int64 // seconds
	lease int64
}

// held is a Txn held in the network: it may land later, or never.
type held struct {
	sent   int64       // when it was sent (seconds): a Txn lands within MaxDelay, or never
	txn    *kernel.Txn // lowered
	from   string      // the process and operation that sent it, for the trace
	writer writer
}

// writer says who sent a Txn, for the invariants that judge the writes
// that land.
type writer struct {
	cl      int // the cluster it writes to
	proc    int
	owner   string // the writer's session
	kind    wkind
	attempt string
	token   int64
	now     int64 // the writer's clock when it decided, in seconds
}

type wkind uint8

const (
	wClaim wkind = iota
	wWrite
	wFinal // a final write retried in the background
	wReap
	wSweep
	wEvict
	wRaise
	wMove // a hand-over (Forward)
)

// effect is what reached the sink downstream: a key's step, applied by a
// claim with its token.
type effect struct {
	key, step int
	token     int64
	takeovers int
	created   int64 // the operation's creation (a new operation may do the steps again)
}

// keyHist is what the invariants remember of a key's history in etcd.
type keyHist struct {
	maxToken   int64  // the highest token any record of the key carried
	saved      []byte // the outcome saved for the current operation
	savedFor   int64  // that operation's creation (unix nanoseconds)
	checkpoint string // the latest recovery point of the current operation
	ckptFor    int64
	toldLost   []int64 // tokens whose Complete was told it was not saved
}

// proc is an idem process: its session, its clock, its client, its
// background writes, and the attempts it holds.
type proc struct {
	id      int
	inc     int     // incarnation: a new session (after a crash or a lost session) is a new owner
	ownerID string  // its session's owner id: p<id>.<inc>
	sess    []int64 // its session's lease, on each cluster
	noticed bool    // it noticed its session is gone, and starts a new one
	skew    int64
	epoch   []int64 // the shard epoch it believes in, of each cluster
	gen     int64   // the shard set it routes by (Scope.Shards)
	setRev  []int64 // the revision of that set on each cluster, as it last saw it
	clients []client
	bg      []*task
	hold    []attemptRef // attempts it runs, or holds the outcome of
}

type attemptRef struct {
	key     int
	attempt string
	// until is when the process stops holding it (seconds, its clock; 0:
	// never): the claim's deadline, or its record's expiry, whichever is
	// first, as the store's timer unregisters it then, unless its final
	// write is pending (the process holds its outcome).
	until int64
}

// holds reports whether p holds attempt of key at its clock now.
func (p *proc) holds(key int, attempt string, now int64) bool {
	i := slices.IndexFunc(p.hold, func(a attemptRef) bool { return a.key == key && a.attempt == attempt })
	if i < 0 {
		return false
	}
	pending := slices.ContainsFunc(p.bg, func(t *task) bool { return t.kind == tFinal && t.attempt == attempt })
	return p.hold[i].until == 0 || now < p.hold[i].until || pending
}

// holdUntil notes when p stops holding attempt of key: the claim it won
// holds until its deadline or its record's expiry.
func (p *proc) holdUntil(key int, attempt string, h kernel.Held) {
	end := h.Expires
	if !h.Deadline.IsZero() && h.Deadline.Before(end) {
		end = h.Deadline
	}
	for i := range p.hold {
		if p.hold[i].key == key && p.hold[i].attempt == attempt {
			p.hold[i].until = int64((end.Sub(epoch0) + Step - 1) / Step)
		}
	}
}

func (p *proc) release(key int, attempt string) {
	p.hold = slices.DeleteFunc(p.hold, func(a attemptRef) bool { return a.key == key && a.attempt == attempt })
}

// clone copies the world; kernel machines, records and Txns are cloned
// or shared as their packages allow.
func (w *world) clone() *world {
	c := *w
	c.etcds = make([]*etcdmodel.Store, len(w.etcds))
	for i, e := range w.etcds {
		c.etcds[i] = e.Clone()
	}
	c.buckets = slices.Clone(w.buckets)
	c.net = slices.Clone(w.net)
	c.sink = slices.Clone(w.sink)
	c.keys = slices.Clone(w.keys)
	c.dead = slices.Clone(w.dead)
	for i := range c.keys {
		c.keys[i].toldLost = slices.Clone(w.keys[i].toldLost)
	}
	c.procs = slices.Clone(w.procs) // shared until one is changed: see own
	return &c
}

// own makes w's process i its own copy, to change it: worlds share the
// processes a move did not touch.
func (w *world) own(i int) *proc {
	p := w.procs[i]
	q := *p
	q.hold = slices.Clone(p.hold)
	q.sess, q.epoch, q.setRev = slices.Clone(p.sess), slices.Clone(p.epoch), slices.Clone(p.setRev)
	q.clients = make([]client, len(p.clients))
	for j, c := range p.clients {
		q.clients[j] = c.clone()
	}
	q.bg = make([]*task, len(p.bg))
	for j, t := range p.bg {
		q.bg[j] = t.clone()
	}
	w.procs[i] = &q
	return &q
}

// appendState writes the world canonically.
func (w *world) appendState(b []byte) []byte {
	b = binary.AppendVarint(b, w.now)
	for _, e := range w.etcds {
		b = e.AppendState(b)
	}
	for _, bk := range w.buckets {
		b = appendInts(b, int64(bk.cl), bk.until, bk.lease)
	}
	b = binary.AppendUvarint(b, uint64(len(w.net)))
	for _, h := range w.net {
		b = binary.AppendVarint(b, h.sent)
		b = h.txn.AppendState(b)
		b = h.writer.appendState(b)
	}
	b = binary.AppendUvarint(b, uint64(len(w.sink)))
	for _, e := range w.sink {
		b = appendInts(b, int64(e.key), int64(e.step), e.token, int64(e.takeovers), e.created)
	}
	for _, k := range w.keys {
		b = appendInts(b, k.maxToken, k.savedFor, k.ckptFor, int64(len(k.toldLost)))
		b = appendInts(b, k.toldLost...)
		b = appendStr(appendStr(b, string(k.saved)), k.checkpoint)
	}
	b = appendInts(b, int64(w.used.faults), int64(w.used.crashes), int64(w.used.expiries), int64(w.used.ticks), int64(w.used.raises), int64(w.used.hangs))
	b = appendInts(b, int64(len(w.dead)))
	for _, d := range w.dead {
		b = appendInts(b, int64(d.cl), d.lease)
	}
	if s := w.sweep; s != nil {
		b = appendInts(append(b, 1), s.lease, int64(len(s.keys)))
		for _, k := range s.keys {
			b = appendStr(b, k)
		}
	}
	if e := w.evict; e != nil {
		b = appendInts(append(b, 2), int64(e.key), e.rev)
	}

	for _, p := range w.procs {
		b = p.appendState(b)
	}
	return b
}

func (p *proc) appendState(b []byte) []byte {
	b = appendInts(b, int64(p.inc), p.skew, p.gen)
	b = appendInts(b, p.sess...)
	b = appendInts(b, p.epoch...)
	b = appendInts(b, p.setRev...)
	b = append(b, boolByte(p.noticed))
	b = binary.AppendUvarint(b, uint64(len(p.hold)))
	for _, a := range p.hold {
		b = appendStr(binary.AppendVarint(b, int64(a.key)), a.attempt)
		b = binary.AppendVarint(b, a.until)
	}
	for _, c := range p.clients {
		b = c.appendState(b)
	}
	b = binary.AppendUvarint(b, uint64(len(p.bg)))
	for _, t := range p.bg {
		b = t.appendState(b)
	}
	return b
}

func (wr writer) appendState(b []byte) []byte {
	b = appendInts(b, int64(wr.cl), int64(wr.proc), int64(wr.kind), wr.token, wr.now)
	return appendStr(appendStr(b, wr.attempt), wr.owner)
}

func appendInts(b []byte, ns ...int64) []byte {
	for _, n := range ns {
		b = binary.AppendVarint(b, n)
	}
	return b
}

func appendStr(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

func boolByte(v bool) byte {
	if v {
		return 1
	}
	return 0
}

// at is the time t seconds after epoch0.
func at(t int64) time.Time { return epoch0.Add(time.Duration(t) * Step) }

// clockOf is process p's clock, in seconds.
func (w *world) clockOf(p *proc) int64 { return w.now + p.skew }

func (p *proc) owner() string { return p.ownerID }

// db is cluster cl's etcd.
func (w *world) db(cl int) *etcdmodel.Store { return w.etcds[cl] }

// deadLease is a crashed incarnation's session lease on a cluster.
type deadLease struct {
	cl    int
	lease int64
}
