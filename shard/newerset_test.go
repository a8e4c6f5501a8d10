package shard

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// A process whose store of a shard has learnt a newer shard set (a write
// of its refused there) while the process still routes by the older one
// is refused by ensure, adopts the newer set and routes again: it never
// writes under the newer set's guard at the shard the older set named.
// Here the key lives on c under generation 2 and on its old home under
// generation 1: the record must be made on c, where every process of
// generation 2 claims it, not on the old home, where a second owner would
// run it. (The window is the instant between the store learning the set
// and the router adopting it; the test holds it open by refusing a write
// made on the shard's store directly, beside the router.)
func TestRouteByAnOlderSetIsRefusedWhereANewerOneIsHeld(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	three, two := &Placement{Shards: []string{"a", "b", "c"}}, &Placement{Shards: []string{"a", "b"}}
	k := keyOn(*three, "c", 0)
	old := two.place(k)
	work := func(s string) etcdstore.Work {
		return func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte(s), nil }
	}
	// Generation 1's process, whose router looks at the sets only when
	// refused (its check is an hour away); generation 1 is on the old home.
	cfg := Config{Placement: *two, Generation: 1, Check: time.Hour, Skew: 100 * time.Millisecond}
	for i, n := range []string{"a", "b", "c"} {
		cfg.Shards = append(cfg.Shards, Shard{Name: n, Client: lossy(t, n, 0, uint64(200+i))})
	}
	gen1, err := New(ctx, cfg, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gen1.Close() })
	if _, err := gen1.Do(ctx, keyOn(*two, old, 1+idx(k)), nil, work("gen1")); err != nil {
		t.Fatal(err)
	}
	rev1 := storex.ShardSet(gen1.Shard(old)).Revision
	// Generation 2 takes over, and is written on the old home.
	gen2 := open(t, prefix, 2, []string{"a", "b", "c"}, nil, 0, 2, "a", "b", "c")
	inForce(t, gen2, 2)
	if _, err := gen2.Do(ctx, keyOn(*three, old, 1+idx(k)), nil, work("gen2")); err != nil {
		t.Fatal(err)
	}
	// A write under generation 1 on the old home's store, beside the
	// router: refused, and the store learns generation 2.
	fp, err := etcdstore.FingerprintOf([]byte("probe"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := gen1.Shard(old).Claim(ctx, etcdstore.Key{ID: "probe"}, fp, storex.UnderShardSet(rev1)); !errors.Is(err, storex.ErrSetChanged) {
		t.Fatalf("a claim under generation 1 on %s: %v; want ErrSetChanged", old, err)
	}
	if there, err := decodeSet(storex.ShardSet(gen1.Shard(old)).Value); err != nil || there.Generation != 2 {
		t.Fatalf("the old process's store of %s holds %+v, %v; want generation 2", old, there, err)
	}
	if set, ok := gen1.current(); !ok || set.Generation != 1 {
		t.Fatalf("the old process routes by generation %d; the test needs 1", set.Generation)
	}

	if _, err := gen1.Do(ctx, k, nil, work("once")); err != nil {
		t.Fatalf("the old process's claim of %s: %v", k, err)
	}
	switch rec, err := gen2.Shard(old).Get(ctx, k); {
	case err == nil && rec.State != etcdstore.Moved:
		t.Fatalf("%s was claimed on %s, its home under the older set, under the newer set's guard: %+v", k, old, rec)
	case err != nil && !errors.Is(err, etcdstore.ErrNotFound):
		t.Fatalf("reading %s on %s: %v", k, old, err)
	}
	rec, err := gen2.Shard("c").Get(ctx, k)
	if err != nil || string(rec.Outcome.Body) != "once" {
		t.Fatalf("%s on c, its home under generation 2: %v, %v; want the outcome", k, rec, err)
	}
}
