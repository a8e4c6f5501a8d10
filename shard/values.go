package shard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Values placed by key: a small value that belongs to a key of the set
// (package jobs keeps a schedule's cursor so) is kept on the key's shard,
// under the name ValueName(key), and handed over when the set changes as
// the key's records are, by the same rules:
//
//   - While the set hands keys over, the value's old shard O is the truth
//     until it hands the value over: a process first records the set on O
//     (older processes, which write with the set they route by, are then
//     refused there), then copies O's value to the home H (a compare-and-
//     set over whatever H holds), then replaces O's value by a marker (a
//     compare-and-set on the revision it copied). Only the marker's write
//     decides: a copy whose marker did not land is overwritten by the
//     next one, and a process that finds O marked reads H. Under the set,
//     O's value changes only by a marker: so H holds exactly O's last
//     value once O is marked, whoever copied it, however the replies were
//     lost.
//   - The drain hands over every value of O placed elsewhere before it
//     marks O drained: once the set settles, no value is left behind.
//   - A marker at a value's home (left by an older set that placed it
//     elsewhere) reads as no value.
//
// Every write of a placed value is a compare-and-set on the shard that
// holds it, guarded by the set that shard records, and names that shard:
// a value read on one shard is never written on another.

// valuePrefix starts the names of placed values.
const valuePrefix = storex.PlacedPrefix

// ValueName is the name of key's placed value on its shard.
func ValueName(key etcdstore.Key) string { return storex.PlacedName(key) }

// valueKey is the key a placed value's name belongs to.
func valueKey(name string) (etcdstore.Key, bool) {
	rest, ok := strings.CutPrefix(name, valuePrefix)
	if !ok {
		return etcdstore.Key{}, false
	}
	tenant, id, ok := strings.Cut(rest, "/")
	if !ok || id == "" {
		return etcdstore.Key{}, false
	}
	return etcdstore.Key{Tenant: tenant, ID: id}, true
}

// movedMarker starts a marker: the value was handed over to another shard.
var movedMarker = []byte("\x00moved ")

func isMarker(v storex.Value) bool {
	return v.Revision != 0 && bytes.HasPrefix(v.Value, movedMarker)
}

// Placed is a placed value as read: on shard Shard, at Revision (0: none;
// a marker there reads as none, at its revision, to write over).
type Placed = storex.Placed

// GetValue reads key's placed value from the shard that holds it under the
// set in force, handing it over first if the set moves it.
func (s *Store) GetValue(ctx context.Context, key etcdstore.Key) (Placed, error) {
	var out Placed
	for reloaded := false; ; reloaded = true {
		// The set the read goes by, taken before it: one learnt while
		// it flies must count as newer. (Found by review: taken after,
		// a pause said "no such schedule".)
		before, _ := s.current()
		err := s.doValue(ctx, key, func(name string, st *etcdstore.Store, _ int64) error {
			v, err := storex.GetValue(st, ctx, ValueName(key))
			if err != nil {
				return err
			}
			out = placedOf(name, v)
			return nil
		})
		if err != nil || out.Exists || reloaded {
			return out, err
		}
		// None where the set this process knows places it (or a marker:
		// handed over under a newer set): a read teaches nothing of a
		// newer set; read the set every shard records, and look again if
		// it is newer.
		if now := s.reload(ctx); !now.after(before) {
			return out, nil
		}
	}
}

// SetValue writes key's placed value if it is still as read (at.Shard and
// at.Revision, from GetValue; a zero Placed: only if there is none, on the
// home), and reports whether it did; if it is not (it changed, or it was
// handed over to another shard since), it returns the value as it stands.
func (s *Store) SetValue(ctx context.Context, key etcdstore.Key, value []byte, at Placed) (Placed, bool, error) {
	if bytes.HasPrefix(value, movedMarker) {
		return Placed{}, false, fmt.Errorf("set value of %s: %w: a value may not start with a NUL byte", key, etcdstore.ErrInvalidArgument)
	}
	var out Placed
	var wrote bool
	err := s.doValue(ctx, key, func(name string, st *etcdstore.Store, setRev int64) error {
		vn := ValueName(key)
		if at.Shard != "" && at.Shard != name {
			// Handed over since it was read: as it stands.
			v, err := storex.GetValue(st, ctx, vn)
			if err != nil {
				return err
			}
			out, wrote = placedOf(name, v), false
			return nil
		}
		v, ok, err := storex.SetValue(st, ctx, vn, value, at.Revision, storex.ValueUnderShardSet(setRev))
		if err != nil {
			return err
		}
		if ok {
			out, wrote = Placed{Shard: name, Value: value, Revision: v.Revision, Exists: true}, true
			return nil
		}
		out, wrote = placedOf(name, v), false
		return nil
	})
	return out, wrote, err
}

