package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/idem-dev/idem/etcdtest"
)

// load runs n concurrent Do's on distinct keys (each once) and returns the
// tokens they got, by key.
func load(t *testing.T, s *Store, n int, body []byte) map[string]int64 {
	t.Helper()
	ctx := testCtx(t)
	var mu sync.Mutex
	tokens := map[string]int64{}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("k%03d", i)
			res, err := s.Do(ctx, Key{ID: id}, []byte(id), func(ctx context.Context, c *Claim) ([]byte, error) { return body, nil })
			if err != nil {
				t.Errorf("Do %s: %v", id, err)
				return
			}
			mu.Lock()
			tokens[id] = int64(res.Token)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return tokens
}

// Concurrent writes of one store go to etcd in batches: fewer requests than
// writes, keys of one batch sharing a revision, and each key's work done
// once with its own saved outcome.
func TestBatchesUnderLoad(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	tokens := load(t, s, 128, []byte("ok"))
	st := s.Metrics().Batch
	if st.Batches == 0 || st.Members <= st.Batches {
		t.Fatalf("batch stats %+v: 256 writes (claims and completes) of 128 concurrent callers went out one by one", st)
	}
	shared := map[int64]int{}
	for _, tok := range tokens {
		shared[tok]++
	}
	most := 0
	for _, n := range shared {
		most = max(most, n)
	}
	if most < 2 {
		t.Fatalf("no two claims share a revision: no claim went in a batch (stats %+v)", st)
	}
	ctx := testCtx(t)
	for id, tok := range tokens {
		rec, err := s.Get(ctx, Key{ID: id})
		if err != nil || rec.State != Done || string(rec.Outcome.Body) != "ok" || int64(rec.Token) != tok {
			t.Fatalf("%s: %+v, %v; want done with token %d", id, rec, err, tok)
		}
	}
	t.Logf("%d writes in %d batches (%.1f a batch); at most %d claims shared a token", st.Members, st.Batches, float64(st.Members)/float64(st.Batches), most)
}

// Writes of one key never share a batch (etcd refuses a key written twice
// in a request): many callers racing for a key, with completes and
// checkpoints of the winner's claims in flight, get claims, conflicts and
// replays, never an error.
func TestBatchNeverWritesAKeyTwice(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	var wg sync.WaitGroup
	var runs, errs atomic.Int32
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := Key{ID: fmt.Sprintf("hot%d", i%4)}
			_, err := s.Do(ctx, key, []byte("p"), func(ctx context.Context, c *Claim) ([]byte, error) {
				runs.Add(1)
				for n := range 3 {
					if err := c.Checkpoint(ctx, []byte{byte(n)}); err != nil {
						return nil, err
					}
				}
				return []byte("done"), nil
			})
			if err != nil && !errors.Is(err, ErrConflict) {
				errs.Add(1)
				t.Errorf("Do %s: %v", key, err)
			}
		}()
	}
	wg.Wait()
	if runs.Load() != 4 {
		t.Fatalf("works ran %d times for 4 keys; want once each", runs.Load())
	}
}

// A batch etcd refuses as a whole (here: larger than the member's
// --max-request-bytes) is split, and every write lands.
func TestBatchRefusedAsAWholeIsSplit(t *testing.T) {
	c := etcdtest.Start(t, 1, etcdtest.Options{Configure: func(cfg *embed.Config) { cfg.MaxRequestBytes = 64 << 10 }})
	cli := c.MustClient(t)
	s := newStore(t, cli, testPrefix(t), WithBatchLimits(64, 1<<20), WithRecordFormat(2))
	body := []byte(strings.Repeat("x", 6<<10))
	tokens := load(t, s, 48, body)
	if len(tokens) != 48 {
		t.Fatalf("%d of 48 keys done", len(tokens))
	}
	if st := s.Metrics().Batch; st.Split == 0 {
		t.Fatalf("batch stats %+v: etcd refused no batch as too large: nothing was split", st)
	}
}

