package shard

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// maxRoutes bounds how often one operation routes its key again (the set
// changed under it, or its old shard handed it over meanwhile).
const maxRoutes = 8

// target is where an operation on a key goes: a shard's store, and the
// claim options that say how it may claim there.
type target struct {
	name string
	st   *etcdstore.Store
	old  bool // the key's old shard, where it is claimed WithoutCreate
	opts []etcdstore.ClaimOption
}

// route returns the shard that may claim key under the set in force: its
// old shard while that one holds a live record of it (claimed there only
// while the record lives), its home otherwise, once the old shard wrote a
// Moved record (or was drained), with the home's epoch raised above the
// old shard's.
func (s *Store) route(ctx context.Context, key etcdstore.Key) (target, error) {
	set, known := s.current()
	if !known {
		s.refresh(ctx)
		if set, known = s.current(); !known {
			cur := s.Status().Pending
			return target{}, fmt.Errorf("route %s: %w: no shard set in force yet: %s", key, etcdstore.ErrUnavailable, cur)
		}
	}
	home := set.Placement.place(key)
	old := home
	if p := set.handing(); p != nil {
		old = p.place(key)
	}
	above := int64(-1) // the epoch the home's must exceed
	if old != home {
		if m, ok := s.markOf(old); ok && m.Generation == set.Generation {
			above = m.Epoch
		} else {
			rev, err := s.ensure(ctx, old, set)
			if err != nil {
				return target{}, err
			}
			under := storex.UnderShardSet(rev)
			rec, err := storex.Forward(s.store(old), ctx, key, home, under)
			if err != nil {
				return target{}, fmt.Errorf("hand %s over from shard %s: %w", key, old, err)
			}
			if rec.State != etcdstore.Moved {
				// It lives there: claimed under the previous placement.
				return target{name: old, st: s.store(old), old: true, opts: []etcdstore.ClaimOption{under, storex.WithoutCreate()}}, nil
			}
			above = rec.Epoch
		}
	}
	rev, err := s.ensure(ctx, home, set)
	if err != nil {
		return target{}, err
	}
	st := s.store(home)
	if above >= 0 && storex.Epoch(st) <= above {
		if _, err := storex.RaiseEpoch(st, ctx, above); err != nil {
			return target{}, fmt.Errorf("shard %s: %w", home, err)
		}
	}
	return target{name: home, st: st, opts: []etcdstore.ClaimOption{storex.UnderShardSet(rev), storex.ReplaceMoved()}}, nil
}

// do runs op on the shard that may claim key, routing again when the set
// changed under it or the key left its old shard meanwhile.
func (s *Store) do(ctx context.Context, key etcdstore.Key, op func(t target) error) error {
	var err error
	for try := 0; try < maxRoutes; try++ {
		var t target
		if t, err = s.route(ctx, key); err != nil {
			if errors.Is(err, storex.ErrSetChanged) {
				continue
			}
			return err
		}
		err = op(t)
		var me *storex.MovedError
		switch {
		case errors.Is(err, storex.ErrSetChanged):
			s.refresh(ctx)
		case t.old && (errors.Is(err, etcdstore.ErrNotFound) || errors.As(err, &me)):
			// Its record on the old shard ended, or was handed over, since
			// the route: route again.
		default:
			return err
		}
	}
	return fmt.Errorf("%s: %w: routed %d times: %w", key, etcdstore.ErrUnavailable, maxRoutes, err)
}

// Run is etcdstore.Store.Run on key's shard.
func (s *Store) Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (res etcdstore.Result, err error) {
	err = s.do(ctx, key, func(t target) error {
		res, err = t.st.Run(ctx, key, fp, work, append(runOpts(t), opts...)...)
		return err
	})
	return res, err
}

// Do is etcdstore.Store.Do on key's shard.
func (s *Store) Do(ctx context.Context, key etcdstore.Key, params []byte, work etcdstore.Work, opts ...etcdstore.RunOption) (res etcdstore.Result, err error) {
	err = s.do(ctx, key, func(t target) error {
		res, err = t.st.Do(ctx, key, params, work, append(runOpts(t), opts...)...)
		return err
	})
	return res, err
}

// Claim is etcdstore.Store.Claim on key's shard.
func (s *Store) Claim(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, opts ...etcdstore.ClaimOption) (c *etcdstore.Claim, done *etcdstore.Record, err error) {
	err = s.do(ctx, key, func(t target) error {
		c, done, err = t.st.Claim(ctx, key, fp, append(append([]etcdstore.ClaimOption{}, t.opts...), opts...)...)
		return err
	})
	return c, done, err
}

