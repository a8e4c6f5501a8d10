package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"

	"github.com/idem-dev/idem/etcdtest"
)

// After retention the shared bucket lease deletes the record (the backstop
// of the sweeper, here off), and the same key is a new operation.
func TestRetentionLeasePrunesKeyAndKeyIsNew(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t), WithRetention(2*time.Second), WithBucketWidth(time.Second), WithExpirySweep(false))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	var runs atomic.Int32
	work := func(context.Context, *Claim) ([]byte, error) { runs.Add(1); return []byte("ok"), nil }

	first, err := s.Do(ctx, key, nil, work)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, s.ks.record(key))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("record after Do: %v, %v", resp, err)
	}
	ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	if err != nil {
		t.Fatal(err)
	}
	if ttl.GrantedTTL < 2 || ttl.GrantedTTL > 3 {
		t.Fatalf("bucket lease granted %ds; want retention (2s) plus at most one bucket (1s)", ttl.GrantedTTL)
	}
	// Wait for etcd to delete the record, on a Watch.
	w := cli.Watch(ctx, s.ks.record(key), clientv3.WithRev(resp.Kvs[0].ModRevision+1))
	deleted := false
	for wr := range w {
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.DELETE {
				deleted = true
			}
		}
		if deleted {
			break
		}
	}
	if !deleted {
		t.Fatalf("watch ended before the record was pruned: %v", ctx.Err())
	}
	second, err := s.Do(ctx, key, nil, work)
	if err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 2 || second.Replayed || second.Token <= first.Token {
		t.Fatalf("after retention: runs %d, replayed %v, token %d (first %d); want a new run with a greater token",
			runs.Load(), second.Replayed, second.Token, first.Token)
	}
}

// A record whose own expiry has passed is treated as absent even while its
// lease has not fired (a leader change can postpone a lease).
func TestExpiredRecordIsAbsentBeforeItsLeaseFires(t *testing.T) {
	cli := client(t)
	clk := newShiftClock()
	s := newStore(t, cli, testPrefix(t), WithExpirySweep(false), WithClock(clk))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	var runs atomic.Int32
	work := func(context.Context, *Claim) ([]byte, error) { runs.Add(1); return []byte("ok"), nil }
	first, err := s.Do(ctx, key, nil, work)
	if err != nil {
		t.Fatal(err)
	}
	clk.Shift(DefaultRetention + time.Minute)
	if _, err := s.Get(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get of an expired record = %v; want ErrNotFound", err)
	}
	if recs, err := s.List(ctx, "", ListOptions{}); err != nil || len(recs) != 0 {
		t.Fatalf("List = %d records, %v; want the expired record skipped", len(recs), err)
	}
	// Different params: an expired key is new, so no mismatch either.
	second, err := s.Do(ctx, key, []byte("other params"), work)
	if err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 2 || second.Token <= first.Token {
		t.Fatalf("runs %d, token %d (first %d); want a new run with a greater token", runs.Load(), second.Token, first.Token)
	}
}

