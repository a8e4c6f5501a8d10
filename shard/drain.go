package shard

import (
	"context"
	"encoding/json"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/kernel"
	"github.com/idem-dev/idem/internal/storex"
)

// drainPage is how many records one read of a drain looks at.
const drainPage = 500

// drain looks at every shard the set in force hands keys over from, that
// is not known to be drained: one that holds no record of a key the set
// places elsewhere, but Moved records, is marked drained for the set's
// generation (with its epoch, read then), after which no process asks it
// about those keys again. Its values placed by key (ValueName) that the set
// places elsewhere are handed over first. A record that is no longer live (its retention
// passed Skew ago) is deleted first, if it is still the one listed
// (Store.EvictIf): a takeover of it read before, whose Txn is slow to
// arrive, then finds nothing to take. Under the set in force such a shard
// can never again hold such a record: it was given the set first (older
// processes are refused there), and a claim there takes only an existing
// record (WithoutCreate). Once every shard of the previous placement is
// drained, the set is settled (see settle).
func (s *Store) drain(ctx context.Context) {
	set, known := s.current()
	if !known || set.handing() == nil {
		return
	}
	all := true
	for _, name := range set.handing().names() {
		if ok, err := s.drainedFor(ctx, name, set.Generation); ok {
			continue
		} else if err != nil {
			all = false
			continue
		}
		if ok, err := s.drainOne(ctx, name, set); err != nil || !ok {
			all = false
			if err != nil {
				s.log.Warn("idem: draining a shard", "shard", name, "generation", set.Generation, "err", err)
			}
		}
	}
	if all {
		if err := s.settle(ctx, set); err != nil {
			s.log.Warn("idem: settling the shard set", "generation", set.Generation, "err", err)
		}
	}
}

// drainOne looks at shard name once, and marks it drained when it is.
func (s *Store) drainOne(ctx context.Context, name string, set Set) (bool, error) {
	if _, err := s.ensure(ctx, name, set); err != nil {
		return false, err
	}
	// Values placed by key go with their keys: none is left behind.
	if err := s.drainValues(ctx, name, set); err != nil {
		return false, err
	}
	st := s.store(name)
	var after *etcdstore.Key
	deleted := 0
	for {
		recs, err := st.List(ctx, "", etcdstore.ListOptions{Limit: drainPage, After: after, Live: true, Expired: true})
		if err != nil {
			return false, err
		}
		now := s.clk.Now()
		var stale []*etcdstore.Record
		for _, rec := range recs {
			switch {
			case set.Placement.place(rec.Key) == name:
			case kernel.Drainable(&kernel.Record{Expires: rec.Expires}, now, s.skew):
				stale = append(stale, rec)
			default:
				return false, nil // a live record of a key placed elsewhere: not yet
			}
		}
		for _, rec := range stale {
			gone, err := st.EvictIf(ctx, rec.Key, rec.Revision)
			if err != nil {
				return false, err
			}
			if !gone {
				return false, nil // written since it was listed: look again
			}
			deleted++
		}
		if len(recs) < drainPage {
			break
		}
		k := recs[len(recs)-1].Key
		after = &k
	}
	// Its epoch now bounds every token it gave those keys.
	if _, err := storex.LoadShardSet(st, ctx); err != nil {
		return false, err
	}
	cur, err := storex.GetValue(st, ctx, drainedValue)
	if err != nil {
		return false, err
	}
	if m, ok := parseMark(cur); ok && m.Generation >= set.Generation {
		s.noteMark(name, m)
		return m.Generation == set.Generation, nil
	}
	m := mark{Generation: set.Generation, Epoch: storex.Epoch(st)}
	b, _ := json.Marshal(m)
	if _, ok, err := storex.SetValue(st, ctx, drainedValue, b, cur.Revision); err != nil || !ok {
		return false, err // another process marked it: read next time
	}
	s.noteMark(name, m)
	s.log.Info("idem: shard drained", "shard", name, "generation", set.Generation, "stale_records_deleted", deleted)
	return true, nil
}
