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
// # Changing the shard set
//
// Processes learn a new shard set one by one, so for a while some place a
// key on its old shard and some on its new one. Two claims of one key in
// two clusters would run its work twice, so the old shard stays the single
// source of truth for a key until it hands the key over:
//
//   - A process whose placement moved key K from shard A (Config.Previous)
//     to shard B (Config.Placement) first asks A (etcdstore.Store.Forward):
//     if A holds a live record of K, K stays on A, where every retry of a
//     claim made under the old placement finds it; otherwise A writes, by a
//     create-if-absent (or a compare-and-set on an expired record), a Moved
//     record naming B, and from then on refuses to claim K (ErrMoved).
//   - Any process that meets a Moved record, whatever its own placement,
//     follows it to the shard it names.
//
// Invariant: at any moment at most one shard can grant a claim of K: the
// one that holds a live record of it, or, when none does, the first shard
// along K's Moved records whose record of K is absent or expired. A claim
// on A and a Forward on A are both conditional writes on the same etcd key,
// so they are ordered by A's linearizable history: either the claim lands
// first (and Forward then finds it and keeps K on A) or the Moved record
// does (and the claim's Txn finds it and is refused). TestHandOver runs
// processes with the old and the new shard set on the same keys while a
// shard is added, with lost replies, and counts each key's effects.
//
// The previous placement must stay configured (Config.Previous) until
// every process runs the new one and one retention has passed since: the
// keys that stayed on their old shard then expired there.
//
// # Fencing tokens across a move
//
// Each shard has an epoch, a number in its own etcd that only grows
// (etcdstore.WithEpochs): a token is epoch<<EpochShift | revision. A Moved
// record carries its shard's epoch at the move; before a key is claimed on
// its new shard, that shard's epoch is raised above it (RaiseEpoch), so
// the key's tokens keep growing although the new cluster's revisions may
// be lower. A downstream fencing.Checker compares tokens as integers, as
// before.
//
// # Failures
//
// A shard that cannot be reached makes its own keys unavailable; keys of
// other shards are served. A key being handed over needs its old shard.
package shard

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// Shard is one etcd cluster of a set.
type Shard struct {
	// Name identifies the shard in placements, pins and Moved records:
	// 1-32 of [a-z0-9-]. Never rename a shard that holds keys.
	Name   string
	Client *clientv3.Client
}

// Placement says which shards new keys go to.
type Placement struct {
	// Shards are the names keys are spread over (default: every shard).
	Shards []string
	// Pin places every key of a tenant on one shard.
	Pin map[string]string
}

// Config is a shard set.
type Config struct {
	Shards    []Shard
	Placement Placement
	// Previous is the placement before the last change, while keys are
	// handed over; nil when none is under way.
	Previous *Placement
}

// Store is idem's store over a set of etcd clusters: Run, Do, Claim,
// Attach, Get, Wait and Evict route each key to its shard.
type Store struct {
	names     []string
	shards    map[string]*etcdstore.Store
	placement Placement
	previous  *Placement
}

var shardName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)

// maxHops bounds how many Moved records one operation follows.
const maxHops = 4

// New opens a store on every shard of cfg, each with opts (plus
// etcdstore.WithEpochs). Every shard must answer within ctx.
func New(ctx context.Context, cfg Config, opts ...etcdstore.Option) (*Store, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{shards: make(map[string]*etcdstore.Store), placement: cfg.Placement, previous: cfg.Previous}
	for _, sh := range cfg.Shards {
		st, err := etcdstore.New(ctx, sh.Client, append(append([]etcdstore.Option{}, opts...), etcdstore.WithEpochs())...)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("shard %s: %w", sh.Name, err)
		}
		s.names = append(s.names, sh.Name)
		s.shards[sh.Name] = st
	}
	if len(s.placement.Shards) == 0 {
		s.placement.Shards = s.names
	}
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
		case sh.Client == nil:
			return fmt.Errorf("shard %s: %w: nil etcd client", sh.Name, etcdstore.ErrInvalidArgument)
		}
		known[sh.Name] = true
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

// Place returns the name of the shard the current placement puts key on.
func (s *Store) Place(key etcdstore.Key) string { return s.placement.place(key) }

// Shards returns the shards' names, in configuration order.
func (s *Store) Shards() []string { return append([]string(nil), s.names...) }

