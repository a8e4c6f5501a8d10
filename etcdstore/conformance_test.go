package etcdstore_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/idemtest"
)

var confSeq atomic.Int64

func confStore(t *testing.T, cli *clientv3.Client, prefix string, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.New(ctx, cli, append([]etcdstore.Option{etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func confPrefix(t *testing.T) string {
	return fmt.Sprintf("/conf/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), confSeq.Add(1))
}

// The store contract, on one member: a store, and a second one over the
// same records (another process).
func TestConformanceOneMember(t *testing.T) {
	c := etcdstore.SingleCluster()
	prefix := confPrefix(t)
	idemtest.TestStore(t, idemtest.Harness{
		Store: confStore(t, c.MustClient(t), prefix),
		Other: confStore(t, c.MustClient(t), prefix),
	})
}

// The store contract on three members, with the second store reading
// first from a follower that is cut off from the others but has not yet
// noticed (its election timeout is 5 s): it still believes in its leader,
// and would serve a serializable read of what was deleted since.
func TestConformanceThreeMembersOneHeldBehind(t *testing.T) {
	dir, err := os.MkdirTemp("", "idem-conformance-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c, err := etcdtest.New(dir, 3, etcdtest.Options{Proxies: true, ElectionMs: 5000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	leader, err := c.WaitLeader(ctx, c.All())
	if err != nil {
		t.Fatal(err)
	}
	f := (leader + 1) % 3 // a follower
	var rest []string
	for i, m := range c.Members {
		if i != f {
			rest = append(rest, m.ClientURL)
		}
	}
	prefix := confPrefix(t)
	behind := c.MustClient(t, c.Members[f].ClientURL)
	idemtest.TestStore(t, idemtest.Harness{
		Store: confStore(t, c.MustClient(t, rest...), prefix),
		// Reading first, as a store where retries are frequent does.
		Other: confStore(t, behind, prefix, etcdstore.WithClaimPath(etcdstore.ClaimPathReadFirst)),
		Behind: func(ctx context.Context) (func() error, error) {
			if err := c.Isolate(f); err != nil {
				return nil, err
			}
			return func() error {
				c.Heal()
				// Caught up once a linearizable read through it answers.
				for {
					rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
					_, err := behind.Get(rctx, "/conf-catch-up")
					cancel()
					if err == nil || ctx.Err() != nil {
						return err
					}
				}
			}, nil
		},
	})
}
