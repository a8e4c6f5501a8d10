package etcdstore

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// review6Gate holds one Txn that compares key: before it is sent (until
// send), and its reply once etcd applied it (until reply).
type review6Gate struct {
	key              []byte
	armed            atomic.Bool
	reached, applied chan struct{}
	send, reply      chan struct{}
}

func newReview6Gate(key string) *review6Gate {
	return &review6Gate{key: []byte(key), reached: make(chan struct{}), applied: make(chan struct{}),
		send: make(chan struct{}), reply: make(chan struct{})}
}

func (g *review6Gate) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	tr, ok := req.(*pb.TxnRequest)
	gated := false
	if ok && strings.HasSuffix(method, "/Txn") && g.armed.Load() {
		for _, c := range tr.Compare {
			gated = gated || bytes.Equal(c.Key, g.key)
		}
		gated = gated && g.armed.CompareAndSwap(true, false)
	}
	if !gated {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	close(g.reached)
	<-g.send
	err := invoker(ctx, method, req, reply, cc, opts...)
	close(g.applied)
	<-g.reply
	return err
}

// Promise (restore.go: a store sees a restore when "a shard epoch lower
// than the one the store claimed under" comes back; in normal operation
// nothing is refused with ErrRestored, and the epoch is raised by 1,024
// only after a restore). Here nothing is restored: a claim on a shard is
// refused because another process raised the epoch (0 to 1, a key moving
// in); before its reply arrives, this process raises the epoch again (1 to
// 2, another key moving in). The late reply names epoch 1, lower than the
// 2 the store now believes in, and the store takes it for a restore: it
// logs "etcd was restored from a snapshot" at error level and refuses
// every write (ErrRestored) until its raise runs (which then finds nothing
// to raise). The epoch itself is not bumped.
func TestReview6AnEpochRaiseSeenOutOfOrderIsNoRestore(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	g := newReview6Gate(prefix + "epoch")
	cli, err := clientv3.New(clientv3.Config{Endpoints: single.Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(g.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	var logged review6Log
	s := newStore(t, cli, prefix, withEpochs(), WithLogger(slog.New(slog.NewTextHandler(&logged, nil))))
	other := newStore(t, client(t), prefix, withEpochs())
	type result struct {
		c   *Claim
		err error
	}
	done := make(chan result, 1)
	g.armed.Store(true)
	go func() {
		c, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "k"))
		done <- result{c, err}
	}()
	<-g.reached // the claim's Txn, comparing epoch 0 (absent), is about to go
	if e, err := other.raiseEpoch(ctx, 0); err != nil || e != 1 {
		t.Fatalf("another process raises the epoch: %d, %v", e, err)
	}
	close(g.send)
	<-g.applied // refused: etcd's epoch is 1; the reply says so
	if e, err := s.raiseEpoch(ctx, 1); err != nil || e != 2 {
		t.Fatalf("this process raises the epoch: %d, %v", e, err)
	}
	close(g.reply)
	r := <-done
	if errors.Is(r.err, ErrRestored) {
		t.Fatalf("no restore happened, yet the claim = %v", r.err)
	}
	resp, err := client(t).Get(ctx, prefix+"epoch")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("epoch key: %v, %v", resp, err)
	}
	if e, _ := strconv.ParseInt(string(resp.Kvs[0].Value), 10, 64); e != 2 || s.currentEpoch() > 2 {
		t.Fatalf("no restore happened, yet the epoch is %d in etcd (%d in the store), after raises to 1 and 2 (claim: %v)", e, s.currentEpoch(), r.err)
	}
	if r.err != nil {
		t.Fatalf("claim: %v", r.err)
	}
	if l := logged.String(); strings.Contains(l, "restored") {
		t.Fatalf("no restore happened, yet the store logged:\n%s", l)
	}
}

type review6Log struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *review6Log) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *review6Log) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
