package etcdstore

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore/internal/sweep"
	"github.com/idem-dev/idem/etcdtest"
)

// Expired records are deleted by the sweeper a chunk at a time, never all of
// a lease's in one raft entry, and their leases are revoked once empty; a
// record written again on a newer lease stays.
func TestSweeperDeletesExpiredRecordsInChunks(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	// Leases of up to 800 writes: were etcd to delete a lease's records on
	// its expiry, one raft entry would delete all of them.
	s := newStore(t, cli, prefix, WithRetention(2*time.Second), WithBucketWidth(2*time.Second), WithKeysPerLease(800),
		withSweepPace(500*time.Millisecond, time.Second, nil))
	ctx := testCtx(t)
	start := revision(t, cli)
	const n = 300
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Do(ctx, Key{ID: fmt.Sprintf("r%03d", i)}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("ok"), nil }); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	// A claim whose record keeps being written (a long job checkpointing):
	// its key moves to newer leases and must survive the sweeps of the old.
	live, _, err := s.Claim(ctx, Key{ID: "live"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	deletes := map[int64]int{} // revision -> records deleted at it
	gone := 0
	w := cli.Watch(ctx, s.ks.records(), clientv3.WithPrefix(), clientv3.WithRev(start+1))
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for gone < n {
		select {
		case wr := <-w:
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					deletes[ev.Kv.ModRevision]++
					gone++
				}
			}
		case <-tick.C:
			if err := live.Checkpoint(ctx, []byte("still going")); err != nil {
				t.Fatalf("the live claim's checkpoint: %v", err)
			}
		case <-ctx.Done():
			t.Fatalf("%d of %d expired records deleted: %v", gone, n, ctx.Err())
		}
	}
	most := 0
	for _, d := range deletes {
		most = max(most, d)
	}
	if most > sweep.Chunk || len(deletes) < n/sweep.Chunk {
		t.Fatalf("%d records deleted in %d raft entries, at most %d in one; want chunks of at most %d", n, len(deletes), most, sweep.Chunk)
	}
	// Then the emptied leases are revoked: their bucket keys go (long
	// before their TTL, two bucket widths later), and the sweep locks.
	bw := cli.Watch(ctx, s.ks.buckets(), clientv3.WithPrefix(), clientv3.WithRev(start+1))
	for revoked := false; !revoked; {
		select {
		case wr := <-bw:
			for _, ev := range wr.Events {
				revoked = revoked || ev.Type == mvccpb.DELETE
			}
		case <-ctx.Done():
			t.Fatal("no emptied lease was revoked")
		}
	}
	if err := live.Checkpoint(ctx, []byte("done soon")); err != nil {
		t.Fatalf("the live claim after the sweeps: %v", err)
	}
	t.Logf("%d records deleted in %d Txns (at most %d in one)", n, len(deletes), most)
}

// A record written again between the sweeper's listing and its deletes (a
// new operation on the key, after its retention) is on a newer lease: the
// sweeper's conditional delete leaves it.
func TestSweeperLeavesARecordWrittenAgain(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	ctx := testCtx(t)
	rewrote := make(chan struct{})
	var once sync.Once
	// b is written again by a store that keeps it a minute: the check at
	// the end does not race b's own expiry on a slow machine.
	long := newStore(t, cli, prefix, WithRetention(time.Minute), WithExpirySweep(false))
	s := newStore(t, cli, prefix, WithRetention(2*time.Second), WithBucketWidth(2*time.Second),
		withSweepPace(500*time.Millisecond, time.Second, func(recs []string) {
			once.Do(func() {
				// The retention of "b" has passed: a client's new operation.
				if _, err := long.Do(ctx, Key{ID: "b"}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("second"), nil }); err != nil {
					t.Error(err)
				}
				close(rewrote)
			})
		}))
	work := func(context.Context, *Claim) ([]byte, error) { return []byte("first"), nil }
	for _, id := range []string{"a", "b", "c"} {
		if _, err := s.Do(ctx, Key{ID: id}, nil, work); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-rewrote:
	case <-ctx.Done():
		t.Fatal("the sweeper never listed the bucket")
	}
	// Wait until "a" and "c" are gone; "b" must stay, with its new outcome.
	for _, id := range []string{"a", "c"} {
		k := s.ks.record(Key{ID: id})
		for {
			resp, err := cli.Get(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			if len(resp.Kvs) == 0 {
				break
			}
			<-cli.Watch(ctx, k, clientv3.WithRev(resp.Header.Revision+1))
		}
	}
	rec, err := long.Get(ctx, Key{ID: "b"})
	if err != nil || string(rec.Outcome.Body) != "second" {
		t.Fatalf("the record written again: %+v, %v; want it kept with its new outcome", rec, err)
	}
}

