package shard

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Values placed by key move with their keys: a set adds shard b; a value
// read or written through a process of the new set is handed over at
// once (a copy on b, a marker on a), the values nobody touched are handed
// over by the drain before the set settles, a process still on the old
// set cannot write where the value no longer is, and a third set that
// takes the change back brings every value back to a, each as last
// written. Txns lose a tenth of their replies.
func TestPlacedValuesMoveWithTheirKeys(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	old := open(t, prefix, 1, []string{"a"}, nil, 0.1, 21, "a", "b")
	inForce(t, old, 1)
	next := Placement{Shards: []string{"a", "b"}}
	var keys []etcdstore.Key
	for i := 0; len(keys) < 12; i++ {
		if k := (etcdstore.Key{Tenant: "jobs", ID: "schedule.s" + strconv.Itoa(i)}); next.Place(k) == "b" {
			keys = append(keys, k)
		}
	}
	want := map[string]string{}
	set := func(s *Store, k etcdstore.Key, v string) {
		t.Helper()
		for try := 0; ; try++ {
			at, err := s.GetValue(ctx, k)
			if err == nil {
				var ok bool
				if _, ok, err = s.SetValue(ctx, k, []byte(v), at); err == nil && ok {
					want[k.ID] = v
					return
				}
			}
			if try == 20 {
				t.Fatalf("set %s: %v", k, err)
			}
		}
	}
	for _, k := range keys {
		set(old, k, "v1 "+k.ID)
	}
	// The old process keeps its view of a key it read under the old set.
	stale, err := old.GetValue(ctx, keys[0])
	if err != nil || stale.Shard != "a" {
		t.Fatalf("under the old set: %+v, %v; want it on a", stale, err)
	}
	s := open(t, prefix, 2, []string{"a", "b"}, []string{"a"}, 0.1, 22, "a", "b")
	inForce(t, s, 2)
	// The first half read or written through the new set: handed over.
	for i, k := range keys[:6] {
		if i%2 == 0 {
			set(s, k, "v2 "+k.ID)
			continue
		}
		got, err := s.GetValue(ctx, k)
		if err != nil || !got.Exists || got.Shard != "b" || string(got.Value) != want[k.ID] {
			t.Fatalf("%s through the new set: %+v, %v; want %q on b", k, got, err, want[k.ID])
		}
	}
	// The old process writes what it read on a: refused there, and it
	// learns where the value is.
	// (Its Txns lose their reply at random: a write whose outcome is
	// unknown is sent again, as the store's doc says; a refused one stays
	// refused.)
	got, ok, err := old.SetValue(ctx, keys[0], []byte("lost"), stale)
	for try := 0; errors.Is(err, etcdstore.ErrUnavailable) && try < 20; try++ {
		got, ok, err = old.SetValue(ctx, keys[0], []byte("lost"), stale)
	}
	if err != nil || ok || got.Shard != "b" || string(got.Value) != want[keys[0].ID] {
		t.Fatalf("a stale write of %s = %+v, %v, %v; want refused, the value on b", keys[0], got, ok, err)
	}
	// The rest, nobody touched: the drain hands them over before the set
	// settles.
	waitFor(t, func() bool { in := s.Status().InForce; return in.Generation == 2 && in.Settled })
	for _, k := range keys {
		a, err := storex.GetValue(s.Shard("a"), ctx, ValueName(k))
		if err != nil || a.Revision != 0 && !isMarker(a) {
			t.Fatalf("%s on a after the set settled: %+v, %v; want a marker", k, a, err)
		}
		b, err := storex.GetValue(s.Shard("b"), ctx, ValueName(k))
		if err != nil || string(b.Value) != want[k.ID] {
			t.Fatalf("%s on b after the set settled: %q, %v; want %q", k, b.Value, err, want[k.ID])
		}
	}
	// Generation 3 takes the change back: every value back on a.
	back := open(t, prefix, 3, []string{"a"}, []string{"a", "b"}, 0.1, 23, "a", "b")
	inForce(t, back, 3)
	for i, k := range keys {
		if i%3 == 0 {
			set(back, k, "v3 "+k.ID)
		}
	}
	waitFor(t, func() bool { in := back.Status().InForce; return in.Generation == 3 && in.Settled })
	for _, k := range keys {
		got, err := back.GetValue(ctx, k)
		if err != nil || got.Shard != "a" || string(got.Value) != want[k.ID] {
			t.Fatalf("%s after the change was taken back: %+v, %v; want %q on a", k, got, err, want[k.ID])
		}
		if b, err := storex.GetValue(back.Shard("b"), ctx, ValueName(k)); err != nil || b.Revision != 0 && !isMarker(b) {
			t.Fatalf("%s on b after it went back: %+v, %v; want a marker", k, b, err)
		}
	}
	if _, _, err := back.SetValue(ctx, keys[0], []byte("\x00moved x"), Placed{}); err == nil {
		t.Fatal("a value that looks like a marker was written")
	}
}

// waitFor polls cond (a process's view of etcd) for up to 30 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition never held")
		}
	}
}
