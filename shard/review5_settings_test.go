package shard_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemtest"
	"github.com/idem-dev/idem/shard"
)

// A shard set whose shards keep records under options of their own
// (shard.Shard.Options, after the set's): shard b keeps them 10 minutes and
// at most 1 KiB, shard a the defaults (24 h, 1 MiB).
func mixedSet(t *testing.T) *shard.Store {
	t.Helper()
	prefix := confPrefix(t)
	cfg := shard.Config{Placement: shard.Placement{Shards: []string{"a", "b"}}, Generation: 1, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond}
	cfg.Shards = []shard.Shard{
		{Name: "a", Client: shard.Clusters()["a"].MustClient(t)},
		{Name: "b", Client: shard.Clusters()["b"].MustClient(t), Options: []etcdstore.Option{etcdstore.WithRetention(10 * time.Minute), etcdstore.WithMaxRecordSize(1024)}},
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

// idem.Store: "Retention is how long a record is kept after its last
// write: a key is a new operation after it"; "MaxRecordSize is the largest
// outcome plus checkpoint a claim saves". shard.Store answers with its
// first shard's (its godoc: "the retention of every shard"), though a
// shard's own options may set others, as Settings (which package jobs
// uses) already knows: a key on shard b is forgotten after 10 minutes,
// not 24 hours, and a 2 KiB outcome, under MaxRecordSize, is refused.
func TestReview5ShardRetentionAndMaxRecordSizeAreEveryShards(t *testing.T) {
	s := mixedSet(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var k etcdstore.Key
	for i := 0; ; i++ {
		k = etcdstore.Key{Tenant: "mixed", ID: "k" + strconv.Itoa(i)}
		if s.Place(k) == "b" {
			break
		}
	}
	fp, _ := etcdstore.FingerprintOf(nil)
	body := bytes.Repeat([]byte{'x'}, 2048)
	_, err := s.Run(ctx, k, fp, func(context.Context, *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		return etcdstore.Outcome{Body: body}, etcdstore.EndSave
	})
	if len(body) <= s.MaxRecordSize() && errors.Is(err, etcdstore.ErrTooLarge) {
		t.Errorf("MaxRecordSize() = %d, yet an outcome of %d bytes was refused: %v", s.MaxRecordSize(), len(body), err)
	}
	k.ID += "-small"
	for s.Place(k) != "b" {
		k.ID += "x"
	}
	before := time.Now()
	if _, err := s.Run(ctx, k, fp, func(context.Context, *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		return etcdstore.Outcome{Body: []byte("ok")}, etcdstore.EndSave
	}); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if kept := rec.Expires.Sub(before); kept < s.Retention()-time.Minute {
		t.Errorf("Retention() = %v, yet a record written now expires after %v", s.Retention(), kept.Round(time.Second))
	}
}

// The same set through the conformance suite: its Retention and TooLarge
// promises fail for the keys the set places on shard b.
func TestReview5ConformanceShardsWithOptionsOfTheirOwn(t *testing.T) {
	idemtest.TestStore(t, idemtest.Harness{Store: mixedSet(t)})
}
