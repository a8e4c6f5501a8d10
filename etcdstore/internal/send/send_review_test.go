package send

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdtest"
)

// gatedKV is a real etcd's KV whose Txns are held before they are sent
// until the test opens the gate of the request (named by the sorted keys
// it puts, joined by ","): a batch in flight for as long as a test needs.
type gatedKV struct {
	pb.KVClient
	mu      sync.Mutex
	gates   map[string]chan struct{}
	arrived chan string
}

func newGatedKV(t *testing.T) *gatedKV {
	return &gatedKV{KVClient: realKV(t), gates: map[string]chan struct{}{}, arrived: make(chan string, 100)}
}

func (kv *gatedKV) gate(name string) chan struct{} {
	kv.mu.Lock()
	defer kv.mu.Unlock()
	g, ok := kv.gates[name]
	if !ok {
		g = make(chan struct{})
		kv.gates[name] = g
	}
	return g
}

func (kv *gatedKV) open(name string) { close(kv.gate(name)) }

func putKeys(req *pb.TxnRequest) []string {
	var keys []string
	for _, op := range req.Success {
		switch r := op.Request.(type) {
		case *pb.RequestOp_RequestPut:
			keys = append(keys, string(r.RequestPut.Key))
		case *pb.RequestOp_RequestTxn:
			keys = append(keys, putKeys(r.RequestTxn)...)
		}
	}
	return keys
}

func (kv *gatedKV) Txn(ctx context.Context, req *pb.TxnRequest, opts ...grpc.CallOption) (*pb.TxnResponse, error) {
	keys := putKeys(req)
	sort.Strings(keys)
	name := strings.Join(keys, ",")
	kv.arrived <- name
	select {
	case <-kv.gate(name):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return kv.KVClient.Txn(ctx, req, opts...)
}

func putReq(key string) *pb.TxnRequest {
	return &pb.TxnRequest{Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte(key), Value: []byte("v")}}}}}
}

func expectArrival(t *testing.T, kv *gatedKV, want string) {
	t.Helper()
	select {
	case got := <-kv.arrived:
		if got != want {
			t.Fatalf("etcd received %q, want %q", got, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("etcd never received %q", want)
	}
}

func waitQueued(t *testing.T, s *Sender, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Queued() != n {
		if time.Now().After(deadline) {
			t.Fatalf("queued %d, want %d", s.Queued(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// A leader whose own write is left out of the batch it sends (its key is
// already in it) stays the oldest queued write while it sends. The wake-up
// of a freed slot then goes to it, deaf in its etcd call, and no other
// waiting write is woken: a write waits for an unrelated batch's answer
// (up to the request timeout, 30 s by default) while a slot is free and
// the hold has passed. Package doc / ARCHITECTURE: "A queued write waits at
// most until a batch in flight answers ... or the hold passes".
func TestReviewFreedSlotWakesOnlyABusyLeader(t *testing.T) {
	kv := newGatedKV(t)
	s := New(Config{KV: kv, Clock: clock.Real, Batching: true, MaxMembers: 3,
		Try: func(ctx context.Context) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, time.Minute)
		}})
	ctx := context.Background()
	type result struct {
		name string
		err  error
	}
	results := make(chan result, 10)
	write := func(key string) {
		go func() {
			_, err := s.Txn(ctx, putReq(key), []string{key})
			results <- result{key, err}
		}()
	}
	defer func() {
		for _, g := range []string{"w1", "a,k", "a,c", "c", "a"} {
			func() { defer func() { recover() }(); kv.open(g) }()
		}
	}()

	write("w1") // idle: sent at once, alone, and held at etcd
	expectArrival(t, kv, "w1")
	write("a") // a batch flies and nothing is measured yet: wait
	waitQueued(t, s, 1)
	write("k")
	waitQueued(t, s, 2)
	// L writes key "a" too: the queue [a k L] is full; the batch is [a k]
	// (L's key is already in it), and L sends it, its own write left queued.
	go func() {
		_, err := s.Txn(ctx, putReq("a"), []string{"a"})
		results <- result{"L", err}
	}()
	expectArrival(t, kv, "a,k")
	waitQueued(t, s, 1)
	write("c") // [L c]: not full, nothing measured: wait
	waitQueued(t, s, 2)

	// w1 answers: a slot frees and the round trip is measured; the hold is
	// at most that round trip, long passed by the time we look.
	kv.open("w1")
	if r := <-results; r.name != "w1" || r.err != nil {
		t.Fatalf("first answer %v", r)
	}
	select {
	case got := <-kv.arrived:
		t.Logf("sent after the slot freed: %q", got)
	case <-time.After(3 * time.Second):
		st := s.Stats()
		t.Fatalf("3 s after a slot freed (1 of 4 in flight, hold %v, round trip %v), writes c and L (queued %d) were still not sent: "+
			"the wake-up went to the leader of [a k], busy in its own etcd call", st.Hold, st.RoundTrip, s.Queued())
	}
}

// sizeAtMost must bound proto.Size from above (the batch byte limit relies
// on it), but a range op that sets its numeric fields takes more than
// perField bytes beyond its key: a Txn of several such ops is
// underestimated.
func TestReviewSizeAtMostUnderestimatesRangeOps(t *testing.T) {
	rr := &pb.RangeRequest{Key: []byte("k"), RangeEnd: []byte("l"), Limit: -1, Revision: -1,
		SortOrder: pb.RangeRequest_DESCEND, SortTarget: pb.RangeRequest_VALUE, Serializable: true, KeysOnly: true, CountOnly: true,
		MinModRevision: -1, MaxModRevision: -1, MinCreateRevision: -1, MaxCreateRevision: math.MinInt64}
	req := &pb.TxnRequest{}
	for i := 0; i < 100; i++ {
		req.Failure = append(req.Failure, &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: rr}})
	}
	if got, want := sizeAtMost(req), proto.Size(req); got < want {
		t.Fatalf("sizeAtMost %d < encoded size %d", got, want)
	}
}

// Same with valid (non-negative) figures: every numeric field of a range
// op at its largest.
func TestReviewSizeAtMostUnderestimatesMaxRangeOps(t *testing.T) {
	rr := &pb.RangeRequest{Key: []byte("k"), RangeEnd: []byte("l"), Limit: math.MaxInt64, Revision: math.MaxInt64,
		SortOrder: pb.RangeRequest_DESCEND, SortTarget: pb.RangeRequest_VALUE, Serializable: true, KeysOnly: true, CountOnly: true,
		MinModRevision: math.MaxInt64, MaxModRevision: math.MaxInt64, MinCreateRevision: math.MaxInt64, MaxCreateRevision: math.MaxInt64}
	req := &pb.TxnRequest{}
	for i := 0; i < 100; i++ {
		req.Success = append(req.Success, &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: rr}})
	}
	if got, want := sizeAtMost(req), proto.Size(req); got < want {
		t.Fatalf("sizeAtMost %d < encoded size %d", got, want)
	}
}

// manualClock is a Clock whose time the test sets and whose timers fire
// when the test says.
type manualClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []func()
}

