package etcdstore

import (
	"bytes"
	"errors"
	"sync/atomic"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// An enqueued key is an abandoned claim nobody held: the next claimant
// takes it over at once with a greater token and finds the data; enqueueing
// it again changes nothing, whoever does it.
func TestEnqueue(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key, fp := Key{Tenant: "jobs", ID: "invoice-1"}, fpOf(t, `{"n":1}`)

	rec, err := s.Enqueue(ctx, key, fp, []byte("step 0"))
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != InFlight || rec.Owner != "" || rec.Takeovers != 0 || string(rec.Checkpoint) != "step 0" || rec.Token == 0 {
		t.Fatalf("Enqueue = %+v; want in flight, no owner, no takeovers, the data, a token", rec)
	}
	got, err := s.Get(ctx, key)
	if err != nil || got.Token != rec.Token || got.Owner != "" || string(got.Checkpoint) != "step 0" {
		t.Fatalf("Get = %+v, %v; want what Enqueue returned (%+v)", got, err, rec)
	}

	rev := revision(t, cli)
	again, err := s.Enqueue(ctx, key, fp, []byte("other data"))
	if err != nil || again.Token != rec.Token || string(again.Checkpoint) != "step 0" {
		t.Fatalf("Enqueue again = %+v, %v; want the first record unchanged", again, err)
	}
	if _, err := s.Enqueue(ctx, key, fpOf(t, `{"n":2}`), nil); !errors.Is(err, ErrMismatch) {
		t.Fatalf("Enqueue with other params = %v; want ErrMismatch", err)
	}
	if r := revision(t, cli); r != rev {
		t.Fatalf("revision moved from %d to %d: a repeated or mismatched Enqueue wrote", rev, r)
	}

	c, done, err := s.Claim(ctx, key, fp)
	if err != nil || done != nil {
		t.Fatalf("Claim = %v, %v; want a takeover", done, err)
	}
	if !c.TookOver() || c.Takeovers() != 1 || c.Token() <= rec.Token || string(c.LastCheckpoint()) != "step 0" {
		t.Fatalf("claim: took over %v (%d), token %d (enqueued %d), checkpoint %q; want a takeover with a greater token and the data",
			c.TookOver(), c.Takeovers(), c.Token(), rec.Token, c.LastCheckpoint())
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("sent")}); err != nil {
		t.Fatal(err)
	}
	done2, err := s.Enqueue(ctx, key, fp, []byte("step 0"))
	if err != nil || done2.State != Done || string(done2.Outcome.Body) != "sent" {
		t.Fatalf("Enqueue of a done key = %+v, %v; want the done record", done2, err)
	}
}

// An Enqueue whose reply is lost lands once: its retry finds the record and
// returns it instead of failing or writing again.
func TestEnqueueLostReply(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key, fp := Key{ID: "lost"}, fpOf(t, "p")
	lose.Store(1)
	rec, err := s.Enqueue(ctx, key, fp, []byte("d"))
	if err != nil {
		t.Fatalf("Enqueue after a lost reply: %v", err)
	}
	if lose.Load() >= 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	resp, err := client(t).Get(ctx, s.ks.record(key))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("record: %v, %v", resp, err)
	}
	if kv := resp.Kvs[0]; kv.Version != 1 || int64(rec.Token) != kv.CreateRevision {
		t.Fatalf("record version %d created at %d, Enqueue said token %d; want one write, recognised", kv.Version, kv.CreateRevision, rec.Token)
	}
}

// Bad input is refused before etcd is asked.
func TestEnqueueBadInput(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t), WithMaxRecordSize(1024))
	ctx := testCtx(t)
	rev := revision(t, cli)
	if _, err := s.Enqueue(ctx, Key{ID: "a/b"}, fpOf(t, "p"), nil); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("bad key: %v; want ErrInvalidKey", err)
	}
	if _, err := s.Enqueue(ctx, Key{ID: "big"}, fpOf(t, "p"), make([]byte, 2048)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("large data: %v; want ErrTooLarge", err)
	}
	if r := revision(t, cli); r != rev {
		t.Fatalf("revision moved from %d to %d", rev, r)
	}
}

// A checkpoint's extra ops commit with it, exactly once: a retry after a
// lost reply recognises the checkpoint that landed and does not apply them
// again; a fenced checkpoint applies none.
func TestCheckpointOps(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	ctx := testCtx(t)
	key, fp := Key{ID: "steps"}, fpOf(t, "p")
	effect := "/effects" + prefix + "step-1"

	c, _, err := s.Claim(ctx, key, fp)
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(1)
	err = c.Checkpoint(ctx, []byte("1"), clientv3.OpPut(effect, "done"))
	if err != nil {
		t.Fatalf("Checkpoint after a lost reply: %v (the store retries its own write)", err)
	}
	if lose.Load() >= 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	resp, err := client(t).Get(ctx, effect)
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Version != 1 {
		t.Fatalf("effect key = %v, %v; want written once (version 1)", resp, err)
	}
	if !bytes.Equal(c.LastCheckpoint(), []byte("1")) {
		t.Fatalf("checkpoint %q; want 1", c.LastCheckpoint())
	}

	// The claim is evicted: its next checkpoint is fenced, and its op is not applied.
	if err := s.Evict(ctx, key); err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(ctx, []byte("2"), clientv3.OpPut(effect+"-2", "done")); !errors.Is(err, ErrFenced) {
		t.Fatalf("fenced Checkpoint = %v; want ErrFenced", err)
	}
	if resp, err := client(t).Get(ctx, effect+"-2"); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("a fenced checkpoint's op was applied: %v, %v", resp, err)
	}
}

// An op inside the store's prefix is refused before etcd is asked.
func TestCheckpointOpsInsidePrefix(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	ctx := testCtx(t)
	c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	rev := revision(t, cli)
	if err := c.Checkpoint(ctx, []byte("1"), clientv3.OpPut(prefix+"k/default/other", "x")); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("op inside the prefix = %v; want ErrInvalidArgument", err)
	}
	if r := revision(t, cli); r != rev {
		t.Fatalf("revision moved from %d to %d", rev, r)
	}
}

// Extra ops that etcd refuses for what they hold (a key written twice, an
// empty key, a lease that does not exist) fail with ErrInvalidArgument,
// not as an outage to retry: nothing was applied, and the claim still holds.
func TestRefusedOpsAreInvalidArguments(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	for name, ops := range map[string][]clientv3.Op{
		"a key written twice": {clientv3.OpPut("/ops/a", "1"), clientv3.OpPut("/ops/a", "2")},
		"an empty key":        {clientv3.OpPut("", "1")},
		"a lease that is not": {clientv3.OpPut("/ops/b", "1", clientv3.WithLease(0x7fff_0000_dead))},
	} {
		rev := revision(t, cli)
		if err := c.Checkpoint(ctx, []byte(name), ops...); !errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrUnavailable) {
			t.Errorf("%s: %v; want ErrInvalidArgument, not ErrUnavailable", name, err)
		}
		if r := revision(t, cli); r != rev {
			t.Errorf("%s: revision moved from %d to %d", name, rev, r)
		}
	}
	if err := c.Checkpoint(ctx, []byte("ok"), clientv3.OpPut("/ops/c", "1")); err != nil {
		t.Fatalf("the claim after refused ops: %v; want it still held", err)
	}
}
