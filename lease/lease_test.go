package lease

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdtest"
)

var cluster *etcdtest.Cluster

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m, 1, etcdtest.Options{}, &cluster)) }

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Many processes asking for the same bucket at once end up on one lease, and
// the losers' leases are given back.
func TestBucketsShareOneLeasePerBucket(t *testing.T) {
	ctx := ctxFor(t)
	cli := cluster.MustClient(t)
	before, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const procs = 8
	now := time.Now()
	prefix := fmt.Sprintf("/t/share/%d/", now.UnixNano())
	ids := make([]clientv3.LeaseID, procs)
	errs := make([]error, procs)
	var wg sync.WaitGroup
	for i := 0; i < procs; i++ {
		b, err := NewBuckets(cluster.MustClient(t), prefix, time.Hour, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ids[i], errs[i] = b.For(ctx, now)
		}()
	}
	wg.Wait()
	for i := range ids {
		if errs[i] != nil {
			t.Fatalf("process %d: %v", i, errs[i])
		}
		if ids[i] != ids[0] {
			t.Fatalf("process %d got lease %x, process 0 got %x: a bucket must have one lease", i, ids[i], ids[0])
		}
	}
	after, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(after.Leases) - len(before.Leases); got != 1 {
		t.Fatalf("%d new leases exist; want 1 (losers revoke theirs)", got)
	}
	ttl, err := cli.TimeToLive(ctx, ids[0])
	if err != nil {
		t.Fatal(err)
	}
	// Expires at the end of the bucket plus retention: between 1 h and 2 h.
	if ttl.GrantedTTL <= 3600 || ttl.GrantedTTL > 7200 {
		t.Fatalf("granted TTL %ds; want within (retention, retention+bucket]", ttl.GrantedTTL)
	}
}

func TestBucketsCacheAndRecoverFromRevokedLease(t *testing.T) {
	ctx := ctxFor(t)
	cli := cluster.MustClient(t)
	b, err := NewBuckets(cli, fmt.Sprintf("/t/revoked/%d/", time.Now().UnixNano()), time.Hour, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	id, err := b.For(ctx, now)
	if err != nil {
		t.Fatal(err)
	}
	again, err := b.For(ctx, now)
	if err != nil || again != id {
		t.Fatalf("second For = %x, %v; want the cached %x", again, err, id)
	}
	if _, err := cli.Revoke(ctx, id); err != nil { // an operator revokes it
		t.Fatal(err)
	}
	b.Invalidate(id)
	fresh, err := b.For(ctx, now)
	if err != nil || fresh == id {
		t.Fatalf("For after revoke = %x, %v; want a new lease", fresh, err)
	}
	// A different bucket gets a different lease.
	next, err := b.For(ctx, now.Add(time.Hour))
	if err != nil || next == fresh {
		t.Fatalf("next bucket lease = %x, %v; want a different lease from %x", next, err, fresh)
	}
}

func TestNewBucketsValidates(t *testing.T) {
	cli := cluster.MustClient(t)
	for _, tc := range []struct {
		prefix           string
		retention, width time.Duration
	}{
		{"", time.Hour, time.Hour},
		{"/p/", 0, time.Hour},
		{"/p/", 1500 * time.Millisecond, time.Second},
		{"/p/", time.Hour, 0},
		{"/p/", time.Hour, 2 * time.Hour},
	} {
		if _, err := NewBuckets(cli, tc.prefix, tc.retention, tc.width); err == nil {
			t.Errorf("NewBuckets(%q, %v, %v) succeeded; want an error", tc.prefix, tc.retention, tc.width)
		}
	}
	if _, err := NewBuckets(nil, "/p/", time.Hour, time.Hour); err == nil {
		t.Error("NewBuckets(nil client) succeeded")
	}
}

func TestSessionOwnerKeyLivesWithTheSession(t *testing.T) {
	ctx := ctxFor(t)
	cli := cluster.MustClient(t)
	s, err := NewSession(ctx, cli, "/t/owners/", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := NewSession(ctx, cli, "/t/owners/", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if s.Owner() == s2.Owner() {
		t.Fatal("two sessions share an owner id")
	}
	resp, err := cli.Get(ctx, "/t/owners/"+s.Owner())
	if err != nil || len(resp.Kvs) != 1 || clientv3.LeaseID(resp.Kvs[0].Lease) != s.Lease() {
		t.Fatalf("owner key = %v, %v; want it on the session lease", resp, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	<-s.Done()
	resp, err = cli.Get(ctx, "/t/owners/"+s.Owner())
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("owner key after Close = %v, %v; want it deleted at once", resp.Kvs, err)
	}
}

func TestSessionDoneWhenLeaseRevoked(t *testing.T) {
	ctx := ctxFor(t)
	cli := cluster.MustClient(t)
	s, err := NewSession(ctx, cli, "/t/owners2/", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := cli.Revoke(ctx, s.Lease()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-ctx.Done():
		t.Fatal("Done not closed after the lease was revoked")
	}
	if _, err := NewSession(ctx, cli, "/t/", time.Second); err == nil {
		t.Fatal("NewSession with a 1s TTL succeeded; want an error")
	}
}

// A busy bucket rolls over to a fresh lease after its share of writes.
func TestBucketRollsOverAfterMaxUses(t *testing.T) {
	ctx := ctxFor(t)
	b, err := NewBuckets(cluster.MustClient(t), fmt.Sprintf("/t/roll/%d/", time.Now().UnixNano()), time.Hour, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	b.SetMaxUses(3)
	now := time.Now()
	seen := map[clientv3.LeaseID]int{}
	for i := 0; i < 7; i++ {
		id, err := b.For(ctx, now)
		if err != nil {
			t.Fatal(err)
		}
		seen[id]++
	}
	if len(seen) != 3 {
		t.Fatalf("7 writes with 3 per lease used %d leases (%v); want 3", len(seen), seen)
	}
	for id, n := range seen {
		if n > 3 {
			t.Fatalf("lease %x took %d writes; want at most 3", id, n)
		}
	}
}