// Shard returns the store of shard name, or nil.
func (s *Store) Shard(name string) *etcdstore.Store { return s.shards[name] }

// route returns the shard that may claim key: its home under the current
// placement, after its old home handed it over (or kept it) when the
// placement moved it.
func (s *Store) route(ctx context.Context, key etcdstore.Key) (*etcdstore.Store, error) {
	home := s.placement.place(key)
	if s.previous == nil {
		return s.shards[home], nil
	}
	old := s.previous.place(key)
	if old == home {
		return s.shards[home], nil
	}
	rec, err := s.shards[old].Forward(ctx, key, home)
	if err != nil {
		return nil, fmt.Errorf("hand %s over from shard %s: %w", key, old, err)
	}
	if rec.State != etcdstore.Moved {
		return s.shards[old], nil // it lives there: claimed under the old placement
	}
	return s.follow(ctx, key, &etcdstore.MovedError{Key: key, To: rec.MovedTo, Epoch: rec.Epoch})
}

// follow returns the shard a Moved record names, its epoch raised above
// the one the key left.
func (s *Store) follow(ctx context.Context, key etcdstore.Key, me *etcdstore.MovedError) (*etcdstore.Store, error) {
	to := s.shards[me.To]
	if to == nil {
		return nil, fmt.Errorf("%s moved to shard %q, which this process does not know: %w", key, me.To, etcdstore.ErrUnavailable)
	}
	if to.Epoch() <= me.Epoch {
		if _, err := to.RaiseEpoch(ctx, me.Epoch); err != nil {
			return nil, fmt.Errorf("shard %s: %w", me.To, err)
		}
	}
	return to, nil
}

// do runs op on key's shard, following Moved records.
func (s *Store) do(ctx context.Context, key etcdstore.Key, op func(*etcdstore.Store) error) error {
	st, err := s.route(ctx, key)
	for hop := 0; err == nil; hop++ {
		err = op(st)
		var me *etcdstore.MovedError
		if !errors.As(err, &me) {
			return err
		}
		if hop >= maxHops {
			return fmt.Errorf("%s: %w after %d hops: %w", key, etcdstore.ErrUnavailable, hop, err)
		}
		st, err = s.follow(ctx, key, me)
	}
	return err
}

// readShard returns the shard that holds key's record (or would), without
// writing: a read never hands a key over.
func (s *Store) readShard(ctx context.Context, key etcdstore.Key) (*etcdstore.Store, *etcdstore.Record, error) {
	name, rec, err := locate(ctx, key, &s.placement, s.previous, func(n string) getter {
		if st := s.shards[n]; st != nil {
			return st
		}
		return nil
	})
	return s.shards[name], rec, err
}

type getter interface {
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
}

// locate finds the shard that holds key's record, reading (never writing):
// its old home first when the placement moved it (the truth until it
// hands over), then its home, following Moved records. It returns the
// shard's name with the record, or, when no shard holds one, the last
// shard read and an error wrapping ErrNotFound.
func locate(ctx context.Context, key etcdstore.Key, placement, previous *Placement, shard func(string) getter) (string, *etcdstore.Record, error) {
	names := []string{placement.place(key)}
	if previous != nil {
		if old := previous.place(key); old != names[0] {
			names = []string{old, names[0]}
		}
	}
	last := ""
	for hop := 0; hop < maxHops+1 && len(names) > 0; hop++ {
		st := shard(names[0])
		if st == nil {
			return "", nil, fmt.Errorf("%s moved to shard %q, which this process does not know: %w", key, names[0], etcdstore.ErrUnavailable)
		}
		last = names[0]
		rec, err := st.Get(ctx, key)
		switch {
		case errors.Is(err, etcdstore.ErrNotFound):
			names = names[1:]
			continue
		case err != nil:
			return "", nil, fmt.Errorf("shard %s: %w", names[0], err)
		case rec.State == etcdstore.Moved:
			names = []string{rec.MovedTo}
			continue
		}
		return names[0], rec, nil
	}
	return last, nil, fmt.Errorf("get %s: %w", key, etcdstore.ErrNotFound)
}

