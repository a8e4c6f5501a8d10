package shard_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemtest"
	"github.com/idem-dev/idem/shard"
)

var _ idem.Store = (*shard.Store)(nil)

var confSeq atomic.Int64

// openSet opens a shard set over the named clusters at generation gen.
func openSet(t *testing.T, prefix string, gen int64, placement []string, names ...string) *shard.Store {
	t.Helper()
	cfg := shard.Config{Placement: shard.Placement{Shards: placement}, Generation: gen, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond}
	for _, n := range names {
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: n, Client: shard.Clusters()[n].MustClient(t)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := shard.New(ctx, cfg, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func confPrefix(t *testing.T) string {
	return fmt.Sprintf("/conf/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), confSeq.Add(1))
}

// The store contract on a set of one shard, and of three.
func TestConformanceShards(t *testing.T) {
	for _, names := range [][]string{{"a"}, {"a", "b", "c"}} {
		t.Run(strconv.Itoa(len(names)), func(t *testing.T) {
			prefix := confPrefix(t)
			idemtest.TestStore(t, idemtest.Harness{
				Store: openSet(t, prefix, 1, names, names...),
				Other: openSet(t, prefix, 1, names, names...),
			})
		})
	}
}

// The store contract in the middle of a hand-over: shard b was added
// while a still holds a live record of a key b now places, so a is not
// drained and the set routes every key through its old home first.
func TestConformanceShardsDuringHandOver(t *testing.T) {
	prefix := confPrefix(t)
	gen1 := openSet(t, prefix, 1, []string{"a"}, "a", "b")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var held etcdstore.Key
	for i := 0; ; i++ {
		held = etcdstore.Key{ID: "held" + strconv.Itoa(i)}
		if (shard.Placement{Shards: []string{"a", "b"}}).Place(held) == "b" {
			break
		}
	}
	fp, err := etcdstore.FingerprintOf(nil)
	if err != nil {
		t.Fatal(err)
	}
	c, _, err := gen1.Claim(ctx, held, fp)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(context.Background())
	gen2 := openSet(t, prefix, 2, []string{"a", "b"}, "a", "b")
	for gen2.Status().InForce.Generation != 2 {
		if ctx.Err() != nil {
			t.Fatalf("generation 2 never went in force: %+v", gen2.Status())
		}
		time.Sleep(20 * time.Millisecond) // polling the set's view of etcd
	}
	idemtest.TestStore(t, idemtest.Harness{Store: gen2, Other: gen1})
	if st := gen2.Status(); st.InForce.Previous == nil || st.InForce.Settled {
		t.Fatalf("no hand-over in force after the suite (set %+v): the suite did not run during one", st.InForce)
	}
}
