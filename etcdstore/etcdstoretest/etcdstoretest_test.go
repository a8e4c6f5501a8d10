package etcdstoretest_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdstore/etcdstoretest"
	"github.com/idem-dev/idem/etcdtest"
)

// A unit test of code built on idem: one call for a store on real etcd.
func TestNew(t *testing.T) {
	store := etcdstoretest.New(t)
	ctx := context.Background()
	var charges atomic.Int32
	charge := func(context.Context, *etcdstore.Claim) ([]byte, error) { charges.Add(1); return []byte("ch_1"), nil }
	for range 3 {
		res, err := store.Do(ctx, etcdstore.Key{ID: "order-1"}, []byte(`{"amount":100}`), charge)
		if err != nil || string(res.Body) != "ch_1" {
			t.Fatalf("Do = %q, %v", res.Body, err)
		}
	}
	if charges.Load() != 1 {
		t.Fatalf("charged %d times; want once", charges.Load())
	}
}

// Stores on one shared cluster do not see each other's keys.
func TestNewOnSharesACluster(t *testing.T) {
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	a, b := etcdstoretest.NewOn(t, c), etcdstoretest.NewOn(t, c)
	ctx := context.Background()
	work := func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("a"), nil }
	if _, err := a.Do(ctx, etcdstore.Key{ID: "k"}, nil, work); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Get(ctx, etcdstore.Key{ID: "k"}); err == nil {
		t.Fatal("a store sees another's key")
	}
}
