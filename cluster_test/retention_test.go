package cluster_test

import (
	"context"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

// Retention holds across a leader change. A new leader resets every lease
// to its full TTL unless it was checkpointed (etcd checkpoints every 5
// minutes, so short leases never are): the bucket lease fires late. The key
// must be a new operation once its retention has passed anyway, because
// every read honours the record's own expiry.
func TestRetentionAcrossLeaderChange(t *testing.T) {
	if testing.Short() {
		t.Skip("fault scenarios skipped in -short mode")
	}
	e := newEnv(t, 3, etcdtest.Options{})
	cli := e.cluster.MustClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(e.prefix), etcdstore.WithSessionTTL(sessionTTL),
		etcdstore.WithRetention(3*time.Second), etcdstore.WithBucketWidth(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	key := etcdstore.Key{ID: "retained"}
	runs := 0
	work := func(context.Context, *etcdstore.Claim) ([]byte, error) { runs++; return []byte("ok"), nil }
	if _, err := store.Do(ctx, key, nil, work); err != nil {
		t.Fatal(err)
	}
	rec, err := store.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	old, err := e.cluster.WaitLeader(ctx, e.cluster.All())
	if err != nil {
		t.Fatal(err)
	}
	e.cluster.Members[old].Kill()
	newLeader, err := e.cluster.WaitLeader(ctx, others(3, old), old)
	if err != nil || newLeader == old {
		t.Fatalf("INVALID: the leader did not change: %v", err)
	}
	if err := e.cluster.Members[old].Restart(ctx); err != nil {
		t.Fatal(err)
	}
	// Let the retention pass (time itself is what this test is about).
	time.Sleep(time.Until(rec.Expires) + 100*time.Millisecond)
	raw, err := cli.Get(ctx, e.prefix+"k/default/retained", clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("retention passed; the record's lease has %s", map[bool]string{true: "not fired yet (reset by the new leader)", false: "fired"}[raw.Count > 0])
	if _, err := store.Get(ctx, key); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("Get after retention = %v; want ErrNotFound whatever the lease", err)
	}
	res, err := store.Do(ctx, key, nil, work)
	if err != nil || res.Replayed || runs != 2 {
		t.Fatalf("Do after retention = %+v, %v (runs %d); want a new operation", res, err, runs)
	}
}
