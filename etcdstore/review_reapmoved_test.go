package etcdstore

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/protobuf/proto"
)

// BUG (kernel.Reap, kernel.ReapFenced, and the reaper in do.go): a claim
// made with ReplaceMoved (package shard's route to a key's home) writes
// over a Moved record with the compare ModRevision(rec) == the Moved
// record's revision. If that write's reply is lost, the claim fails
// uncertain and the reaper runs. kernel.Reap only fences a record the
// claim saw when it is *in flight* (`rec.State == InFlight && rec.Revision
// <= seen`); a Moved record the claim saw falls through to "retained past
// until: ReapDone" (decision table row P3: "written after seen by another,
// or done, or Moved ... nothing: no lost write can land while it is
// there"). That is false for a ReplaceMoved claim: its lost write compared
// exactly that Moved record, so it can land while the record is there.
// (Even if Reap fenced, the reaper's fencing claim is made without
// ReplaceMoved, so it would answer IsMoved and ReapFenced would call that
// done.)
//
// The reaper's contract (do.go, reap): "that write may have landed, or may
// still land ... as an in-flight record under a live session that nobody
// here runs; other processes would answer ErrConflict until this process
// dies" is exactly what happens below: the lost write lands after the
// reaper said it was done (well inside its land window), and another
// process's claim of the key at its home answers ErrConflict while nobody
// runs it.
func TestReviewReaperIgnoresLostReplaceMovedWrite(t *testing.T) {
	prefix := testPrefix(t)
	cli := client(t)
	ctx := testCtx(t)
	key, fp := Key{ID: "k"}, fpOf(t, "p")

	// A Moved record, left on this shard by an older shard set.
	fwd := newStore(t, cli, prefix, withEpochs())
	if rec, err := fwd.forwardKey(ctx, key, "elsewhere"); err != nil || rec.State != Moved {
		t.Fatalf("Forward = %+v, %v; want a Moved record", rec, err)
	}

	var (
		s        *Store
		armed    atomic.Bool
		dropping atomic.Bool
		mu       sync.Mutex
		held     *pb.TxnRequest
	)
	armed.Store(true)
	hook := func(method string, req any, invoke func() error) error {
		txn, ok := req.(*pb.TxnRequest)
		if !ok || s == nil || !armed.Load() ||
			!slices.ContainsFunc(txn.Compare, func(c *pb.Compare) bool { return string(c.Key) == s.ks.record(key) }) {
			return invoke()
		}
		if dropping.Load() {
			return errLost // this try never reaches etcd; the caller cannot tell
		}
		if slices.ContainsFunc(txn.Compare, func(c *pb.Compare) bool {
			return string(c.Key) == s.ks.record(key) && c.Target == pb.Compare_MOD
		}) {
			// The write over the Moved record: held back, it reaches etcd
			// late (a request applied after its caller gave up).
			mu.Lock()
			held = proto.Clone(txn).(*pb.TxnRequest)
			mu.Unlock()
			dropping.Store(true)
			return errLost
		}
		return invoke()
	}
	s = newStore(t, hookedClient(t, hook), prefix, withEpochs(), WithBatching(false))
	_, _, err := s.Claim(ctx, key, fp, replaceMoved())
	armed.Store(false)
	if err == nil {
		t.Fatal("Claim succeeded; the test expects its write over the Moved record to be lost")
	}
	mu.Lock()
	late := held
	mu.Unlock()
	if late == nil {
		t.Fatalf("no write over the Moved record was sent (Claim: %v)", err)
	}
	settle(t, s) // the reaper has done what it will do

	// The lost write is applied now, well within the reaper's land window.
	resp, err := pb.NewKVClient(cli.ActiveConnection()).Txn(ctx, late)
	if err != nil {
		t.Fatal(err)
	}

	// Another process claims the key at its home, as shard's route does.
	other := newStore(t, cli, prefix, withEpochs())
	c, _, err := other.Claim(ctx, key, fp, replaceMoved())
	var ce *ConflictError
	if errors.As(err, &ce) || errors.Is(err, ErrConflict) {
		rec, _ := other.Get(ctx, key)
		t.Fatalf("the lost ReplaceMoved write landed after the reaper gave up (applied: %v); another process's claim "+
			"= %v; the key is held by %s's session (%+v) with nobody running it, until that process dies",
			resp.Succeeded, err, s.Owner(), rec)
	}
	if err != nil {
		t.Fatalf("other.Claim: %v", err)
	}
	c.Release(ctx)
}