func (c *manualClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *manualClock) set(d time.Duration) {
	c.mu.Lock()
	c.now = time.Unix(1000, 0).Add(d)
	c.mu.Unlock()
}
func (c *manualClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timers = append(c.timers, f)
	return func() bool { return false }
}
func (c *manualClock) fire() int {
	c.mu.Lock()
	ts := c.timers
	c.timers = nil
	c.mu.Unlock()
	for _, f := range ts {
		f()
	}
	return len(ts)
}
func (c *manualClock) WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}
func (c *manualClock) Go(ctx context.Context, _ string, f func(context.Context)) { go f(ctx) }
func (c *manualClock) Wait(ctx context.Context, ready <-chan struct{}) error {
	return clock.Real.Wait(ctx, ready)
}

// The same with the default batch limits, through the hold's timer: a
// leader sends [a] while its own write (key a too) stays queued; the hold
// passes and its timer signals that leader, deaf in its etcd call; write c
// waits with two of four slots free and the hold long passed, until the
// unrelated batch [a] answers (or times out: 30 s by default).
func TestReviewHoldTimerWakesOnlyABusyLeader(t *testing.T) {
	kv := newGatedKV(t)
	clk := &manualClock{}
	clk.set(0)
	s := New(Config{KV: kv, Clock: clk, Batching: true,
		Try: func(ctx context.Context) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, time.Minute)
		}})
	ctx := context.Background()
	done := make(chan string, 10)
	write := func(name, key string) {
		go func() {
			s.Txn(ctx, putReq(key), []string{key})
			done <- name
		}()
	}
	defer func() {
		for _, g := range []string{"w2", "a", "c", "a,c"} {
			func() { defer func() { recover() }(); kv.open(g) }()
		}
	}()

	write("w1", "w1") // alone, 1 ms: base and srtt 1 ms, hold 62.5 µs
	expectArrival(t, kv, "w1")
	clk.set(time.Millisecond)
	kv.open("w1")
	if n := <-done; n != "w1" {
		t.Fatal(n)
	}
	clk.set(2 * time.Millisecond)
	write("w2", "w2") // idle: alone, held at etcd
	expectArrival(t, kv, "w2")
	write("A", "a") // the hold has not passed: a timer is armed
	waitQueued(t, s, 1)
	clk.set(3 * time.Millisecond) // the hold passed; its timer not yet run
	write("L", "a")               // L takes [A], its own write (key a) left queued
	expectArrival(t, kv, "a")
	waitQueued(t, s, 1)
	write("C", "c") // hold not passed since L's batch left: waits (timer armed already)
	waitQueued(t, s, 2)
	clk.set(10 * time.Millisecond) // long past the hold
	if clk.fire() == 0 {
		t.Fatal("no hold timer was armed")
	}
	select {
	case got := <-kv.arrived:
		t.Logf("sent once the hold passed: %q", got)
	case <-time.After(3 * time.Second):
		st := s.Stats()
		t.Fatalf("the hold (%v) passed 7 ms ago and its timer fired, 2 of 4 batches fly, yet writes C and L (queued %d) were not sent for 3 s: "+
			"the timer woke only L, busy sending [a]", st.Hold, s.Queued())
	}
}

