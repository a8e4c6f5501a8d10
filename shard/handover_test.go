package shard

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// Found by review, now fixed: a change is installed while the shards that record the set in
// force do not answer, and a key runs twice.
//
// ARCHITECTURE.md ("Shards", "Changing the set"): "A process whose file asks
// for a newer generation installs it by one compare-and-set on the arbiter
// of the set in force ... The change is installed only when it is safe";
// OPERATIONS.md: "A change needs its arbiter ... If it does not answer, the
// change waits; keys are served as before", and "A key the new shard wins
// is first looked up on its old shard".
//
// What happened: generation 1 (placement [b c]) is in force, recorded on b
// (its arbiter) and c, and key k is done on its shard there. Shard a is
// added (generation 2, placement [a b c]). A process of generation 2
// starts while b and c do not answer (a restart during a network blip to
// them): it connects to a only, finds no set on a, treats that as "no set
// in force anywhere" (the upgrade-from-0.4 case) and installs its own set
// on a, its own set's arbiter, as a first set: generation 2 with no
// previous placement, so no hand-over at all. It then claims k straight on
// a, where [a b c] places it, and runs its work a second time; the first
// outcome is never replayed. (Once b and c answer again, its next writes
// there would carry this set to them, and teach it to the generation-1
// processes.)
//
// Now a first set is installed only when every configured shard answers
// and records none.
func TestChangeInstalledWhileTheSetInForceIsUnreachable(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	gen1 := open(t, prefix, 1, []string{"b", "c"}, nil, 0, 1, "b", "c")
	k := keyOn(Placement{Shards: []string{"a", "b", "c"}}, "a", 0)
	var runs atomic.Int32
	work := func(context.Context, *etcdstore.Claim) ([]byte, error) {
		n := runs.Add(1)
		return []byte("charged " + string(rune('0'+n))), nil
	}
	if res, err := gen1.Do(ctx, k, nil, work); err != nil || string(res.Body) != "charged 1" {
		t.Fatalf("%s under generation 1: %q, %v", k, res.Body, err)
	}
	old := gen1.Place(k)

	// b and c do not answer when the generation-2 process starts.
	var down atomic.Bool
	down.Store(true)
	connect := func(n string) func(context.Context) (*clientv3.Client, error) {
		return func(context.Context) (*clientv3.Client, error) {
			if down.Load() {
				return nil, errors.New("test: shard " + n + " does not answer")
			}
			return clientv3.New(clientv3.Config{Endpoints: clusters[n].Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		}
	}
	cfg := Config{
		Placement: Placement{Shards: []string{"a", "b", "c"}}, Generation: 2,
		Shards: []Shard{
			{Name: "a", Client: lossy(t, "a", 0, 7)},
			{Name: "b", Connect: connect("b")},
			{Name: "c", Connect: connect("c")},
		},
		Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond,
	}
	gen2, err := New(ctx, cfg, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gen2.Close() })
	st := gen2.Status()
	t.Logf("generation-2 process with b and c down: in force %+v, pending %q", st.InForce, st.Pending)

	res, err := gen2.Do(ctx, k, nil, work)
	if runs.Load() > 1 {
		t.Fatalf("%s (done on %s under generation 1) through a generation-2 process started while b and c were down: "+
			"the work ran again (%q, %v); the set in force was generation %d with previous %v, installed on a without its arbiter b. "+
			"Want the change to wait for b (ErrUnavailable for k) or the first outcome replayed",
			k, old, res.Body, err, st.InForce.Generation, st.InForce.Previous)
	}
	if err == nil && string(res.Body) != "charged 1" {
		t.Fatalf("%s: %q; want the first outcome", k, res.Body)
	}
}

// delayedClient is a client of cluster n whose Txns that write key are held,
// once armed, until release is closed (or 10 s), then sent: a request that
// left the process and is applied later (a slow link, a proposal that waits
// for its leader).
func delayedClient(t testing.TB, n string, key string, armed *atomic.Bool, held chan<- struct{}, release <-chan struct{}) *clientv3.Client {
	t.Helper()
	var once sync.Once
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: clusters[n].Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				if strings.HasSuffix(method, "/Txn") && armed.Load() {
					if m, ok := req.(proto.Message); ok {
						if b, err := proto.Marshal(m); err == nil && bytes.Contains(b, []byte(key)) && armed.CompareAndSwap(true, false) {
							once.Do(func() { close(held) })
							select {
							case <-release:
							case <-time.After(10 * time.Second):
							}
							return invoker(context.WithoutCancel(ctx), method, req, reply, cc, opts...)
						}
					}
				}
				return invoker(ctx, method, req, reply, cc, opts...)
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// Found by review, now fixed: a shard is marked drained while a takeover of a key placed
// elsewhere is on its way to it, and the key is then claimed on two shards.
//
// ARCHITECTURE.md ("Shards", "The drain"): "A shard that holds no live
// record of a key the set places elsewhere ... is marked drained for the
// generation, and processes stop asking it about those keys. It can never
// hold such a record again under this set: it records the set (older
// processes are refused there) and a claim there takes only a live record."
// And the invariant: "at most one of the two can grant a claim of it".
//
// What happened: k (placed on b by generation 2, claimed on a under
// generation 1) has an abandoned record on a, live for one more second. A
// generation-2 process X routes k to a (Forward finds the live record),
// reads it, and sends its takeover Txn (WithoutCreate: the record was live
// when read), whose record lives a retention from X's read. The Txn is
// slow to arrive (held here about a second, well within X's request
// timeout). Meanwhile the old record's retention passes (plus the drain's
// skew), another process's drain lists a, finds no live record of a key
// placed elsewhere, and marks a drained. Then X's Txn is applied: it
// compares only the record's revision, the epoch and the set, none of
// which changed, so X takes k over on a, with a record live for seconds
// more, and runs it. Every process now goes to b for k (a is drained) and
// claims it there: k runs a second time, and has live records on a and b.
// "Live" is judged by the claimant's clock when it read, not when its
// write lands, and the drain mark is not among the claim's compares.
//
// Now the drain deletes such an expired record (if it is still the one it
// listed) before it marks the shard: the takeover then finds nothing.
func TestDrainRacesATakeoverInFlight(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	const retention = 4 * time.Second
	before, after := Placement{Shards: []string{"a", "c"}}, Placement{Shards: []string{"a", "b", "c"}}
	gen1 := openRetention(t, prefix, retention, 1, before.Shards, "a", "b", "c")
	inForce(t, gen1, 1)
	// movedFrom returns a key generation 1 places on from and generation 2
	// on b.
	movedFrom := func(from string) etcdstore.Key {
		for i := 0; ; i++ {
			if k := (etcdstore.Key{ID: "k" + strconv.Itoa(i)}); before.place(k) == from && after.place(k) == "b" {
				return k
			}
		}
	}
	k := movedFrom("a")
	// A key done on c under generation 1, kept a minute: c is not drained
	// while the test runs, so the hand-over is not settled (settling
	// writes the set again, which would refuse the takeover in flight by
	// itself, but only on the shards it reaches first).
	keeper, err := New(ctx, Config{Placement: before, Generation: 1, Check: time.Hour, Shards: []Shard{
		{Name: "a", Client: lossy(t, "a", 0, 31)}, {Name: "b", Client: lossy(t, "b", 0, 32)},
		{Name: "c", Client: lossy(t, "c", 0, 33), Options: []etcdstore.Option{etcdstore.WithRetention(time.Minute)}},
	}}, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { keeper.Close() })
	if _, err := keeper.Do(ctx, movedFrom("c"), nil, func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("kept"), nil }); err != nil {
		t.Fatal(err)
	}
	fp, err := etcdstore.FingerprintOf(nil)
	if err != nil {
		t.Fatal(err)
	}
	c, _, err := gen1.Claim(ctx, k, fp)
	if err != nil {
		t.Fatal(err)
	}
	gen2 := openRetention(t, prefix, retention, 2, after.Shards, "a", "b", "c")
	inForce(t, gen2, 2)

	// X: a process of generation 2 whose Txns writing k on a can be slow.
	var armed atomic.Bool
	held, release := make(chan struct{}), make(chan struct{})
	cfg := Config{Placement: after, Generation: 2, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond,
		Shards: []Shard{
			{Name: "a", Client: delayedClient(t, "a", prefix+"k/default/"+k.ID, &armed, held, release)},
			{Name: "b", Client: lossy(t, "b", 0, 9)},
			{Name: "c", Client: lossy(t, "c", 0, 10)},
		}}
	x, err := New(ctx, cfg, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second),
		etcdstore.WithRetention(retention), etcdstore.WithBucketWidth(retention), etcdstore.WithRequestTimeout(40*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	inForce(t, x, 2)

	// The claim under generation 1 is given up: the next claimant takes
	// it over at once. Its record on a lives one retention from now.
	if err := c.Abandon(ctx); err != nil {
		t.Fatal(err)
	}
	rec, err := gen2.Shard("a").Get(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// X comes for k a second before that record expires: it finds it
	// live, and its takeover's record lives a retention from its read.
	time.Sleep(time.Until(rec.Expires.Add(-time.Second)))
	var runs atomic.Int32
	work := func(_ context.Context, c *etcdstore.Claim) ([]byte, error) {
		runs.Add(1)
		return []byte("charged"), nil
	}
	armed.Store(true)
	xdone := make(chan error, 1)
	go func() {
		_, err := x.Do(ctx, k, nil, work)
		xdone <- err
	}()
	select {
	case <-held:
	case err := <-xdone:
		t.Fatalf("X's Do ended before its takeover was sent: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("X's takeover of k on a was never sent")
	}
	// While X's takeover is on its way, a is drained by gen2.
	deadline := time.Now().Add(15 * time.Second)
	for !contains(gen2.Status().Drained, "a") {
		if time.Now().After(deadline) {
			close(release)
			t.Skipf("a was not marked drained while the takeover was held (pending %q): nothing to show", gen2.Status().Pending)
		}
		time.Sleep(20 * time.Millisecond) // polling gen2's view
	}
	close(release)
	if err := <-xdone; err != nil {
		t.Logf("X's Do of %s: %v", k, err)
	}
	// A retry through gen2, which knows a is drained.
	_, gerr := gen2.Do(ctx, k, nil, work)
	live := []string{}
	if gen2.Status().InForce.Settled {
		t.Fatal("the hand-over was settled meanwhile: the test shows nothing")
	}
	for _, n := range []string{"a", "b"} {
		if rec, err := gen2.Shard(n).Get(ctx, k); err == nil && rec.State != etcdstore.Moved {
			live = append(live, n+":"+string(rec.State))
		}
	}
	if runs.Load() > 1 || len(live) > 1 {
		t.Fatalf("%s ran %d times and has live records %v (gen2's retry: %v): a was marked drained for generation 2 "+
			"while a takeover of a key placed on b was on its way to it; the takeover landed after the mark", k, runs.Load(), live, gerr)
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// Found by review, now fixed: Check, behind /readyz, is not bounded by its timeout when one
// shard hangs and a change is waiting.
//
// shard.Store.Check: "asks every shard, at once and each within timeout
// ... a shard that hangs costs its own answer only"; ARCHITECTURE.md:
// "/readyz asks every shard at once, each within its own deadline";
// OPERATIONS.md: "/readyz asks every shard at once, each within 2 s, stays
// 200 while one answers".
//
// What happened: after the per-shard checks, Check calls refresh with the
// caller's context, unbounded; while this process's file asks for a set
// that waits for a drain, refresh reads the old shard's drain mark, and
// with that shard hung the read takes the store's whole request timeout.
// Check (and /readyz) answers after the request timeout, not the 300 ms
// asked for: with Kubernetes' probe timeout the pod leaves its Service
// although the other shards answer.
//
// Now Check only reads each shard's set, each within the timeout.
func TestCheckIsBoundedWithAHungShard(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	gen1 := open(t, prefix, 1, []string{"a"}, nil, 0, 1, "a", "b")
	k := keyOn(Placement{Shards: []string{"a", "b"}}, "b", 0)
	fp, err := etcdstore.FingerprintOf(nil)
	if err != nil {
		t.Fatal(err)
	}
	// A live claim on a of a key generation 2 places on b: a is not
	// drained for generation 2 while it runs.
	if _, _, err := gen1.Claim(ctx, k, fp); err != nil {
		t.Fatal(err)
	}
	gen2 := open(t, prefix, 2, []string{"a", "b"}, nil, 0, 2, "a", "b")
	inForce(t, gen2, 2)

	proxy, ca := proxied(t, "a")
	// A process whose file asks for generation 3 (c added): it waits for
	// a's drain.
	p, err := New(ctx, Config{Placement: Placement{Shards: []string{"a", "b", "c"}}, Generation: 3, Check: time.Hour,
		Shards: []Shard{{Name: "a", Client: ca}, {Name: "b", Client: lossy(t, "b", 0, 3)}, {Name: "c", Client: lossy(t, "c", 0, 4)}}},
		etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second), etcdstore.WithRequestTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if st := p.Status(); st.InForce.Generation != 2 || !strings.Contains(st.Pending, "drained") {
		t.Fatalf("in force %d, pending %q; want generation 3 waiting for a's drain", st.InForce.Generation, st.Pending)
	}
	proxy.Blackhole() // a hangs
	const timeout = 300 * time.Millisecond
	began := time.Now()
	checks := p.Check(ctx, timeout)
	took := time.Since(began)
	t.Logf("Check(%v) with a hung: %v in %v", timeout, checks, took.Round(time.Millisecond))
	if checks["b"] != nil || checks["c"] != nil || checks["a"] == nil {
		t.Fatalf("checks %v; want a failing, b and c answering", checks)
	}
	if took > timeout+time.Second {
		t.Fatalf("Check(%v) took %v with shard a hung and a change waiting: the refresh after the checks is bounded by nothing but the request timeout", timeout, took.Round(time.Millisecond))
	}
}

// Found by review, now fixed: a shard retired as OPERATIONS.md says, then removed from the
// shards file, makes the keys it handed over unavailable, and blocks every
// later change.
//
// OPERATIONS.md ("Retiring a shard"): "Once idem status shows it drained
// for the new generation, remove it from shards: (a change of endpoints
// only) and decommission its cluster." ARCHITECTURE.md: "processes stop
// asking it about those keys", and "add, retire, roll back and add again
// are safe in any order, with no time to wait between them but the drain".
//
// What happened: generation 2 retires b (placement [a], previous [a b]); b
// holds nothing and is marked drained at once. A process whose file no
// longer lists b (generation 2, the same placement: only an endpoint
// removed) cannot learn that b was drained (the mark is in b's etcd, and it
// has no connection to b), so every key generation 2 moved from b to a
// goes through b first and fails with ErrUnavailable ("the shard set in
// force names it, and this process has no connection settings for it").
// And a later change (generation 3, adding c) never goes in force: the set
// in force still names b in its previous placement, and installing needs
// b's drain mark and b's epoch ("shard b does not answer, and its epoch is
// needed for the change").
//
// Now, once every old shard is drained, the set in force is settled
// (Set.Settled): no process asks the old shards again, nor needs them for
// the next change. OPERATIONS.md says to wait for it before removing a
// shard from the file.
func TestRetiredShardRemovedFromTheFile(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	open(t, prefix, 1, []string{"a", "b"}, nil, 0, 1, "a", "b")
	gen2 := open(t, prefix, 2, []string{"a"}, nil, 0, 2, "a", "b")
	inForce(t, gen2, 2)
	deadline := time.Now().Add(30 * time.Second)
	for !gen2.Status().InForce.Settled {
		if time.Now().After(deadline) {
			t.Fatalf("generation 2 not settled (b drained): %+v", gen2.Status())
		}
		time.Sleep(20 * time.Millisecond) // gen2's drain runs every 100 ms
	}
	// The operator removes b from shards: (its cluster is decommissioned).
	without := open(t, prefix, 2, []string{"a"}, nil, 0, 3, "a")
	inForce(t, without, 2)
	k := keyOn(Placement{Shards: []string{"a", "b"}}, "b", 0) // moved from b to a by generation 2
	res, err := without.Do(ctx, k, nil, func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("ok"), nil })
	if err != nil {
		t.Errorf("%s (generation 2 moved it from b, which was drained) through a process whose file no longer lists b: %v; want it served on a", k, err)
	} else if string(res.Body) != "ok" {
		t.Errorf("%s: %q", k, res.Body)
	}
	// The next change: c is added.
	gen3 := open(t, prefix, 3, []string{"a", "c"}, nil, 0, 4, "a", "c")
	deadline = time.Now().Add(5 * time.Second)
	for {
		if set, _ := gen3.current(); set.Generation == 3 {
			break
		}
		if time.Now().After(deadline) {
			st := gen3.Status()
			t.Errorf("generation 3 (c added, after b was retired, drained and removed from the file) not in force after 5 s: in force %d, pending %q",
				st.InForce.Generation, st.Pending)
			break
		}
		gen3.refresh(ctx)
		time.Sleep(50 * time.Millisecond) // polling the process's view
	}
}