// When etcd is full (NOSPACE alarm), new keys are refused with ErrUnavailable
// but done keys are still replayed, from a read.
func TestReplayWhenEtcdIsFull(t *testing.T) {
	small, cli := smallCluster(t)
	defer small.Close()
	s := newStore(t, cli, "/full/")
	ctx := testCtx(t)
	work := func(context.Context, *Claim) ([]byte, error) { return []byte("saved"), nil }
	if _, err := s.Do(ctx, Key{ID: "done-before"}, []byte("p"), work); err != nil {
		t.Fatal(err)
	}
	held, _, err := s.Claim(ctx, Key{ID: "in-flight"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	landedBefore, _, err := s.Claim(ctx, Key{ID: "landed"}, fpOf(t, "p"), WithoutSession(), WithDeadline(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	other, err := s.Attach(ctx, landedBefore.Handle())
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Complete(ctx, Outcome{Body: []byte("landed")}); err != nil {
		t.Fatal(err)
	}
	fillUntilNoSpace(t, ctx, cli)
	res, err := s.Do(ctx, Key{ID: "done-before"}, []byte("p"), work)
	if err != nil || !res.Replayed || string(res.Body) != "saved" {
		t.Fatalf("replay when full = %+v, %v; want the saved outcome", res, err)
	}
	if _, err := s.Do(ctx, Key{ID: "done-before"}, []byte("other"), work); !errors.Is(err, ErrMismatch) {
		t.Fatalf("mismatch when full = %v; want ErrMismatch", err)
	}
	if _, err := s.Do(ctx, Key{ID: "new"}, []byte("p"), work); !errors.Is(err, ErrStoreFull) || !errors.Is(err, ErrUnavailable) || !errors.Is(err, rpctypes.ErrNoSpace) {
		t.Fatalf("new key when full = %v; want ErrStoreFull (and ErrUnavailable) caused by NOSPACE", err)
	}
	if _, _, err := s.Claim(ctx, Key{ID: "in-flight"}, fpOf(t, "p")); !errors.Is(err, ErrConflict) {
		t.Fatalf("a key in flight under a live owner, when full = %v; want ErrConflict", err)
	}
	if full, err := s.CheckFull(ctx); !s.Metrics().Full || !full || err != nil {
		t.Fatalf("Full() = %v, CheckFull = %v, %v; want full", s.Metrics().Full, full, err)
	}
	// A Complete that landed although its reply was lost (here: through
	// another handle of the claim, before etcd filled up) is recognised by
	// its retry: etcd refuses every Txn with a Put when full, even one
	// whose compare fails, so only a read can tell.
	if err := landedBefore.Complete(ctx, Outcome{Body: []byte("landed")}); err != nil {
		t.Fatalf("the retry of a Complete that landed, when full = %v; want nil", err)
	}

	// The recovery docs/OPERATIONS.md gives: delete, compact, defragment,
	// disarm.
	if _, err := cli.Delete(ctx, "/filler/", clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	st, err := cli.Status(ctx, small.Endpoints()[0])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, st.Header.Revision, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Defragment(ctx, small.Endpoints()[0]); err != nil {
		t.Fatal(err)
	}
	alarms, err := cli.AlarmList(ctx)
	if err != nil || len(alarms.Alarms) == 0 {
		t.Fatalf("alarm list = %v, %v; want the NOSPACE alarm", alarms, err)
	}
	for _, a := range alarms.Alarms { // as etcdctl alarm disarm does
		if _, err := cli.AlarmDisarm(ctx, &clientv3.AlarmMember{MemberID: a.MemberID, Alarm: a.Alarm}); err != nil {
			t.Fatal(err)
		}
	}
	if full, err := s.CheckFull(ctx); full || err != nil || s.Metrics().Full {
		t.Fatalf("after the recovery CheckFull = %v, %v (Full %v); want room again", full, err, s.Metrics().Full)
	}
	if res, err := s.Do(ctx, Key{ID: "new"}, []byte("p"), work); err != nil || res.Replayed {
		t.Fatalf("new key after the recovery = %+v, %v", res, err)
	}
	if err := held.Complete(ctx, Outcome{Body: []byte("late")}); err != nil {
		t.Fatalf("the held claim's complete after the recovery = %v", err)
	}
}

// A claim whose deadline is longer than the retention is held until its
// deadline: its record does not expire first (others would take an
// expired record for absent and run the work a second time meanwhile).
func TestDeadlineLongerThanRetentionHoldsTheKey(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	clk := newShiftClock()
	const retention = 20 * time.Second
	a := newStore(t, cli, prefix, WithExpirySweep(false), WithClock(clk), WithRetention(retention))
	b := newStore(t, cli, prefix, WithExpirySweep(false), WithClock(clk), WithRetention(retention))
	ctx := testCtx(t)
	key := Key{ID: "long"}
	c, _, err := a.Claim(ctx, key, fpOf(t, "p"), WithoutSession(), WithDeadline(3*retention))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	clk.Shift(retention + time.Second)
	if c.Err() != nil {
		t.Fatalf("claim ended before its deadline: %v", c.Err())
	}
	if other, _, err := b.Claim(ctx, key, fpOf(t, "p")); !errors.Is(err, ErrConflict) {
		if other != nil {
			other.Release(ctx)
		}
		t.Fatalf("a second claim one retention after the first, before its deadline = %v; want ErrConflict", err)
	}
}

// A claim that writes nothing for a whole retention ends with its record,
// which others now treat as absent.
func TestClaimEndsWithItsRecord(t *testing.T) {
	cli := client(t)
	clk := newShiftClock()
	const retention = 20 * time.Second
	s := newStore(t, cli, testPrefix(t), WithExpirySweep(false), WithClock(clk), WithRetention(retention))
	ctx := testCtx(t)
	c, _, err := s.Claim(ctx, Key{ID: "quiet"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	clk.Shift(retention / 2)
	if err := c.Checkpoint(ctx, []byte("1")); err != nil {
		t.Fatal(err)
	}
	clk.Shift(retention + time.Second) // past the claim's first record, not its checkpoint's
	if c.Err() != nil {
		t.Fatalf("claim ended one retention after it was made, though it checkpointed since: %v", c.Err())
	}
	clk.Shift(retention/2 + retention + time.Second)
	if !errors.Is(c.Err(), ErrDeadline) {
		t.Fatalf("Err one retention after the claim's last write = %v; want ErrDeadline", c.Err())
	}
}

// smallCluster is a one-member cluster whose backend quota (8 MiB) a test
// fills quickly.
func smallCluster(t *testing.T) (*etcdtest.Cluster, *clientv3.Client) {
	t.Helper()
	small, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{Configure: func(c *embed.Config) {
		c.QuotaBackendBytes = 8 << 20
	}})
	if err != nil {
		t.Fatal(err)
	}
	return small, small.MustClient(t)
}

// fillUntilNoSpace writes until etcd raises its NOSPACE alarm.
func fillUntilNoSpace(t *testing.T, ctx context.Context, cli *clientv3.Client) {
	t.Helper()
	filler := strings.Repeat("x", 512<<10)
	for i := 0; ; i++ {
		_, err := cli.Put(ctx, fmt.Sprintf("/filler/%d", i), filler)
		if errors.Is(err, rpctypes.ErrNoSpace) {
			break
		}
		if err != nil || i > 1000 {
			t.Fatalf("filling etcd: %v after %d puts", err, i)
		}
	}
}

// A claim whose record has expired by its store's clock writes nothing in
// flight any more, though its timer has not fired yet: a checkpoint or an
// abandon would bring back a record others already treat as absent (a
// scheduler moves on from a forgotten job; the explorer found an abandon
// that revived one and let two occurrences overlap). A Complete still
// saves the outcome of work that ran.
func TestInFlightWritesAfterTheRecordExpiredAreRefused(t *testing.T) {
	cli := client(t)
	clk := newShiftClock()
	const retention = 20 * time.Second
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix, WithExpirySweep(false), WithClock(clk), WithRetention(retention))
	ctx := testCtx(t)
	for _, write := range []string{"checkpoint", "abandon", "complete"} {
		clk.Shift(0)
		key := Key{ID: "forgotten-" + write}
		c, _, err := s.Claim(ctx, key, fpOf(t, "p"))
		if err != nil {
			t.Fatal(err)
		}
		before, err := cli.Get(ctx, s.ks.record(key))
		if err != nil || len(before.Kvs) != 1 {
			t.Fatalf("%s: the record before: %v", write, err)
		}
		clk.Shift(retention + time.Second) // past the record's expiry; the claim's real timer is still far off
		switch write {
		case "checkpoint":
			err = c.Checkpoint(ctx, []byte("late"))
		case "abandon":
			err = c.Abandon(ctx)
		case "complete":
			err = c.Complete(ctx, Outcome{Status: 200, Body: []byte("ran")})
		}
		after, gerr := cli.Get(ctx, s.ks.record(key))
		if gerr != nil || len(after.Kvs) != 1 {
			t.Fatalf("%s: the record after: %v", write, gerr)
		}
		if write == "complete" {
			if err != nil || after.Kvs[0].ModRevision == before.Kvs[0].ModRevision {
				t.Fatalf("complete after the record expired = %v; want the outcome saved", err)
			}
			continue
		}
		if !errors.Is(err, ErrClaimEnded) || !errors.Is(err, ErrDeadline) {
			t.Fatalf("%s after the record expired = %v; want ErrClaimEnded and ErrDeadline", write, err)
		}
		if after.Kvs[0].ModRevision != before.Kvs[0].ModRevision {
			t.Fatalf("%s after the record expired was written (revision %d, was %d): the forgotten record came back", write, after.Kvs[0].ModRevision, before.Kvs[0].ModRevision)
		}
		if c.Err() == nil {
			t.Fatalf("%s: the claim is not ended after its refused write", write)
		}
	}
}