// The sweeper works under etcd RBAC with a role on the store's prefix only
// (docs/SECURITY.md): listing a lease's keys, deleting records, taking the
// sweep lock and revoking emptied leases all stay inside the prefix.
func TestSweeperUnderRBAC(t *testing.T) {
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	root := c.MustClient(t)
	ctx := testCtx(t)
	const prefix = "/rbac/idem/"
	for _, step := range []func() error{
		func() error { _, err := root.UserAdd(ctx, "root", "root-pw"); return err },
		func() error { _, err := root.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := root.RoleAdd(ctx, "idem"); return err },
		func() error {
			_, err := root.RoleGrantPermission(ctx, "idem", prefix, clientv3.GetPrefixRangeEnd(prefix), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := root.UserAdd(ctx, "idem", "idem-pw"); return err },
		func() error { _, err := root.UserGrantRole(ctx, "idem", "idem"); return err },
		func() error { _, err := root.AuthEnable(ctx); return err },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.Endpoints(), Username: "idem", Password: "idem-pw", DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	admin, err := clientv3.New(clientv3.Config{Endpoints: c.Endpoints(), Username: "root", Password: "root-pw", DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	// The role cannot read outside the prefix: the test would prove
	// nothing if it could.
	if _, err := cli.Get(ctx, "/elsewhere"); err == nil {
		t.Fatal("the idem user reads outside its prefix")
	}

	s := newStore(t, cli, prefix, WithRetention(2*time.Second), WithBucketWidth(2*time.Second), WithKeysPerLease(100),
		withSweepPace(300*time.Millisecond, time.Second, nil))
	start := revision(t, admin)
	const n = 100
	for i := range n {
		if _, err := s.Do(ctx, Key{ID: fmt.Sprintf("r%03d", i)}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("ok"), nil }); err != nil {
			t.Fatal(err)
		}
	}
	w := admin.Watch(ctx, s.ks.records(), clientv3.WithPrefix(), clientv3.WithRev(start+1))
	bw := admin.Watch(ctx, s.ks.buckets(), clientv3.WithPrefix(), clientv3.WithRev(start+1))
	gone, revoked := 0, false
	deletes := map[int64]int{} // revision -> records deleted at it
	for gone < n || !revoked {
		select {
		case wr := <-w:
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					deletes[ev.Kv.ModRevision]++
					gone++
				}
			}
		case wr := <-bw:
			for _, ev := range wr.Events {
				revoked = revoked || ev.Type == mvccpb.DELETE
			}
		case <-ctx.Done():
			t.Fatalf("under RBAC: %d of %d expired records deleted, a lease revoked: %v (sweeper: %+v)", gone, n, revoked, s.Metrics().Sweep)
		}
	}
	// The sweeper's, not etcd's lease expiry (which deletes a lease's 100
	// records in one entry): chunks of at most sweep.Chunk.
	for rev, d := range deletes {
		if d > sweep.Chunk {
			t.Fatalf("%d records deleted at revision %d: not the sweeper's chunks of %d", d, rev, sweep.Chunk)
		}
	}
}
