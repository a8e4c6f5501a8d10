package etcdmodel

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/internal/kernel"
)

// TestExpiry lets a real lease run out and checks that the model's Expire
// leaves the same state at the same revision: its keys deleted in one
// revision, the others kept, the lease gone. It waits on a watch of the
// deletes, not on a clock. The member's minimum TTL is 1 s; the lease gets
// 2 s so the puts surely land before it expires, and etcd's lessor looks
// for expired leases every 500 ms: about 2.5 s in all.
func TestExpiry(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a lease to expire")
	}
	const prefix = "/x/"
	p := newPair(t, prefix)
	wctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	events := p.e.cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(p.m.Rev()+1))
	id, err := p.grant(2)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	tx := &kernel.Txn{Then: []kernel.Op{putOn(prefix+"a", "1", id), putOn(prefix+"b", "2", id), put(prefix+"c", "3")}}
	if err := p.txn(tx); err != nil {
		t.Fatal(err)
	}
	deleted := map[string]int64{} // key: the revision that deleted it
	for len(deleted) < 2 {
		w, ok := <-events
		if !ok || w.Err() != nil {
			t.Fatalf("watch ended before the lease expired: %v (context: %v)", w.Err(), wctx.Err())
		}
		for _, ev := range w.Events {
			if ev.Type == clientv3.EventTypeDelete {
				deleted[string(ev.Kv.Key)] = ev.Kv.ModRevision
			}
		}
	}
	t.Logf("lease expired after %v", time.Since(start).Round(time.Millisecond))
	if err := p.m.Expire(id); err != nil {
		t.Fatal(err)
	}
	if a, b := deleted[prefix+"a"], deleted[prefix+"b"]; a != b || a != p.m.Rev() {
		t.Fatalf("etcd deleted the keys at revisions %v, the model's expiry at %d", deleted, p.m.Rev())
	}
	if err := p.sameState(); err != nil {
		t.Fatal(err)
	}
}
