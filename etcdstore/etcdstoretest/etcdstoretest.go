// Package etcdstoretest gives a test an etcdstore.Store on a real embedded
// etcd in one call, for unit tests of code built on idem that do not need a
// cluster of several members (package etcdtest has those, with faults).
//
//	store := etcdstoretest.New(t)
//	res, err := store.Do(ctx, etcdstore.Key{ID: "order-1"}, params, work)
package etcdstoretest

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

// New returns a store on a single-member embedded etcd started for this
// test (about half a second), both closed when the test ends. The store's
// session TTL is 2 s (etcd's shortest), so that a test that ends a session
// sees its claims taken over quickly; opts come after and may change it.
func New(t testing.TB, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	return NewOn(t, etcdtest.Start(t, 1, etcdtest.Options{}), opts...)
}

// NewOn returns a store on cluster c under a key prefix no other store of
// this process uses (tests sharing a cluster, as with etcdtest.Main, do not
// see each other's keys), closed when the test ends. Each call is a process
// of its own as far as sessions go: two stores of one test contend as two
// services would.
func NewOn(t testing.TB, c *etcdtest.Cluster, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	prefix := fmt.Sprintf("/etcdstoretest/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), seq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	all := append([]etcdstore.Option{etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(2 * time.Second)}, opts...)
	s, err := etcdstore.New(ctx, c.MustClient(t), all...)
	if err != nil {
		t.Fatalf("etcdstoretest: new store: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

var seq atomic.Int64