func runOpts(t target) []etcdstore.RunOption {
	out := make([]etcdstore.RunOption, len(t.opts))
	for i, o := range t.opts {
		out[i] = o
	}
	return out
}

// locate finds the shard that holds key's record under the set in force,
// reading (never writing): its old shard first when the set moved it (the
// truth until it hands over, unless drained), then its home. It returns
// the shard's name with the record, or, when neither holds a live one,
// the home and an error wrapping ErrNotFound.
func locate(ctx context.Context, key etcdstore.Key, set Set, drained func(string) bool, shard func(string) (getter, error)) (string, *etcdstore.Record, error) {
	home := set.Placement.place(key)
	names := []string{home}
	if p := set.handing(); p != nil {
		if old := p.place(key); old != home && !drained(old) {
			names = []string{old, home}
		}
	}
	for _, n := range names {
		st, err := shard(n)
		if err != nil {
			return "", nil, err
		}
		rec, err := st.Get(ctx, key)
		switch {
		case errors.Is(err, etcdstore.ErrNotFound):
			continue
		case err != nil:
			return "", nil, fmt.Errorf("shard %s: %w", n, err)
		case rec.State == etcdstore.Moved:
			// On the old shard: handed over to the home. On the home:
			// left by an older set.
			continue
		}
		return n, rec, nil
	}
	return home, nil, fmt.Errorf("get %s: %w", key, etcdstore.ErrNotFound)
}

type getter interface {
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
}

// readShard returns the shard that holds key's record (or would), without
// writing: a read never hands a key over.
func (s *Store) readShard(ctx context.Context, key etcdstore.Key) (*etcdstore.Store, *etcdstore.Record, error) {
	set, known := s.current()
	if !known {
		return nil, nil, fmt.Errorf("get %s: %w: no shard set in force yet", key, etcdstore.ErrUnavailable)
	}
	st, rec, err := s.readUnder(ctx, key, set)
	if errors.Is(err, etcdstore.ErrNotFound) {
		// A read teaches nothing of a newer set (only a refused write
		// does): a process that has not learnt one yet looks where the
		// key no longer is. Read the set every shard records, and look
		// again if it is newer. (Found by review: a job submitted under
		// a new set was not found, and its event refused, by a process
		// that had not learnt the set.)
		if now := s.reload(ctx); now.after(set) {
			return s.readUnder(ctx, key, now)
		}
	}
	return st, rec, err
}

// reload reads the set every connected shard records, and returns the
// set in force then: in the caller's goroutine, one shard after the
// other, each within 2 s (a shard that hangs delays the others by that
// much, and does not stop them from being asked).
func (s *Store) reload(ctx context.Context) Set {
	for _, n := range s.names {
		if st := s.store(n); st != nil {
			tctx, cancel := s.clk.WithTimeout(ctx, reloadTimeout)
			storex.LoadShardSet(st, tctx)
			cancel()
		}
	}
	s.learn()
	set, _ := s.current()
	return set
}

// reloadTimeout bounds the read of one shard's set by reload.
const reloadTimeout = 2 * time.Second

// readUnder is readShard under set.
func (s *Store) readUnder(ctx context.Context, key etcdstore.Key, set Set) (*etcdstore.Store, *etcdstore.Record, error) {
	name, rec, err := locate(ctx, key, set, func(n string) bool {
		m, ok := s.markOf(n)
		return ok && m.Generation == set.Generation
	}, func(n string) (getter, error) {
		if st := s.store(n); st != nil {
			return st, nil
		}
		return nil, s.unreachable(n)
	})
	if name == "" {
		return nil, rec, err
	}
	return s.store(name), rec, err
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
	for try := 0; ; try++ {
		st, _, err := s.readShard(ctx, key)
		if err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
			return nil, err
		}
		if st == nil {
			return nil, s.unreachable(s.Place(key))
		}
		rec, err := st.Wait(ctx, key)
		if err != nil || rec.State != etcdstore.Moved || try >= maxRoutes {
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
// connected shard, leaving Moved records out, sorted by tenant and key: a
// page of at most o.Limit, which o.After resumes, as one store's List.
func (s *Store) List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error) {
	return list(ctx, s.names, func(n string) (lister, error) {
		if st := s.store(n); st != nil {
			return st, nil
		}
		return nil, s.unreachable(n)
	}, tenant, o)
}
