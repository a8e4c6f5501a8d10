package shard

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Set is a shard set: the placement keys go by, the generation that orders
// it among the sets a deployment goes through, and, while keys are handed
// over from it, the placement it replaced.
type Set struct {
	Generation int64      `json:"generation"`
	Placement  Placement  `json:"placement"`
	Previous   *Placement `json:"previous,omitempty"`
	// Floor is an epoch every shard's is raised above before it claims
	// under this set: the greatest epoch of the shards when it was
	// installed. A key whose record ended on one shard and that is
	// claimed again, sets later, on another (never handed over: nobody
	// asked for it meanwhile) so still gets greater tokens.
	Floor int64 `json:"floor,omitempty"`
	// Settled is set once every shard of Previous was drained: the
	// hand-over is over, no process asks the old shards again, and the
	// next change needs none of them (a retired shard may be removed from
	// the configuration). Previous stays, for the arbiter. A settled set
	// comes after the same set unsettled, and its Floor is above every
	// drain mark's epoch.
	Settled bool `json:"settled,omitempty"`
}

// handing returns the placement keys are handed over from, or nil when
// none is (no previous placement, or the hand-over is settled).
func (s Set) handing() *Placement {
	if s.Settled {
		return nil
	}
	return s.Previous
}

// after reports whether s comes after o: a newer generation, or o itself
// settled.
func (s Set) after(o Set) bool {
	if s.Generation != o.Generation {
		return s.Generation > o.Generation
	}
	if !s.Settled || o.Settled {
		return false
	}
	u := s
	u.Settled, u.Floor = false, o.Floor
	return u.same(o)
}

// drainedValue is the name of the Value in which a shard says it was
// drained for a generation: it holds no live record of a key that
// generation's placement puts elsewhere.
const drainedValue = "shard/drained"

// mark is a shard's drain mark: the generation it was drained for, and
// its epoch then (every token it handed out for keys placed elsewhere is
// below epoch+1).
type mark struct {
	Generation int64 `json:"generation"`
	Epoch      int64 `json:"epoch"`
}

// encode lays s out canonically: shard names sorted, so that two processes
// that mean the same set write the same bytes.
func (s Set) encode() []byte {
	c := s
	c.Placement = c.Placement.canonical()
	if c.Previous != nil {
		p := c.Previous.canonical()
		c.Previous = &p
	}
	b, _ := json.Marshal(c) // plain values: cannot fail
	return b
}

func (p Placement) canonical() Placement {
	c := Placement{Shards: slices.Clone(p.Shards)}
	sort.Strings(c.Shards)
	if len(p.Pin) > 0 {
		c.Pin = p.Pin
	}
	return c
}

func decodeSet(b []byte) (Set, error) {
	var s Set
	if err := json.Unmarshal(b, &s); err != nil {
		return Set{}, fmt.Errorf("%w: shard set %q: %v", etcdstore.ErrCorrupt, b, err)
	}
	if s.Generation < 1 || len(s.Placement.Shards) == 0 {
		return Set{}, fmt.Errorf("%w: shard set %q: no generation or no shards", etcdstore.ErrCorrupt, b)
	}
	return s, nil
}

func (s Set) same(o Set) bool { return bytes.Equal(s.encode(), o.encode()) }

