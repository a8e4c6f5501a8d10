package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
)

// Found by review, now fixed: the process that holds a key's outcome takes the key over and
// runs it again, when its session was lost while the work ran.
//
// ARCHITECTURE.md ("Ambiguous outcomes", the outcome cannot be written):
// "the key stays claimed by this process (409 elsewhere) ... this process
// never runs a key whose outcome it holds, even after its session was lost
// (a retry through it gets 409 until the save lands, then the replay)";
// issue 29: "Fix it so that a process holding an outcome it has not yet
// saved never runs the key again".
//
// What happened: the session is lost while the work runs (a partition
// longer than the TTL); the work had already acted (the charge went
// through) and returns its result. Do saves it (EndSave: the work did not
// fail), the save cannot land, and it is retried in the background: this
// process holds the outcome. But the session supervisor dropped the claim
// from the process's running claims when the session ended (it was not
// pending yet), and Run marks it pending without registering it again. A
// client's retry through this very process finds the record of the dead
// session, takes it over and runs the work a second time; the first
// outcome, still held here, is then fenced out and lost: one charge made
// and never answered, as in issue 29.
func TestOutcomeFinishedAfterSessionLossIsNotRunAgainHere(t *testing.T) {
	var cut atomic.Bool
	prefix := testPrefix(t)
	cli := client(t)
	s := newStore(t, hookedClient(t, failDoneWrites(&cut)), prefix)
	ctx := testCtx(t)
	key, params := Key{ID: "charge"}, []byte(`{"amount":1}`)
	runs := 0
	work := func(context.Context, *Claim) ([]byte, error) {
		runs++
		if runs == 1 {
			// The charge is on its way when the process is cut off for
			// longer than its session's TTL: the session ends, and the
			// outcome cannot be saved from now on. The charge went through.
			lost := s.Owner()
			if _, err := cli.Revoke(ctx, s.sessionLeaseID()); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "a new session", func() bool { o := s.Owner(); return o != "" && o != lost })
			cut.Store(true)
		}
		return []byte(fmt.Sprintf("charged %d", runs)), nil
	}
	res, err := s.Do(ctx, key, params, work)
	if string(res.Body) != "charged 1" || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Do = %q, %v; want the work's result and ErrUnavailable (its save pending)", res.Body, err)
	}
	if p := s.Metrics().Pending; p != 1 {
		t.Fatalf("Pending = %d; want the outcome pending in the background", p)
	}
	// The client retries through the same process.
	_, err = s.Do(ctx, key, params, work)
	if runs != 1 {
		t.Fatalf("a retry through the process that holds the pending outcome %q: the work ran %d times (%v); want ErrConflict and one run", "charged 1", runs, err)
	}
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("a retry while the outcome is pending: %v; want ErrConflict", err)
	}
}

// notSentClock is the real clock, except that once armed, the first
// backoff sleep (25 ms) of a call whose context carries notSentMark ends
// with that call's context cancelled: the caller's deadline passes right
// after the store's backoff, before its next try is sent.
type notSentClock struct {
	clock.Clock
	armed, sleeping atomic.Bool
	cancel          context.CancelFunc
}

type notSentMark struct{}

func (c *notSentClock) AfterFunc(d time.Duration, f func()) func() bool {
	if c.armed.Load() && d == 25*time.Millisecond {
		c.sleeping.Store(true)
	}
	return c.Clock.AfterFunc(d, f)
}

func (c *notSentClock) Wait(ctx context.Context, ready <-chan struct{}) error {
	err := c.Clock.Wait(ctx, ready)
	if err == nil && ctx.Value(notSentMark{}) != nil && c.sleeping.Load() && c.armed.CompareAndSwap(true, false) {
		c.cancel()
	}
	return err
}

// Found by review, now fixed: a Checkpoint (with ops) that landed is reported as ErrNotSent,
// "it did not land".
//
// errors.go: "ErrNotSent is wrapped by the error of a write that never
// left this process ...: it did not land, and is the only failure of a
// write that says so. Every other failure of a write may have landed."
// ARCHITECTURE.md: "only 'never sent' (send.ErrNotSent ...) ... are 'not
// applied'; everything else may have landed". The claim path was fixed
// for this ("a claim that may have landed never says not sent", 2b0cdcb),
// the fenced writes were not.
//
// What happened: the checkpoint's first try is applied by etcd and its reply
// is lost; the store backs off and tries again, but the caller's context
// ends just then, so the second try is never sent. Claim.write returns
// that last try's error, which wraps ErrNotSent: the caller is told the
// checkpoint, and its ops, did not land, while both did.
func TestCheckpointThatLandedIsNotReportedNotSent(t *testing.T) {
	prefix := testPrefix(t)
	cli := client(t)
	clk := &notSentClock{Clock: clock.Real}
	var hold atomic.Bool
	var recKey atomic.Value
	hook := func(method string, req any, invoke func() error) error {
		txn, ok := req.(*pb.TxnRequest)
		if !ok || !hold.Load() || !putsKey(txn.Success, recKey.Load().(string)) {
			return invoke()
		}
		err := invoke() // applied by etcd ...
		if err == nil && hold.CompareAndSwap(true, false) {
			clk.armed.Store(true)
			return errLost // ... and its reply lost
		}
		return err
	}
	s := newStore(t, hookedClient(t, hook), prefix, WithClock(clk))
	ctx := testCtx(t)
	fp, err := FingerprintOf(nil)
	if err != nil {
		t.Fatal(err)
	}
	// The caller's context may also end while the retry looks up its
	// retention lease (a select between two ready channels: an error that does
	// not say "not sent", half the time): a few keys.
	for i := 0; i < 12; i++ {
		key := Key{ID: fmt.Sprintf("step-%d", i)}
		recKey.Store(prefix + "k/default/" + key.ID)
		c, _, err := s.Claim(ctx, key, fp)
		if err != nil {
			t.Fatal(err)
		}
		effect := "/review-effects" + prefix + key.ID
		cctx, cancel := context.WithCancel(ctx)
		clk.cancel = cancel
		hold.Store(true)
		err = c.Checkpoint(context.WithValue(cctx, notSentMark{}, true), []byte("step 1 done"), clientv3.OpPut(effect, "charged"))
		cancel()
		rec, gerr := s.Get(ctx, key)
		if gerr != nil {
			t.Fatal(gerr)
		}
		side, gerr := cli.Get(ctx, effect)
		if gerr != nil {
			t.Fatal(gerr)
		}
		t.Logf("%s: Checkpoint: %v; the record's checkpoint %q, the op's key written: %v", key.ID, err, rec.Checkpoint, len(side.Kvs) == 1)
		if errors.Is(err, ErrNotSent) && (string(rec.Checkpoint) == "step 1 done" || len(side.Kvs) == 1) {
			t.Fatalf("Checkpoint returned an error wrapping ErrNotSent (%v), which says it did not land; its checkpoint %q and its op (%d keys) did", err, rec.Checkpoint, len(side.Kvs))
		}
	}
}

// putsKey reports whether ops (or their nested Txns) put key.
func putsKey(ops []*pb.RequestOp, key string) bool {
	for _, op := range ops {
		if put := op.GetRequestPut(); put != nil && string(put.Key) == key {
			return true
		}
		if txn := op.GetRequestTxn(); txn != nil && putsKey(txn.Success, key) {
			return true
		}
	}
	return false
}
