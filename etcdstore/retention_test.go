package etcdstore

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// After retention the shared bucket lease deletes the record, and the same key
// is a new operation.
func TestRetentionLeasePrunesKeyAndKeyIsNew(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t), WithRetention(2*time.Second), WithBucketWidth(time.Second))
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
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	var runs atomic.Int32
	work := func(context.Context, *Claim) ([]byte, error) { runs.Add(1); return []byte("ok"), nil }
	first, err := s.Do(ctx, key, nil, work)
	if err != nil {
		t.Fatal(err)
	}
	s.setClock(func() time.Time { return time.Now().Add(DefaultRetention + time.Minute) })
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
