package etcdstore

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// lossyClient returns a client whose next n Txn replies are lost: the Txn
// reaches etcd and is applied, and the caller sees codes.Unavailable.
func lossyClient(t *testing.T, lose *atomic.Int32) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   single.Endpoints(),
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				err := invoker(ctx, method, req, reply, cc, opts...)
				if err == nil && strings.HasSuffix(method, "/Txn") && lose.Add(-1) >= 0 {
					return status.Error(codes.Unavailable, "test: reply lost after the txn was applied")
				}
				return err
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// A claim whose reply is lost is applied in etcd; the store's own retry
// recognises it by its attempt id instead of conflicting with itself.
func TestLostClaimReplyIsRecognised(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}

	lose.Store(1)
	c, done, err := s.Claim(ctx, key, fpOf(t, "p"))
	if err != nil || done != nil {
		t.Fatalf("Claim after a lost reply = %v, %v; want the claim", done, err)
	}
	if lose.Load() >= 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	resp, err := client(t).Get(ctx, s.ks.record(key))
	if err != nil {
		t.Fatal(err)
	}
	if kv := resp.Kvs[0]; int64(c.Token()) != kv.CreateRevision || kv.Version != 1 {
		t.Fatalf("token %d, record created at %d with version %d; want the first write's token and no second write",
			c.Token(), kv.CreateRevision, kv.Version)
	}
	if c.TookOver() {
		t.Fatal("recognised claim reported as a takeover")
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
}

// A caller whose Claim failed with an unknown outcome retries with the same
// attempt id and is recognised as the owner.
func TestRetryWithSameAttemptIsRecognised(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	other := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	lose.Store(maxTries + 10) // every try's reply is lost
	_, _, err := s.Claim(ctx, key, fp, WithAttempt("attempt-1"))
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Claim with every reply lost = %v; want ErrUnavailable", err)
	}
	lose.Store(0)
	// The claim was written: another process sees it in flight.
	if _, _, err := other.Claim(ctx, key, fp); !errors.Is(err, ErrConflict) {
		t.Fatalf("other process = %v; want ErrConflict", err)
	}
	// The retry gets the key: either it recognises its own claim, or the
	// store's reaper already abandoned that claim and the retry takes it
	// over. It never conflicts with itself.
	c, _, err := s.Claim(ctx, key, fp, WithAttempt("attempt-1"))
	if err != nil {
		t.Fatalf("retry with the same attempt: %v", err)
	}
	if c.Attempt() != "attempt-1" {
		t.Fatalf("retry: attempt %q; want attempt-1", c.Attempt())
	}
	if c.TookOver() && (c.Previous() == nil || c.Previous().Owner != "" || c.Previous().Attempt != "attempt-1") {
		t.Fatalf("retry took over %+v; want only its own abandoned claim", c.Previous())
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
}

// A Complete whose reply is lost was applied; the store's retry recognises it
// instead of reporting the claim fenced out.
func TestLostCompleteReplyIsRecognised(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	c, _, err := s.Claim(ctx, key, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(ctx, []byte("cp")); err != nil {
		t.Fatal(err)
	}
	lose.Store(1)
	if err := c.Checkpoint(ctx, []byte("cp2")); err != nil {
		t.Fatalf("Checkpoint after a lost reply: %v", err)
	}
	if rec, err := s.Get(ctx, key); err != nil || string(rec.Checkpoint) != "cp2" || string(c.LastCheckpoint()) != "cp2" {
		t.Fatalf("after the checkpoint: record %+v, %v, claim's %q; want cp2 in both", rec, err, c.LastCheckpoint())
	}
	lose.Store(1)
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatalf("Complete after a lost reply: %v", err)
	}
	if lose.Load() >= 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	rec, err := s.Get(ctx, key)
	if err != nil || rec.State != Done || string(rec.Outcome.Body) != "ok" || rec.Checkpoint != nil {
		t.Fatalf("record = %+v, %v; want done with the outcome only", rec, err)
	}
}

// A claim written although its caller only saw errors is given up by the
// store, so another process can take the key over without waiting for this
// one to die.
func TestAmbiguousClaimIsAbandonedForOthers(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	other := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	lose.Store(maxTries + 10) // every reply of this claim is lost
	if _, _, err := s.Claim(ctx, key, fp); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Claim = %v; want ErrUnavailable", err)
	}
	lose.Store(0)
	// The other process waits on the key's Watch; the store's reaper
	// abandons the claim, and the other process takes it over.
	c, _, err := other.Claim(ctx, key, fp, WithWait())
	if err != nil {
		t.Fatalf("other process: %v; want it to take the abandoned claim over", err)
	}
	if !c.TookOver() || c.Previous() == nil || c.Previous().Owner != "" {
		t.Fatalf("tookOver %v previous %+v; want a takeover of an abandoned claim", c.TookOver(), c.Previous())
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
}

// An Abandon whose reply was lost landed: it is not reported as a failure.
func TestLostAbandonReplyIsRecognised(t *testing.T) {
	var lose atomic.Int32
	s := newStore(t, lossyClient(t, &lose), testPrefix(t))
	ctx := testCtx(t)
	c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(1)
	if err := c.Abandon(ctx); err != nil {
		t.Fatalf("Abandon after a lost reply = %v; want nil", err)
	}
}

// A Complete whose reply is lost is recognised by its outcome, also when
// the outcome names a header with no values (which a record does not
// keep): the caller is told its outcome was saved, not ErrClaimEnded.
func TestLostCompleteReplyWithAnEmptyHeader(t *testing.T) {
	var lose atomic.Int32
	s := newStore(t, lossyClient(t, &lose), testPrefix(t), WithBatching(false))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	c, _, err := s.Claim(ctx, key, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(1)
	out := Outcome{Status: 201, Header: map[string][]string{"X-Empty": {}, "X-Id": {"7"}}, Body: []byte("ok")}
	if err := c.Complete(ctx, out); err != nil {
		t.Fatalf("Complete after a lost reply: %v; want it recognised as landed", err)
	}
	if lose.Load() >= 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	rec, err := s.Get(ctx, key)
	if err != nil || rec.State != Done || string(rec.Outcome.Body) != "ok" || rec.Outcome.Header["X-Id"][0] != "7" {
		t.Fatalf("record = %+v, %v; want done with the outcome", rec, err)
	}
}
