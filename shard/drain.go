package shard

import (
	"context"
	"encoding/json"

	"github.com/idem-dev/idem/etcdstore"
)

// drainPage is how many records one read of a drain looks at.
const drainPage = 500

// drain looks at every shard the set in force hands keys over from, that
// is not known to be drained: one that holds no live record of a key the
// set places elsewhere is marked drained for the set's generation (with
// its epoch, read then), after which no process asks it about those keys
// again. Under the set in force such a shard can never again hold such a
// record: it was given the set first (older processes are refused there),
// and a claim there takes only a record that is live (WithoutCreate).
func (s *Store) drain(ctx context.Context) {
	set, known := s.current()
	if !known || set.Previous == nil {
		return
	}
	for _, name := range set.Previous.names() {
		if ok, err := s.drainedFor(ctx, name, set.Generation); ok || err != nil {
			continue
		}
		if err := s.drainOne(ctx, name, set); err != nil {
			s.log.Warn("idem: draining a shard", "shard", name, "generation", set.Generation, "err", err)
		}
	}
}

// drainOne looks at shard name once, and marks it drained when it is.
func (s *Store) drainOne(ctx context.Context, name string, set Set) error {
	if _, err := s.ensure(ctx, name, set); err != nil {
		return err
	}
	st := s.store(name)
	var after *etcdstore.Key
	for {
		recs, err := st.List(ctx, "", etcdstore.ListOptions{Limit: drainPage, After: after, Live: true, Skew: s.skew})
		if err != nil {
			return err
		}
		for _, rec := range recs {
			if set.Placement.place(rec.Key) != name {
				return nil // a live record of a key placed elsewhere: not yet
			}
		}
		if len(recs) < drainPage {
			break
		}
		k := recs[len(recs)-1].Key
		after = &k
	}
	// Its epoch now bounds every token it gave those keys.
	if _, err := st.LoadShardSet(ctx); err != nil {
		return err
	}
	cur, err := st.Value(ctx, drainedValue)
	if err != nil {
		return err
	}
	if m, ok := parseMark(cur); ok && m.Generation >= set.Generation {
		s.noteMark(name, m)
		return nil
	}
	m := mark{Generation: set.Generation, Epoch: st.Epoch()}
	b, _ := json.Marshal(m)
	if _, ok, err := st.SetValue(ctx, drainedValue, b, cur.Revision); err != nil || !ok {
		return err // another process marked it: read next time
	}
	s.noteMark(name, m)
	s.log.Info("idem: shard drained", "shard", name, "generation", set.Generation)
	return nil
}
