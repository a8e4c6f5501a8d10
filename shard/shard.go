// Package shard spreads idem's keys over several etcd clusters, for
// services that retain more keys than one cluster holds (etcd suggests at
// most 8 GiB of database). Each cluster is a shard: an etcdstore.Store of
// its own (its own session, retention leases, cache), and every rule of a
// single store holds per key: one claim at a time, one saved outcome,
// fenced writes, takeovers with greater tokens, retention.
//
// # Placement
//
// A key is placed by rendezvous hashing of its tenant and id over the
// shards of the placement: the shard with the highest hash of (shard name,
// tenant/id) holds it. Adding a shard moves only the keys it wins, from
// every other shard to it; removing one moves only its own keys. A tenant
// may be pinned to one shard (for etcd RBAC, or isolation).
//
// # The shard set in force
//
// The placement in force is not each process's own: it is a Set, ordered
// by its generation, recorded in every shard (storex.ShardSetValue).
// A process asks for the set of its configuration (Config.Generation and
// Config.Placement); the set in force is the newest any shard holds. A
// process installs its own when it is newer and the change is safe (see
// below), with a compare-and-set on one shard, the arbiter of the set in
// force (Set.arbiter): two processes can never put two different sets
// after one in force. It writes the set in force on every other shard it
// uses before it claims there, and every claim, enqueue and hand-over of a
// shard compares that shard's set in its Txn: a process still routing by
// an older set is refused there (storex.ErrSetChanged), learns the new
// set from the answer, and routes again. So processes may learn a change
// in any order, or never restart with a new file: the first write of an
// old process where the new set is recorded teaches it.
//
// # Handing keys over
//
// A set has a previous placement while keys move. A key whose shard
// changed (from its old shard O to its new home H) may still have a live
// record on O, claimed under the previous placement; O stays the single
// source of truth for it until it hands the key over:
//
//   - A process first asks O (etcdstore.Store.Forward): if O holds a live
//     record of the key, the key stays on O, where it is claimed only while
//     that record lives (etcdstore.WithoutCreate). Otherwise O writes a
//     Moved record naming H, and from then on refuses to claim the key.
//   - The key is then claimed on H. A Moved record found on H was left by
//     an older set, and is replaced (etcdstore.ReplaceMoved).
//
// Each process drains the shards of the previous placement in the
// background: once a shard holds no record of a key placed elsewhere (the
// drain deletes those whose retention passed, each if unchanged since it
// listed it), it is marked drained for the generation, and processes stop
// asking it. Once every one is drained, the set is settled (Set.Settled):
// no process asks the old shards again, nor needs them for the next
// change. Nothing waits for a time to pass: the hand-over ends when the
// records that kept it going have ended, whatever the retention.
//
// Invariant: every live record of a key is on its shard under the set's
// placement or under its previous placement (the two places a claim
// looks), and at most one of them can grant a claim: the old shard while
// it holds a live record, the home once the old shard wrote its Moved
// record or was drained. A claim on O and a Forward on O are conditional
// writes on one etcd key, ordered by O's history. A new set is installed
// only when the invariant carries over: the set in force was drained (every
// live record is at its home, the new set's previous placement), or the
// new set takes the change back (its placement is the previous one).
// ARCHITECTURE.md ("Shards") has the whole argument.
//
// # Fencing tokens across a move
//
// Each shard has an epoch, a number in its own etcd that only grows
// (etcdstore.WithEpochs): a token is epoch<<EpochShift | revision. A Moved
// record carries its shard's epoch at the move, and a drain mark the
// drained shard's epoch; before a key is claimed on its home, the home's
// epoch is raised above it (RaiseEpoch), so the key's tokens keep growing
// although the new cluster's revisions may be lower.
//
// # Failures
//
// A shard that cannot be reached makes only the keys that need it
// unavailable: those it holds, and those it must hand over. A process
// starts with the shards that answer and connects to the others in the
// background.
package shard

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Shard is one etcd cluster of a set.
type Shard struct {
	// Name identifies the shard in placements, pins and Moved records:
	// 1-32 of [a-z0-9-]. Never rename a shard that holds keys.
	Name string
	// Client is the shard's etcd client. Or Connect makes one: it is
	// called again, with a backoff, until it succeeds (a shard whose etcd
	// does not answer when the process starts is connected to in the
	// background), and the Store closes the client it made.
	Client  *clientv3.Client
	Connect func(ctx context.Context) (*clientv3.Client, error)
	// Options are this shard's own store options, after the set's.
	Options []etcdstore.Option
}