// randomKV is a real etcd's KV behind a random short delay; a few batches
// are refused as a whole before they are sent (split), and a few lose
// their reply after etcd applied them.
type randomKV struct {
	pb.KVClient
	mu  sync.Mutex
	rnd *rand.Rand
}

func (kv *randomKV) Txn(ctx context.Context, req *pb.TxnRequest, opts ...grpc.CallOption) (*pb.TxnResponse, error) {
	kv.mu.Lock()
	d := time.Duration(kv.rnd.Intn(2000)) * time.Microsecond
	fail := kv.rnd.Intn(50)
	kv.mu.Unlock()
	select {
	case <-time.After(d):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if fail == 0 {
		return nil, rpctypes.ErrTooManyOps
	}
	resp, err := kv.KVClient.Txn(ctx, req, opts...)
	if fail == 1 && err == nil {
		return nil, errors.New("reply lost")
	}
	return resp, err
}

// Many writers, conflicting keys, callers leaving: no write waits forever,
// no batch writes a key twice.
func TestReviewStressNoHang(t *testing.T) {
	for _, members := range []int{1, 2, 3, 64} {
		kv := &randomKV{KVClient: realKV(t), rnd: rand.New(rand.NewSource(int64(members)))}
		s := New(Config{KV: kv, Clock: clock.Real, Batching: true, MaxMembers: members,
			Try: func(ctx context.Context) (context.Context, context.CancelFunc) {
				return context.WithTimeout(ctx, 10*time.Second)
			}})
		var wg sync.WaitGroup
		for g := 0; g < 24; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rnd := rand.New(rand.NewSource(int64(g)))
				for i := 0; i < 150; i++ {
					key := fmt.Sprint("k", rnd.Intn(6))
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rnd.Intn(3000))*time.Microsecond)
					s.Txn(ctx, putReq(key), []string{key})
					cancel()
				}
			}()
		}
		ch := make(chan struct{})
		go func() { wg.Wait(); close(ch) }()
		select {
		case <-ch:
		case <-time.After(60 * time.Second):
			t.Fatalf("MaxMembers %d: writers hung (queued %d)", members, s.Queued())
		}
		t.Logf("MaxMembers %d: %+v", members, s.Stats())
	}
}

var (
	etcdOnce sync.Once
	etcdCli  *clientv3.Client
	etcdErr  error
)

// realKV returns the KV of an embedded one-member etcd, shared by the
// package's tests and closed when they end (TestMain).
func realKV(t *testing.T) pb.KVClient {
	t.Helper()
	etcdOnce.Do(func() {
		dir, err := os.MkdirTemp("", "send-test-")
		if err != nil {
			etcdErr = err
			return
		}
		etcdDir = dir
		if etcdCluster, etcdErr = etcdtest.New(dir, 1, etcdtest.Options{}); etcdErr == nil {
			etcdCli, etcdErr = etcdCluster.Client()
		}
	})
	if etcdErr != nil {
		t.Fatalf("embedded etcd: %v", etcdErr)
	}
	return pb.NewKVClient(etcdCli.ActiveConnection())
}

var (
	etcdCluster *etcdtest.Cluster
	etcdDir     string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if etcdCli != nil {
		etcdCli.Close()
	}
	if etcdCluster != nil {
		etcdCluster.Close()
	}
	if etcdDir != "" {
		os.RemoveAll(etcdDir)
	}
	os.Exit(code)
}
