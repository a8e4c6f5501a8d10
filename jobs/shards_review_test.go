package jobs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/shard"
)

// newShardSetChecking is newShardSet with the set in force looked at
// again every check (shard.Config.Check): a process that has not yet
// learned a change by itself (default 30 s).
func newShardSetChecking(t testing.TB, prefix string, gen int64, placement []string, check time.Duration) *shard.Store {
	t.Helper()
	cfg := shard.Config{Placement: shard.Placement{Shards: placement}, Generation: gen, Check: check, Skew: 100 * time.Millisecond}
	for _, n := range []string{"a", "b", "c"} {
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: n, Client: cluster.MustClient(t), Options: []etcdstore.Option{etcdstore.WithPrefix(prefix + n + "/")}})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := shard.New(ctx, cfg, etcdstore.WithSessionTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// DEFECT: a process that has not yet learned a set change (it looks again
// every Check, 30 s by default) answers "not found" for a job that exists,
// and refuses to signal it. Signal, Get and Wait find the job's shard by
// a read (shard.Store.Holder / readShard) under the set the process knows:
// the old placement's shard holds nothing (or a Moved record naming the
// job's shard, which is skipped, not followed), and nothing refreshes the
// set, since only a refused write teaches a process. Signal reads, and
// writes only where the read found the job, so it never gets there. An
// event for an existing job is refused with etcdstore.ErrNotFound (the
// worker API answers 404 no such job: a caller drops the event).
// ARCHITECTURE.md: "the order in which processes learn a change does not
// matter, nor whether they learn it from a file at all". (Check is an
// hour here so that the old process does not learn the change by its
// timer during the test.)
func TestReviewSignalFromAProcessThatHasNotLearnedTheChange(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	old := newShardSetChecking(t, prefix, 1, []string{"a"}, time.Hour)
	qOld := newShardQueue(t, old)
	set := newShardSet(t, prefix, 2, []string{"a", "b"}, []string{"a"})
	waitFor(t, func() bool { return set.Status().InForce.Generation == 2 })
	q := newShardQueue(t, set)
	var id string
	for i := 0; id == ""; i++ {
		if k := fmt.Sprintf("order-%d", i); set.Place(q.Key(k)) == "b" {
			id = k
		}
	}
	if _, err := q.Submit(ctx, id, "pay", nil); err != nil {
		t.Fatal(err)
	}
	if h := holderOf(t, set, q, id); h != "b" {
		t.Fatalf("job %s on %s; want b", id, h)
	}
	j, gerr := qOld.Get(ctx, id)
	serr := qOld.Signal(ctx, id, "approved", []byte(`"yes"`))
	if gerr != nil || serr != nil {
		t.Fatalf("a process still on generation 1: Get(%s) = %+v, %v; Signal(%s) = %v; want the job, and the event delivered", id, j, gerr, id, serr)
	}
}

// DEFECT: shard.Store.Settings (the queue's retention and record size on a
// shard set: "the shards' shortest retention is the queue's") skips a
// shard whose options are invalid, but when that shard is the first one
// it also skips taking the first valid shard's values: every later
// comparison is "less than 0", and the queue gets retention 0 and record
// size 0. Such a shard never connects (its New keeps failing); the doc
// says a shard that does not answer "stops only its own jobs", yet here a
// job on b cannot be submitted with RunAt a minute ahead ("past half the
// store's retention (0s)") nor signalled with any payload (limit 0).
func TestReviewSettingsWithAnUnusableFirstShard(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	healthy := newShardSet(t, prefix, 1, []string{"a", "b", "c"}, nil) // the set in force
	qh := newShardQueue(t, healthy)
	cfg := shard.Config{Placement: shard.Placement{Shards: []string{"a", "b", "c"}}, Generation: 1, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond}
	for _, n := range []string{"a", "b", "c"} {
		opts := []etcdstore.Option{etcdstore.WithPrefix(prefix + n + "/")}
		if n == "a" {
			opts = append(opts, etcdstore.WithRetention(-time.Hour)) // invalid: a never connects
		}
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: n, Client: cluster.MustClient(t), Options: opts})
	}
	nctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	set, err := shard.New(nctx, cfg, etcdstore.WithSessionTTL(2*time.Second))
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { set.Close() })
	if s := set.Settings(); s.Retention != etcdstore.DefaultRetention || s.MaxRecordSize != etcdstore.DefaultMaxRecordSize {
		t.Errorf("Settings() = %+v; want b's and c's (retention %v, records of %d bytes)", s, etcdstore.DefaultRetention, etcdstore.DefaultMaxRecordSize)
	}
	q := newShardQueue(t, set)
	var id string
	for i := 0; id == ""; i++ {
		if k := fmt.Sprintf("on-b-%d", i); healthy.Place(q.Key(k)) == "b" {
			id = k
		}
	}
	if _, err := q.Submit(ctx, id, "report", nil, RunAt(time.Now().Add(time.Minute))); err != nil {
		t.Errorf("Submit(%s) on shard b, RunAt in a minute: %v", id, err)
	}
	if _, err := qh.Submit(ctx, id+"-now", "report", nil); err != nil {
		t.Fatal(err)
	}
	if err := q.Signal(ctx, id+"-now", "go", []byte(`"x"`)); err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
		t.Errorf("Signal with a 3-byte payload: %v", err)
	}
}