// Placement says which shards keys go to.
type Placement struct {
	// Shards are the names keys are spread over (default: every shard).
	Shards []string `json:"shards"`
	// Pin places every key of a tenant on one shard.
	Pin map[string]string `json:"pin,omitempty"`
}

// String shows p as "[a b]", with its pins when it has any.
func (p Placement) String() string {
	c := p.canonical()
	if len(c.Pin) == 0 {
		return fmt.Sprint(c.Shards)
	}
	return fmt.Sprintf("%v pin %v", c.Shards, c.Pin)
}

// Config is a shard set as a process is configured with it.
type Config struct {
	Shards []Shard
	// Placement is the placement this process asks for, at Generation
	// (default 1). A newer generation than the set in force is installed
	// once that is safe; an older one is ignored: the process follows the
	// set in force.
	Placement  Placement
	Generation int64
	// Previous is the placement before the last change, read only when no
	// shard records a set yet (an upgrade from idem 0.4, whose processes
	// were told of a change by their files alone).
	Previous *Placement
	// Clock runs the store's background work: connecting, learning the
	// set in force, draining (default clock.Real). It is given to every
	// shard's store.
	Clock clock.Clock
	// Log receives what the set does (default: discarded).
	Log *slog.Logger
	// Check is how often the set in force, the drain marks and the drain
	// are looked at again (default 30 s).
	Check time.Duration
	// Skew is how far apart the clocks of the processes may be (default
	// 1 min): a drain counts a record as live until Skew past its
	// retention, as a process whose clock is behind may still take it
	// over.
	Skew time.Duration
}

// Store is idem's store over a set of etcd clusters: Run, Do, Claim,
// Attach, Get, Wait and Evict route each key to its shard.
type Store struct {
	names   []string
	members map[string]*member
	want    Set
	clk     clock.Clock
	log     *slog.Logger
	check   time.Duration
	skew    time.Duration
	opts    []etcdstore.Option

	mu      sync.Mutex
	inForce Set
	known   bool // a set is in force (read or installed)
	marks   map[string]mark
	pending string // why want is not in force

	life context.Context
	stop context.CancelFunc
	work clock.Group
}

// member is one shard, connected or not yet.
type member struct {
	Shard
	st   atomic.Pointer[etcdstore.Store]
	made *clientv3.Client // made by Connect: closed with the store
	err  atomic.Pointer[error]
}

var shardName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)