// Run is etcdstore.Store.Run on key's shard.
func (s *Store) Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (res etcdstore.Result, err error) {
	err = s.do(ctx, key, func(st *etcdstore.Store) error {
		res, err = st.Run(ctx, key, fp, work, opts...)
		return err
	})
	return res, err
}

// Do is etcdstore.Store.Do on key's shard.
func (s *Store) Do(ctx context.Context, key etcdstore.Key, params []byte, work etcdstore.Work, opts ...etcdstore.RunOption) (res etcdstore.Result, err error) {
	err = s.do(ctx, key, func(st *etcdstore.Store) error {
		res, err = st.Do(ctx, key, params, work, opts...)
		return err
	})
	return res, err
}

// Claim is etcdstore.Store.Claim on key's shard.
func (s *Store) Claim(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, opts ...etcdstore.ClaimOption) (c *etcdstore.Claim, done *etcdstore.Record, err error) {
	err = s.do(ctx, key, func(st *etcdstore.Store) error {
		c, done, err = st.Claim(ctx, key, fp, opts...)
		return err
	})
	return c, done, err
}

// Attach is etcdstore.Store.Attach on the shard that holds h's claim.
func (s *Store) Attach(ctx context.Context, h etcdstore.Handle) (*etcdstore.Claim, error) {
	st, _, err := s.readShard(ctx, h.Key)
	if err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
		return nil, err
	}
	if st == nil {
		return nil, fmt.Errorf("attach %s: %w", h.Key, etcdstore.ErrFenced)
	}
	return st.Attach(ctx, h)
}

// Get returns key's record from the shard that holds it.
func (s *Store) Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("get: %w", err)
	}
	_, rec, err := s.readShard(ctx, key)
	return rec, err
}

// Wait is etcdstore.Store.Wait on the shard that holds key (or, when none
// does, its home).
func (s *Store) Wait(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	for hop := 0; ; hop++ {
		st, _, err := s.readShard(ctx, key)
		if err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
			return nil, err
		}
		if st == nil {
			st = s.shards[s.placement.place(key)]
		}
		rec, err := st.Wait(ctx, key)
		if err != nil || rec.State != etcdstore.Moved || hop >= maxHops {
			return rec, err
		}
	}
}

// Evict deletes key's record on the shard that holds it.
func (s *Store) Evict(ctx context.Context, key etcdstore.Key) error {
	st, _, err := s.readShard(ctx, key)
	if err != nil {
		return err
	}
	return st.Evict(ctx, key)
}

// List lists tenant's records (every tenant's with tenant "") on every
// shard, leaving Moved records out, sorted by tenant and key: a page of
// at most o.Limit, which o.After resumes, as one store's List.
func (s *Store) List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error) {
	return list(ctx, s.names, func(n string) lister { return s.shards[n] }, tenant, o)
}

// Retention is the retention of every shard.
func (s *Store) Retention() time.Duration { return s.shards[s.names[0]].Retention() }

// MaxRecordSize is the record size limit of every shard.
func (s *Store) MaxRecordSize() int { return s.shards[s.names[0]].MaxRecordSize() }

// Metrics adds up the shards' metrics (etcdstore.Metrics.Add): Live while
// every shard has a session, Full while any etcd refuses writes for lack
// of space.
func (s *Store) Metrics() etcdstore.Metrics {
	var m etcdstore.Metrics
	for i, n := range s.names {
		if i == 0 {
			m = s.shards[n].Metrics()
			continue
		}
		m = m.Add(s.shards[n].Metrics())
	}
	return m
}

// CheckFull is etcdstore.Store.CheckFull over the shards: whether any
// still is full.
func (s *Store) CheckFull(ctx context.Context) (bool, error) {
	full := false
	var errs []error
	for _, st := range s.shards {
		f, err := st.CheckFull(ctx)
		full = full || f
		errs = append(errs, err)
	}
	return full, errors.Join(errs...)
}

// Owner names this process's session on each shard: "a=<id>,b=<id>".
func (s *Store) Owner() string {
	var parts []string
	for _, n := range s.names {
		parts = append(parts, n+"="+s.shards[n].Owner())
	}
	return strings.Join(parts, ",")
}

// Close closes every shard's store.
func (s *Store) Close() error {
	var errs []error
	for _, st := range s.shards {
		errs = append(errs, st.Close())
	}
	return errors.Join(errs...)
}
