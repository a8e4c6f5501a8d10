package jobs

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Review of 6af8eb6: forget() takes a fence placeholder for a job.
//
// A completer's claim of the previous occurrence's job (WithoutCreate)
// whose reply is lost, while that job's record is deleted (forget's
// EvictIf, or its lease) or expires, ends in etcdstore's reap
// (claim.go:321-325 -> do.go:324), which writes a fence on the key
// (acquire.go:135-139: in flight, no owner, no checkpoint, Fence, a fresh
// retention). Every read treats a fence as absent (record.go:102), so
// q.Get says ErrNotFound; but forget's Peek returns it, finds it before
// its Expires, and FromRecord of it is ErrNotJob: prevRunning, hence every
// tick, fails until the fence's retention passes, and no occurrence is
// decided meanwhile. The fence is written here as reap writes it.
func TestReviewFenceOnThePreviousJobDoesNotStallTheSchedule(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base)
	st := newStore(t, prefix, etcdstore.WithRetention(time.Minute), etcdstore.WithClock(master.view(0)))
	q := newQueue(t, st)
	sc := Schedule{Name: "sync", Every: 10 * time.Second, Kind: "sync", Lateness: 5 * time.Second, MaxSkew: time.Second, Overlap: OverlapSkip}
	if err := sc.validate(time.Minute); err != nil {
		t.Fatal(err)
	}
	s := &Scheduler{q: q}
	t1 := base
	decideAndSubmit(t, s, &sc, t1)
	id1 := OccurrenceID("sync", t1)
	cli := cluster.MustClient(t)
	resp, err := cli.Get(ctx, prefix+"k/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var raw string
	for _, kv := range resp.Kvs {
		if strings.HasSuffix(string(kv.Key), "/"+id1) {
			raw = string(kv.Key)
		}
	}
	if raw == "" {
		t.Fatalf("setup: no etcd key for %s under %s", id1, prefix)
	}
	// Past its retention; its record deleted (the sweeper, or a forget).
	master.set(base.Add(71 * time.Second))
	rec, err := storex.Peek(&st.Admin, ctx, q.Key(id1))
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := st.EvictIf(ctx, rec.Key, rec.Revision); err != nil || !ok {
		t.Fatal(ok, err)
	}
	// A completer's reap then fences the key (record format 1, which
	// every version still reads).
	now := q.clock.Now()
	meta, _ := json.Marshal(map[string]any{"s": etcdstore.InFlight, "fp": rec.Fingerprint.String(),
		"c": now.UnixMilli(), "x": now.Add(time.Minute).UnixMilli(), "f": true})
	val := append(binary.AppendUvarint([]byte{1}, uint64(len(meta))), meta...)
	if _, err := cli.Put(ctx, raw, string(val)); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Get(ctx, id1); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("setup: a fence reads as %v; want ErrNotFound", err)
	}
	cur, rev, err := s.cursor(ctx, &sc, now)
	if err != nil || !cur.Submitted.Equal(t1) {
		t.Fatalf("setup: cursor %+v, %v; want Submitted %v", cur, err, t1)
	}
	t2 := base.Add(70 * time.Second)
	_, moved, err := s.exclusive(ctx, &sc, cur, rev, []time.Time{t2}, t2, now)
	if err != nil || moved || !exists(t, q, OccurrenceID("sync", t2)) {
		t.Fatalf("occurrence 1 ended (submitted, its record gone, a fence in its place): exclusive = moved %v, err %v, occurrence 2 submitted %v; want occurrence 2 decided and submitted (today every tick fails with ErrNotJob until the fence expires)",
			moved, err, exists(t, q, OccurrenceID("sync", t2)))
	}
}

// Review of 6af8eb6: an occurrence whose job existed before its decision
// (a Backfill of the range that holds it) is never marked Submitted by
// the decider: IfValueThen writes nothing when the record exists
// (enqueue.go, "A record that exists is returned"). Ended by a process
// whose store keeps records for less time, and gone before any scheduler
// looked at it again, it is taken for "decided, never submitted" and
// submitted a second time: it runs twice.
func TestReviewBackfilledOccurrenceGoneEarlyIsNotSubmittedAgain(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base)
	long := newStore(t, prefix, etcdstore.WithRetention(time.Minute), etcdstore.WithClock(master.view(0)))
	short := newStore(t, prefix, etcdstore.WithRetention(2*time.Second), etcdstore.WithClock(master.view(0)))
	qL, qS := newQueue(t, long), newQueue(t, short)
	sc := Schedule{Name: "sync", Every: 10 * time.Second, Kind: "sync", Lateness: 5 * time.Second, MaxSkew: time.Second, Overlap: OverlapSkip}
	if err := sc.validate(time.Minute); err != nil {
		t.Fatal(err)
	}
	sL := &Scheduler{q: qL}
	t1 := base.Add(-10 * time.Second) // past: a backfill's range
	cv := cursorValue{Last: t1.Add(-10 * time.Second)}
	rev, err := sL.setCursor(ctx, &sc, 0, cv)
	if err != nil || rev == 0 {
		t.Fatal(rev, err)
	}
	if n, err := qL.Backfill(ctx, sc, t1, t1); err != nil || n != 1 {
		t.Fatalf("backfill = %d, %v", n, err)
	}
	now := qL.clock.Now()
	// Decided and "submitted": the record exists, so nothing is marked.
	// (A fix that marks it and reports the cursor moved is fine here.)
	if _, _, err := sL.exclusive(ctx, &sc, cv, rev, []time.Time{t1}, t1, now); err != nil {
		t.Fatal(err)
	}
	id1 := OccurrenceID("sync", t1)
	if j, err := qS.Cancel(ctx, id1, "ended"); err != nil || !j.State.Final() {
		t.Fatal(j, err)
	}
	// Its 2 s pass and its record is swept (its lease ends).
	master.set(base.Add(6 * time.Second))
	ended, err := storex.Peek(&long.Admin, ctx, qL.Key(id1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := long.EvictIf(ctx, ended.Key, ended.Revision); err != nil {
		t.Fatal(err)
	}
	now = qL.clock.Now()
	cur, rev, err := sL.cursor(ctx, &sc, now)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cursor: prev %v, submitted %v", cur.Prev, cur.Submitted)
	running, _, err := sL.prevRunning(ctx, &sc, cur, rev, now)
	if err != nil && !errors.Is(err, storex.ErrValueChanged) {
		t.Fatal(err)
	}
	if j, err := qL.Get(ctx, id1); err == nil || running {
		t.Fatalf("occurrence 1 (backfilled, then decided) ended and gone: running=%v, its job %+v; want it not submitted again", running, j)
	}
}