func placedOf(shard string, v storex.Value) Placed {
	p := Placed{Shard: shard, Revision: v.Revision}
	if v.Revision != 0 && !isMarker(v) {
		p.Value, p.Exists = v.Value, true
	}
	return p
}

// doValue runs op on the shard that holds key's placed value under the set
// in force (with the set revision that shard records), once it has been
// handed over from the key's old shard if the set moves it; again when the
// set changed under it.
func (s *Store) doValue(ctx context.Context, key etcdstore.Key, op func(name string, st *etcdstore.Store, setRev int64) error) error {
	if err := key.Validate(); err != nil {
		return fmt.Errorf("placed value: %w", err)
	}
	var err error
	for try := 0; try < maxRoutes; try++ {
		var name string
		var rev int64
		if name, rev, err = s.routeValue(ctx, key); err == nil {
			err = op(name, s.store(name), rev)
		}
		if !errors.Is(err, storex.ErrSetChanged) {
			return err
		}
		s.refresh(ctx)
	}
	return fmt.Errorf("placed value of %s: %w: routed %d times: %w", key, etcdstore.ErrUnavailable, maxRoutes, err)
}

// routeValue returns the shard that holds key's placed value under the set
// in force, and the set's revision there, handing the value over from the
// key's old shard first while the set moves it.
func (s *Store) routeValue(ctx context.Context, key etcdstore.Key) (string, int64, error) {
	set, known := s.current()
	if !known {
		s.refresh(ctx)
		if set, known = s.current(); !known {
			return "", 0, fmt.Errorf("placed value of %s: %w: no shard set in force yet", key, etcdstore.ErrUnavailable)
		}
	}
	home := set.Placement.place(key)
	if p := set.handing(); p != nil {
		if old := p.place(key); old != home {
			if m, ok := s.markOf(old); !ok || m.Generation != set.Generation {
				if err := s.handValue(ctx, ValueName(key), old, home, set); err != nil {
					return "", 0, err
				}
			}
		}
	}
	rev, err := s.ensure(ctx, home, set)
	if err != nil {
		return "", 0, err
	}
	return home, rev, nil
}

// handValue hands the value name over from shard old to shard home under
// set: see "Values placed by key" above.
func (s *Store) handValue(ctx context.Context, name, old, home string, set Set) error {
	orev, err := s.ensure(ctx, old, set)
	if err != nil {
		return err
	}
	hrev, err := s.ensure(ctx, home, set)
	if err != nil {
		return err
	}
	ost, hst := s.store(old), s.store(home)
	for try := 0; try < maxRoutes; try++ {
		// The home first, then the old shard: a marker read after a
		// copy found at the home means that copy (or a later write) is
		// the value.
		hv, err := storex.GetValue(hst, ctx, name)
		if err != nil {
			return fmt.Errorf("shard %s: %w", home, err)
		}
		ov, err := storex.GetValue(ost, ctx, name)
		if err != nil {
			return fmt.Errorf("shard %s: %w", old, err)
		}
		if ov.Revision == 0 || isMarker(ov) {
			return nil // nothing there, or handed over
		}
		if _, ok, err := storex.SetValue(hst, ctx, name, ov.Value, hv.Revision, storex.ValueUnderShardSet(hrev)); err != nil {
			return fmt.Errorf("shard %s: %w", home, err)
		} else if !ok {
			continue
		}
		marker := append(append([]byte{}, movedMarker...), home...)
		if _, ok, err := storex.SetValue(ost, ctx, name, marker, ov.Revision, storex.ValueUnderShardSet(orev)); err != nil {
			return fmt.Errorf("shard %s: %w", old, err)
		} else if ok {
			s.log.Info("idem: placed value handed over", "value", name, "from", old, "to", home, "generation", set.Generation)
			return nil
		}
	}
	return fmt.Errorf("value %s: %w: it kept changing while handed over from shard %s", name, etcdstore.ErrUnavailable, old)
}

// drainValues hands over every value of shard name that set places
// elsewhere and its previous placement placed on name (the drain, before
// it marks the shard drained). Only there can the value be the truth: one
// the previous placement put elsewhere is a leftover (a shard restored
// from before an older move), never copied over its home. (Found by
// review: a restored shard's old value overwrote the home at the next,
// unrelated change.)
func (s *Store) drainValues(ctx context.Context, name string, set Set) error {
	prev := set.handing()
	if prev == nil {
		return nil
	}
	st := s.store(name)
	vals, err := storex.Values(st, ctx, valuePrefix)
	if err != nil {
		return err
	}
	for _, v := range vals {
		key, ok := valueKey(v.Name)
		if !ok || isMarker(v) {
			continue
		}
		if home := set.Placement.place(key); home != name && prev.place(key) == name {
			if err := s.handValue(ctx, v.Name, name, home, set); err != nil {
				return err
			}
		}
	}
	return nil
}