// names returns every shard p places keys on: its shards and its pins'.
func (p Placement) names() []string {
	out := slices.Clone(p.Shards)
	for _, n := range p.Pin {
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

// names returns every shard s names (the previous placement's only while
// keys are handed over from it).
func (s Set) names() []string {
	out := s.Placement.names()
	if p := s.handing(); p != nil {
		for _, n := range p.names() {
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
		sort.Strings(out)
	}
	return out
}

// arbiter is the shard on which a change over s is decided: the first
// shard, by name, of s's placement that was in its previous placement too
// (a shard that did not just arrive, so that a set that added a broken
// shard can be rolled back), or of its placement when there is no
// previous one. Every change over s is a compare-and-set there, so that
// two processes can never put two different sets after s in force.
func (s Set) arbiter() string {
	cands := s.Placement.canonical().Shards
	if s.Previous != nil {
		var both []string
		for _, n := range cands {
			if slices.Contains(s.Previous.Shards, n) {
				both = append(both, n)
			}
		}
		if len(both) > 0 {
			cands = both
		}
	}
	return cands[0]
}

// next returns the set that puts p in force after s, or why it cannot be
// installed yet: a change is safe once every shard s hands keys over from
// was drained for s's generation (it holds no live record of a key placed
// elsewhere), or at once when it takes s back (p is s's previous
// placement: every live record is where one of the two placements puts
// it). drained reports a shard's mark.
func (s Set) next(gen int64, p Placement, drained func(string) (bool, error)) (Set, error) {
	n := Set{Generation: gen, Placement: p, Previous: &s.Placement}
	if h := s.handing(); h != nil && !p.equal(*h) {
		for _, name := range h.names() {
			ok, err := drained(name)
			if err != nil {
				return Set{}, fmt.Errorf("generation %d: shard %s: %w", s.Generation, name, err)
			}
			if !ok {
				return Set{}, fmt.Errorf("%w: generation %d still hands keys over from shard %s: the change waits until it is drained", errPending, s.Generation, name)
			}
		}
	}
	if n.Previous.equal(p) {
		n.Previous = nil
	}
	return n, nil
}

// errPending says a shard set asked for cannot be installed yet.
var errPending = errors.New("not yet")

func (p Placement) equal(o Placement) bool {
	a, b := p.canonical(), o.canonical()
	if !slices.Equal(a.Shards, b.Shards) || len(a.Pin) != len(b.Pin) {
		return false
	}
	for k, v := range a.Pin {
		if b.Pin[k] != v {
			return false
		}
	}
	return true
}

// install puts want in force, or learns the set in force that is newer:
// with a compare-and-set on the arbiter of the set in force (of want
// itself when none is in force yet). It returns the set in force after
// it, and errPending (wrapped) when want cannot be installed yet.
//
// A first set (no set in force known) is installed only when every
// configured shard answers and records none: a shard that does not answer
// may hold the set in force, and placing keys afresh without it would
// claim again keys it holds.
func (s *Store) install(ctx context.Context, want Set) (Set, error) {
	for try := 0; try < 8; try++ {
		cur, known := s.current()
		target := want
		arb := want.arbiter()
		names := want.names()
		if known {
			if cur.Generation >= want.Generation {
				return cur, nil
			}
			var err error
			if target, err = cur.next(want.Generation, want.Placement, func(n string) (bool, error) { return s.drainedFor(ctx, n, cur.Generation) }); err != nil {
				return cur, err
			}
			arb, names = cur.arbiter(), cur.names()
			target.Floor = cur.Floor
		} else {
			found := false
			for _, n := range s.names {
				st := s.store(n)
				if st == nil {
					return cur, fmt.Errorf("%w: no shard set in force is known, and shard %s does not answer: a first set is installed only when every shard answers and records none", errPending, n)
				}
				v, err := storex.LoadShardSet(st, ctx)
				if err != nil {
					return cur, fmt.Errorf("shard %s: %w", n, err)
				}
				if v.Revision != 0 {
					there, err := decodeSet(v.Value)
					if err != nil {
						return cur, fmt.Errorf("shard %s: %w", n, err)
					}
					s.adopt(there)
					found = true
				}
			}
			if found {
				continue // decide against the set in force
			}
		}
		// The floor: the greatest epoch of the shards the set in force
		// (or, first, this one) names.
		for _, n := range names {
			st := s.store(n)
			if st == nil {
				return cur, fmt.Errorf("%w: shard %s does not answer, and its epoch is needed for the change", errPending, n)
			}
			if _, err := storex.LoadShardSet(st, ctx); err != nil {
				return cur, fmt.Errorf("shard %s: %w", n, err)
			}
			target.Floor = max(target.Floor, storex.Epoch(st))
		}
		st := s.store(arb)
		if st == nil {
			return cur, fmt.Errorf("%w: the change is decided on shard %s, which does not answer", errPending, arb)
		}
		v := storex.ShardSet(st)
		if v.Revision != 0 {
			there, err := decodeSet(v.Value)
			if err != nil {
				return cur, err
			}
			if !known || there.after(cur) {
				s.adopt(there)
				continue // decide again against it
			}
		}
		got, ok, err := storex.SetValue(st, ctx, storex.ShardSetValue, target.encode(), v.Revision)
		if err != nil {
			return cur, fmt.Errorf("shard %s: %w", arb, err)
		}
		if ok {
			s.adopt(target)
			s.log.Info("idem: shard set installed", "generation", target.Generation, "shard", arb)
			s.spread(ctx, target, arb)
			return target, nil
		}
		if got.Revision != 0 {
			there, err := decodeSet(got.Value)
			if err != nil {
				return cur, err
			}
			s.adopt(there)
		}
	}
	cur, _ := s.current()
	return cur, fmt.Errorf("%w: the shard set kept changing", etcdstore.ErrUnavailable)
}

// spread writes set, just put in force on shard arb, on every other shard
// it names that answers, so that a process that starts while the arbiter
// does not answer still learns it. Best effort: every write on a shard
// gives it the set first anyway (ensure).
func (s *Store) spread(ctx context.Context, set Set, arb string) {
	for _, n := range set.names() {
		if n == arb || s.store(n) == nil {
			continue
		}
		if _, err := s.ensure(ctx, n, set); err != nil {
			s.log.Debug("idem: shard set not yet written", "shard", n, "err", err)
		}
	}
}

// settle ends the hand-over of set once every shard of its previous
// placement is drained: it puts set, settled, in force (a compare-and-set
// on its arbiter), with a floor above every drain mark's epoch.
func (s *Store) settle(ctx context.Context, set Set) error {
	target := set
	target.Settled = true
	for _, n := range set.handing().names() {
		m, ok := s.markOf(n)
		if !ok || m.Generation != set.Generation {
			return nil // not drained yet
		}
		target.Floor = max(target.Floor, m.Epoch)
	}
	arb := set.arbiter()
	st := s.store(arb)
	if st == nil {
		return s.unreachable(arb)
	}
	v, err := storex.LoadShardSet(st, ctx)
	if err != nil {
		return fmt.Errorf("shard %s: %w", arb, err)
	}
	if v.Revision != 0 {
		there, err := decodeSet(v.Value)
		if err != nil {
			return fmt.Errorf("shard %s: %w", arb, err)
		}
		if !there.same(set) {
			s.adopt(there) // settled, or changed, meanwhile
			return nil
		}
	}
	got, ok, err := storex.SetValue(st, ctx, storex.ShardSetValue, target.encode(), v.Revision)
	if err != nil {
		return fmt.Errorf("shard %s: %w", arb, err)
	}
	if !ok {
		if got.Revision != 0 {
			if there, err := decodeSet(got.Value); err == nil {
				s.adopt(there)
			}
		}
		return nil
	}
	s.adopt(target)
	s.log.Info("idem: shard hand-over settled", "generation", set.Generation, "floor", target.Floor)
	s.spread(ctx, target, arb)
	return nil
}

// ensure makes shard name hold set before a guarded write there: a shard
// still on an older set is given this one (a compare-and-set, so that
// processes of that older set are refused there from then on); one on a
// newer set makes this process adopt it (ErrSetChanged: route again). It
// returns the revision of set's record on the shard, for the guarded
// write to compare (etcdstore.UnderShardSet): the store may learn of a
// newer set meanwhile, and the write must then be refused.
func (s *Store) ensure(ctx context.Context, name string, set Set) (int64, error) {
	st := s.store(name)
	if st == nil {
		return 0, s.unreachable(name)
	}
	for try := 0; try < 8; try++ {
		v := storex.ShardSet(st)
		if v.Revision != 0 {
			there, err := decodeSet(v.Value)
			if err != nil {
				return 0, fmt.Errorf("shard %s: %w", name, err)
			}
			switch {
			case there.same(set):
				if storex.Epoch(st) <= set.Floor {
					if _, err := storex.RaiseEpoch(st, ctx, set.Floor); err != nil {
						return 0, fmt.Errorf("shard %s: %w", name, err)
					}
				}
				return v.Revision, nil
			case there.after(set):
				s.adopt(there)
				return 0, fmt.Errorf("shard %s: %w", name, storex.ErrSetChanged)
			case set.after(there):
				// Older there (or the same set, not settled there yet):
				// written below.
			default:
				return 0, fmt.Errorf("shard %s: %w: two shard sets of generation %d", name, etcdstore.ErrUnavailable, set.Generation)
			}
		}
		if _, _, err := storex.SetValue(st, ctx, storex.ShardSetValue, set.encode(), v.Revision); err != nil {
			return 0, fmt.Errorf("shard %s: %w", name, err)
		}
	}
	return 0, fmt.Errorf("shard %s: %w: its shard set kept changing", name, etcdstore.ErrUnavailable)
}

// drainedFor reports whether shard name was drained for generation gen:
// from this process's marks, or read from the shard.
func (s *Store) drainedFor(ctx context.Context, name string, gen int64) (bool, error) {
	if m, ok := s.markOf(name); ok && m.Generation == gen {
		return true, nil
	}
	st := s.store(name)
	if st == nil {
		return false, s.unreachable(name)
	}
	v, err := storex.GetValue(st, ctx, drainedValue)
	if err != nil {
		return false, err
	}
	m, ok := parseMark(v)
	if ok {
		s.noteMark(name, m)
	}
	return ok && m.Generation == gen, nil
}

func parseMark(v storex.Value) (mark, bool) {
	var m mark
	if v.Revision == 0 || json.Unmarshal(v.Value, &m) != nil {
		return mark{}, false
	}
	return m, true
}