// A batch whose reply is lost is an unknown outcome for each member: each
// retry recognises its own write, and each key's work runs once.
func TestBatchLostReply(t *testing.T) {
	var lose atomic.Int32
	cli := lossyClient(t, &lose)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	var runs atomic.Int32
	start := make(chan struct{})
	var wg sync.WaitGroup
	lose.Store(3)
	for i := range 48 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			id := fmt.Sprintf("lost%02d", i)
			res, err := s.Do(ctx, Key{ID: id}, []byte(id), func(ctx context.Context, c *Claim) ([]byte, error) {
				runs.Add(1)
				return []byte(id), nil
			})
			if err != nil || string(res.Body) != id {
				t.Errorf("Do %s = %q, %v", id, res.Body, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if lose.Load() > 0 {
		t.Fatal("no reply was lost: the fault did not fire")
	}
	if runs.Load() != 48 {
		t.Fatalf("works ran %d times for 48 keys; want once each", runs.Load())
	}
	if st := s.Metrics().Batch; st.Members <= st.Batches {
		t.Fatalf("batch stats %+v: nothing went in a batch", st)
	}
}

// A key's fencing tokens only grow, batched or not: a takeover in a later
// batch has a greater token than the claim it replaced, which shared its
// own with other keys.
func TestBatchedTokensGrowPerKey(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a := newStore(t, cli, prefix)
	ctx := testCtx(t)
	// Claims of 32 keys in batches; abandon them all.
	var mu sync.Mutex
	first := map[string]int64{}
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("t%02d", i)
			c, _, err := a.Claim(ctx, Key{ID: id}, fpOf(t, "p"))
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			first[id] = int64(c.Token())
			mu.Unlock()
			if err := c.Abandon(ctx); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	// Take them over from another store, in batches too.
	b := newStore(t, cli, prefix)
	for round := 0; round < 2; round++ {
		mu.Lock()
		prev := make(map[string]int64, len(first))
		for id, tok := range first {
			prev[id] = tok
		}
		mu.Unlock()
		for id, tok := range prev {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, _, err := b.Claim(ctx, Key{ID: id}, fpOf(t, "p"))
				if err != nil {
					t.Error(err)
					return
				}
				if int64(c.Token()) <= tok || !c.TookOver() {
					t.Errorf("%s: takeover token %d after %d; want greater", id, c.Token(), tok)
				}
				mu.Lock()
				first[id] = int64(c.Token())
				mu.Unlock()
				c.Abandon(ctx)
			}()
		}
		wg.Wait()
	}
}

// Defect 1: a batched claim whose caller leaves while the batch is in
// flight must not leave the key held. The caller's write has left with a
// batch another caller leads, so the caller waits for its answer (or
// treats it as landed): when the claim lands after the caller has gone,
// the store gives it up, and another process can take the key.
func TestBatchedClaimWhoseCallerLeavesDoesNotHoldTheKey(t *testing.T) {
	prefix := testPrefix(t)
	type who struct{}
	var (
		mu      sync.Mutex
		holdFor string // hold the first Txn that writes this key
		held    = make(chan *pb.TxnRequest, 1)
		leader  = make(chan any, 1) // the held Txn's sender
		release = make(chan struct{}, 1)
	)
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: single.Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				if tr, ok := req.(*pb.TxnRequest); ok {
					mu.Lock()
					hold := holdFor != "" && writesKey(tr, holdFor)
					if hold {
						holdFor = ""
					}
					mu.Unlock()
					if hold {
						leader <- ctx.Value(who{})
						held <- tr
						<-release // sent, not yet applied
					}
				}
				return invoker(ctx, method, req, reply, cc, opts...)
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	a := newStore(t, cli, prefix, WithBatching(true))
	b := newStore(t, client(t), prefix)
	ctx := testCtx(t)
	do := func(ctx context.Context, id string) chan error {
		done := make(chan error, 1)
		go func() {
			_, err := a.Do(context.WithValue(ctx, who{}, id), Key{ID: id}, nil, func(context.Context, *Claim) ([]byte, error) {
				return []byte("x"), nil
			})
			done <- err
		}()
		return done
	}
	holdNext := func(id string) {
		mu.Lock()
		holdFor = id
		mu.Unlock()
	}
	// Until the victim's claim flies in a batch another caller leads:
	// a batch in flight (held), the victim and another caller queued
	// behind it, and whichever of them takes the next batch leads it.
	for trial := 0; ; trial++ {
		if trial == 50 {
			t.Fatal("in 50 trials the victim always led its own batch: the test could not set itself up")
		}
		blk, victim, other := fmt.Sprintf("blk%d", trial), fmt.Sprintf("left%d", trial), fmt.Sprintf("other%d", trial)
		holdNext(blk)
		blkDone := do(ctx, blk)
		<-held
		<-leader
		// The first Txn that carries the victim's claim is held, whichever
		// batch it flies in: one queued behind the held blocker, or one
		// sent beside it once the batch hold passed (group commit sends a
		// further batch then; the victim and the other caller need not
		// stay queued).
		holdNext(victim)
		vctx, leave := context.WithCancel(ctx)
		vDone, oDone := do(vctx, victim), do(ctx, other)
		blocked := true
		unblock := func() {
			if blocked {
				blocked = false
				release <- struct{}{} // the blocker lands; the next batch forms
			}
		}
		var tr *pb.TxnRequest
		for tr == nil {
			select {
			case tr = <-held:
			default:
				// Both queued behind the blocker, or one of them gone on:
				// let the blocker land, and the next batch form.
				if a.kv.Queued() >= 2 || len(vDone) > 0 || len(oDone) > 0 {
					unblock()
				}
				runtime.Gosched() // polling a condition
			}
		}
		lead := <-leader
		if lead == victim || !writesKey(tr, other) {
			// The victim leads (it waits in its own send) or flies without
			// the other: not the case under test. Let it land and try again.
			release <- struct{}{}
			unblock()
			leave()
			<-vDone
			<-oDone
			<-blkDone
			continue
		}
		leave()               // the victim's caller goes while its claim flies
		release <- struct{}{} // and the claim lands after
		unblock()
		<-vDone // an error, or the outcome of work that ran although its caller left
		<-oDone
		<-blkDone
		settle(t, a)
		c, _, err := b.Claim(ctx, Key{ID: victim}, fpOf(t, ""))
		switch {
		case errors.Is(err, ErrConflict):
			t.Fatalf("trial %d: the key is held after its caller left: %v", trial, err)
		case err != nil:
			t.Fatal(err)
		case c != nil:
			c.Release(ctx)
		}
		return
	}
}

// writesKey reports whether a Txn (or a batch of them) puts a record whose
// key ends in id.
func writesKey(tr *pb.TxnRequest, id string) bool {
	for _, op := range append(append([]*pb.RequestOp(nil), tr.Success...), tr.Failure...) {
		if p := op.GetRequestPut(); p != nil && strings.HasSuffix(string(p.Key), id) {
			return true
		}
		if in := op.GetRequestTxn(); in != nil && writesKey(in, id) {
			return true
		}
	}
	return false
}