// New opens a store on every shard of cfg that answers within ctx (each
// with opts, then the shard's own Options, plus etcdstore.WithEpochs),
// and connects to the others in the background. It learns the set in
// force from the shards, and installs cfg's when it is newer and safe.
// It fails only when cfg is not valid.
func New(ctx context.Context, cfg Config, opts ...etcdstore.Option) (*Store, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{members: map[string]*member{}, clk: cfg.Clock, log: cfg.Log, check: cfg.Check, marks: map[string]mark{}}
	if s.clk == nil {
		s.clk = clock.Real
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.check <= 0 {
		s.check = 30 * time.Second
	}
	if s.skew = cfg.Skew; s.skew <= 0 {
		s.skew = time.Minute
	}
	s.opts = append(append([]etcdstore.Option{}, opts...), etcdstore.WithClock(s.clk), storex.WithEpochs())
	for _, sh := range cfg.Shards {
		s.names = append(s.names, sh.Name)
		s.members[sh.Name] = &member{Shard: sh}
	}
	s.want = Set{Generation: max(cfg.Generation, 1), Placement: cfg.Placement, Previous: cfg.Previous}
	if len(s.want.Placement.Shards) == 0 {
		s.want.Placement.Shards = s.names
	}
	s.life, s.stop = context.WithCancel(context.Background())
	for _, n := range s.names {
		if err := s.connect(ctx, s.members[n]); err != nil {
			s.log.Warn("idem: shard does not answer; connecting in the background", "shard", n, "err", err)
			s.work.Go(s.clk, s.life, "connect shard "+n, func(ctx context.Context) { s.reconnect(ctx, s.members[n]) })
		}
	}
	s.refresh(ctx)
	s.work.Go(s.clk, s.life, "shard set", s.watch)
	return s, nil
}

func (cfg *Config) validate() error {
	if len(cfg.Shards) == 0 {
		return fmt.Errorf("shard: %w: no shards", etcdstore.ErrInvalidArgument)
	}
	known := map[string]bool{}
	for _, sh := range cfg.Shards {
		switch {
		case !shardName.MatchString(sh.Name):
			return fmt.Errorf("shard: %w: name %q must be 1-32 of [a-z0-9-]", etcdstore.ErrInvalidArgument, sh.Name)
		case known[sh.Name]:
			return fmt.Errorf("shard: %w: %q named twice", etcdstore.ErrInvalidArgument, sh.Name)
		case sh.Client == nil && sh.Connect == nil:
			return fmt.Errorf("shard %s: %w: no etcd client (Client or Connect)", sh.Name, etcdstore.ErrInvalidArgument)
		}
		known[sh.Name] = true
	}
	if cfg.Generation < 0 {
		return fmt.Errorf("shard: %w: generation %d must be at least 1", etcdstore.ErrInvalidArgument, cfg.Generation)
	}
	check := func(what string, p *Placement) error {
		for _, n := range p.Shards {
			if !known[n] {
				return fmt.Errorf("shard: %w: %s names shard %q, which is not configured", etcdstore.ErrInvalidArgument, what, n)
			}
		}
		for tenant, n := range p.Pin {
			if err := etcdstore.ValidateTenant(tenant); err != nil {
				return fmt.Errorf("shard: %s pin: %w", what, err)
			}
			if !known[n] {
				return fmt.Errorf("shard: %w: %s pins %s to shard %q, which is not configured", etcdstore.ErrInvalidArgument, what, tenant, n)
			}
		}
		return nil
	}
	if err := check("the placement", &cfg.Placement); err != nil {
		return err
	}
	if cfg.Previous != nil {
		if len(cfg.Previous.Shards) == 0 {
			return fmt.Errorf("shard: %w: the previous placement names no shard", etcdstore.ErrInvalidArgument)
		}
		if err := check("the previous placement", cfg.Previous); err != nil {
			return err
		}
	}
	return nil
}

// connect opens m's store, once.
func (s *Store) connect(ctx context.Context, m *member) error {
	cli := m.Client
	if cli == nil {
		var err error
		if cli, err = m.Connect(ctx); err != nil {
			m.err.Store(&err)
			return err
		}
	}
	// Every shard saves what the smallest record of the set holds: a key's
	// limit must not depend on the shard that places it (the contract's
	// MaxRecordSize, and a key handed over to another shard).
	opts := append(append([]etcdstore.Option{}, s.opts...), m.Options...)
	opts = append(opts, etcdstore.WithMaxRecordSize(s.Settings().MaxRecordSize))
	st, err := etcdstore.New(ctx, cli, opts...)
	if err != nil {
		if m.Client == nil {
			cli.Close()
		}
		m.err.Store(&err)
		return err
	}
	if m.Client == nil {
		m.made = cli
	}
	m.err.Store(nil)
	m.st.Store(st)
	return nil
}

// reconnect tries to connect m until it answers, backing off from 1 s to
// 8 s.
func (s *Store) reconnect(ctx context.Context, m *member) {
	for wait := time.Second; ; wait = min(2*wait, 8*time.Second) {
		if clock.Sleep(s.clk, ctx, wait) != nil {
			return
		}
		tctx, cancel := s.clk.WithTimeout(ctx, 2*wait)
		err := s.connect(tctx, m)
		cancel()
		if err == nil {
			s.log.Info("idem: shard connected", "shard", m.Name)
			s.refresh(ctx)
			return
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// watch looks at the set in force (read again from every shard), the
// drain marks and the drain every s.check, until the store closes.
func (s *Store) watch(ctx context.Context) {
	for clock.Sleep(s.clk, ctx, s.check) == nil {
		s.load(ctx, max(s.check, 2*time.Second))
		s.refresh(ctx)
		s.drain(ctx)
	}
}

// load reads the set every connected shard records, at once and each
// within timeout, and returns per shard nil or why it did not answer.
func (s *Store) load(ctx context.Context, timeout time.Duration) map[string]error {
	out := make(map[string]error, len(s.names))
	var mu sync.Mutex
	var g clock.Group
	for _, n := range s.names {
		st := s.store(n)
		if st == nil {
			mu.Lock()
			out[n] = s.unreachable(n)
			mu.Unlock()
			continue
		}
		g.Go(s.clk, ctx, "load shard set "+n, func(ctx context.Context) {
			tctx, cancel := s.clk.WithTimeout(ctx, timeout)
			defer cancel()
			_, err := storex.LoadShardSet(st, tctx)
			mu.Lock()
			out[n] = err
			mu.Unlock()
		})
	}
	g.Wait(s.clk, context.Background())
	return out
}

// store returns shard name's store, or nil while it is not connected (or
// not configured here).
func (s *Store) store(name string) *etcdstore.Store {
	if m := s.members[name]; m != nil {
		return m.st.Load()
	}
	return nil
}

func (s *Store) unreachable(name string) error {
	m := s.members[name]
	if m == nil {
		return fmt.Errorf("shard %s: %w: the shard set in force names it, and this process has no connection settings for it", name, etcdstore.ErrUnavailable)
	}
	if err := m.err.Load(); err != nil {
		return fmt.Errorf("shard %s: %w: not connected: %v", name, etcdstore.ErrUnavailable, *err)
	}
	return fmt.Errorf("shard %s: %w: not connected yet", name, etcdstore.ErrUnavailable)
}

// current returns the set in force, and whether one is known.
func (s *Store) current() (Set, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inForce, s.known
}

// adopt makes set the set in force when it is newer than the one known.
func (s *Store) adopt(set Set) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case !s.known || set.after(s.inForce):
		if s.known {
			s.log.Info("idem: shard set in force", "generation", set.Generation, "was", s.inForce.Generation, "settled", set.Settled)
		}
		if !s.known || set.Generation != s.inForce.Generation {
			clear(s.marks)
		}
		s.inForce, s.known = set, true
		if s.asked() {
			s.pending = "" // nothing is pending once what is asked is in force
		}
	case set.Generation == s.inForce.Generation && !set.same(s.inForce) && !s.inForce.after(set):
		s.log.Error("idem: two different shard sets of one generation; following the first seen", "generation", set.Generation)
	}
}

func (s *Store) markOf(name string) (mark, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.marks[name]
	return m, ok
}

func (s *Store) noteMark(name string, m mark) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.known && m.Generation == s.inForce.Generation {
		s.marks[name] = m
	}
}

// refresh learns the set in force from the shards' last reads, and
// installs this process's own when it is newer and safe.
func (s *Store) refresh(ctx context.Context) {
	s.learn()
	cur, known := s.current()
	switch {
	case known && cur.Generation == s.want.Generation && !cur.Placement.equal(s.want.Placement):
		s.setPending(fmt.Sprintf("generation %d is in force with placement %v, and this process asks for %v at the same generation: raise the generation to change the placement",
			cur.Generation, cur.Placement, s.want.Placement))
		return
	case known && cur.Generation >= s.want.Generation:
		s.setPending("")
		return
	}
	if _, err := s.install(ctx, s.want); err != nil {
		s.setPending(err.Error())
		if !errors.Is(err, errPending) {
			s.log.Warn("idem: installing the shard set", "generation", s.want.Generation, "err", err)
		}
		return
	}
	s.setPending("")
}

// learn adopts the newest set the shards' last reads hold.
func (s *Store) learn() {
	for _, n := range s.names {
		st := s.store(n)
		if st == nil {
			continue
		}
		v := storex.ShardSet(st)
		if v.Revision == 0 {
			continue
		}
		set, err := decodeSet(v.Value)
		if err != nil {
			s.log.Error("idem: unreadable shard set", "shard", n, "err", err)
			continue
		}
		s.adopt(set)
	}
}

// asked reports whether the set in force is, or is newer than, the one
// this process asks for (s.mu held).
func (s *Store) asked() bool {
	return s.known && (s.inForce.Generation > s.want.Generation ||
		s.inForce.Generation == s.want.Generation && s.inForce.Placement.equal(s.want.Placement))
}

func (s *Store) setPending(why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if why != "" && s.asked() {
		// What this process asks for is in force already: the reason was
		// found before (another refresh installed it meanwhile).
		why = ""
	}
	if why != "" && why != s.pending {
		s.log.Info("idem: the shard set asked for is not in force", "generation", s.want.Generation, "why", why)
	}
	s.pending = why
}

// Place returns the shard p puts key on.
func (p Placement) Place(key etcdstore.Key) string { return p.place(key) }

// place returns the shard p puts key on.
func (p *Placement) place(key etcdstore.Key) string {
	tenant := key.Tenant
	if tenant == "" {
		tenant = etcdstore.DefaultTenant
	}
	if n, ok := p.Pin[tenant]; ok {
		return n
	}
	best, bestScore := "", uint64(0)
	for _, n := range p.Shards {
		if sc := score(n, tenant, key.ID); best == "" || sc > bestScore || sc == bestScore && n < best {
			best, bestScore = n, sc
		}
	}
	return best
}

// score is the rendezvous hash of a shard and a key: FNV-1a of both, then
// a 64-bit finalizer (splitmix64's) so that close names score apart. It
// must never change: every process, of every version, places alike.
func score(shard, tenant, id string) uint64 {
	h := fnv.New64a()
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(shard)))
	h.Write(n[:])
	h.Write([]byte(shard))
	h.Write([]byte(tenant))
	h.Write([]byte{'/'})
	h.Write([]byte(id))
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Place returns the name of the shard the set in force puts key on (the
// one this process asks for, while none is known).
func (s *Store) Place(key etcdstore.Key) string {
	set, known := s.current()
	if !known {
		set = s.want
	}
	return set.Placement.place(key)
}

// Shards returns the shards' names, in configuration order.
func (s *Store) Shards() []string { return append([]string(nil), s.names...) }

// Shard returns the store of shard name, or nil (not configured, or not
// connected yet).
func (s *Store) Shard(name string) *etcdstore.Store { return s.store(name) }

// Status is what a Store knows of its shards and of the set in force.
type Status struct {
	// Shards says, per configured shard, nil when it is connected, or why
	// not.
	Shards map[string]error
	// InForce is the set in force (Generation 0: none known yet).
	InForce Set
	// Drained lists the shards known to be drained for InForce.
	Drained []string
	// Asked is the set this process asks for; Pending says why it is not
	// in force, when it is newer.
	Asked   Set
	Pending string
}

// Status returns the store's status.
func (s *Store) Status() Status {
	st := Status{Shards: map[string]error{}, Asked: s.want}
	for _, n := range s.names {
		if s.store(n) == nil {
			st.Shards[n] = s.unreachable(n)
		} else {
			st.Shards[n] = nil
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.known {
		st.InForce = s.inForce
	}
	for n := range s.marks {
		st.Drained = append(st.Drained, n)
	}
	st.Pending = s.pending
	return st
}

// Retention is the retention every shard keeps at least: the shortest of
// the shards' (a record on a shard with a longer one is kept longer).
func (s *Store) Retention() time.Duration { return s.Settings().Retention }

// MaxRecordSize is the record size limit of every shard: the smallest of
// the shards' options, which every shard enforces.
func (s *Store) MaxRecordSize() int { return s.Settings().MaxRecordSize }

// Metrics adds up the connected shards' metrics (etcdstore.Metrics.Add):
// Live while every shard has a session (none while one is not connected),
// Full while any etcd refuses writes for lack of space.
func (s *Store) Metrics() etcdstore.Metrics {
	var m etcdstore.Metrics
	first := true
	for _, n := range s.names {
		st := s.store(n)
		if st == nil {
			m.Live = false
			first = false
			continue
		}
		if first {
			m, first = st.Metrics(), false
			continue
		}
		m = m.Add(st.Metrics())
	}
	return m
}

// CheckFull is etcdstore.Store.CheckFull over the connected shards: whether
// any still is full.
func (s *Store) CheckFull(ctx context.Context) (bool, error) {
	full := false
	var errs []error
	for _, n := range s.names {
		if st := s.store(n); st != nil {
			f, err := st.CheckFull(ctx)
			full = full || f
			errs = append(errs, err)
		}
	}
	return full, errors.Join(errs...)
}

// Owner names this process's session on each connected shard:
// "a=<id>,b=<id>".
func (s *Store) Owner() string {
	var parts []string
	for _, n := range s.names {
		if st := s.store(n); st != nil {
			parts = append(parts, n+"="+st.Owner())
		}
	}
	return strings.Join(parts, ",")
}

// Close stops the background work and closes every shard's store (and the
// clients it made).
func (s *Store) Close() error {
	s.stop()
	s.work.Wait(s.clk, context.Background())
	var errs []error
	for _, n := range s.names {
		m := s.members[n]
		if st := m.st.Load(); st != nil {
			errs = append(errs, st.Close())
		}
		if m.made != nil {
			m.made.Close()
		}
	}
	return errors.Join(errs...)
}

// Check asks every shard, at once and each within timeout, for a
// linearizable read (which also refreshes what this process knows of the
// set in force), and returns, per shard, nil or why it did not answer: a
// shard that hangs costs its own answer only, and Check returns within
// about timeout (installing a set, or draining, is left to the background).
func (s *Store) Check(ctx context.Context, timeout time.Duration) map[string]error {
	out := s.load(ctx, timeout)
	s.learn()
	return out
}
