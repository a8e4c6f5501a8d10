package shard

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/storex"
)

// Three one-member clusters, a, b and c, shared by the package's tests;
// each test works under a prefix of its own.
var clusters = map[string]*etcdtest.Cluster{}

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idem-shard-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := func() int {
		defer os.RemoveAll(dir)
		for _, n := range []string{"a", "b", "c"} {
			c, err := etcdtest.New(dir+"/"+n, 1, etcdtest.Options{})
			if err != nil {
				fmt.Fprintln(os.Stderr, "start etcd:", err)
				return 1
			}
			defer c.Close()
			clusters[n] = c
		}
		return m.Run()
	}()
	os.Exit(code)
}

var prefixSeq atomic.Int64

func testPrefix(t testing.TB) string {
	return fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// lossy is a client of cluster n whose Txns, at rate, are applied and then
// lose their reply.
func lossy(t testing.TB, n string, rate float64, seed uint64) *clientv3.Client {
	t.Helper()
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, seed^0x1234))
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: clusters[n].Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				err := invoker(ctx, method, req, reply, cc, opts...)
				mu.Lock()
				lose := strings.HasSuffix(method, "/Txn") && rng.Float64() < rate
				mu.Unlock()
				if err == nil && lose {
					return status.Error(codes.Unavailable, "test: reply lost")
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

// proxied is a client of cluster n through a proxy the test can cut.
func proxied(t testing.TB, n string) (*etcdtest.Proxy, *clientv3.Client) {
	t.Helper()
	proxy, err := etcdtest.NewProxy(strings.TrimPrefix(clusters[n].Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{proxy.URL()}, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return proxy, cli
}

// open makes a shard store over the named clusters (a client each) that
// asks for placement at generation gen.
func open(t testing.TB, prefix string, gen int64, placement []string, previous []string, rate float64, seed uint64, names ...string) *Store {
	t.Helper()
	cfg := Config{Placement: Placement{Shards: placement}, Generation: gen, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond}
	if previous != nil {
		cfg.Previous = &Placement{Shards: previous}
	}
	for i, n := range names {
		cfg.Shards = append(cfg.Shards, Shard{Name: n, Client: lossy(t, n, rate, seed+uint64(i))})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := New(ctx, cfg, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// inForce waits until s follows generation gen.
func inForce(t testing.TB, s *Store, gen int64) Set {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if set, ok := s.current(); ok && set.Generation == gen {
			return set
		}
		if time.Now().After(deadline) {
			set, _ := s.current()
			t.Fatalf("generation %d is not in force after 30 s: %d is (pending: %s)", gen, set.Generation, s.Status().Pending)
		}
		s.refresh(testCtx(t))
		time.Sleep(20 * time.Millisecond) // polling a process's view of etcd
	}
}

// Placement spreads keys evenly, moves only the keys a new shard wins, honours
// pins, and never changes (the hash is part of the format).
func TestPlacement(t *testing.T) {
	two := Placement{Shards: []string{"a", "b"}}
	three := Placement{Shards: []string{"a", "b", "c"}}
	count := map[string]int{}
	const n = 30000
	for i := 0; i < n; i++ {
		k := etcdstore.Key{ID: "k" + strconv.Itoa(i)}
		home := three.place(k)
		count[home]++
		if before := two.place(k); before != home && home != "c" {
			t.Fatalf("%s moved from %s to %s when c was added: only keys c wins may move", k, before, home)
		}
	}
	for _, s := range []string{"a", "b", "c"} {
		if share := float64(count[s]) / n; share < 0.30 || share > 0.37 {
			t.Errorf("shard %s holds %.1f%% of the keys; want about a third", s, 100*share)
		}
	}
	pinned := Placement{Shards: []string{"a", "b", "c"}, Pin: map[string]string{"acme": "b"}}
	for i := 0; i < 100; i++ {
		if got := pinned.place(etcdstore.Key{Tenant: "acme", ID: strconv.Itoa(i)}); got != "b" {
			t.Fatalf("a key of pinned tenant acme placed on %s", got)
		}
	}
	// The placement is part of the data format: every process, of every
	// version, must agree.
	var golden []string
	for i := 0; i < 12; i++ {
		golden = append(golden, three.place(etcdstore.Key{ID: "k" + strconv.Itoa(i)}))
	}
	if got := strings.Join(golden, ""); got != placementGolden {
		t.Fatalf("placement of k0..k11 over a,b,c = %s; it must never change (want %s)", got, placementGolden)
	}
}

// placementGolden is where k0..k11 of tenant default live over shards a, b
// and c. A change of the hash would move every key: never change it.
const placementGolden = "accacacaabab"

// Each key lives on its shard, with every rule of one store: one run,
// replays, mismatches; the records are on the placed shard only.
func TestRulesPerKey(t *testing.T) {
	prefix := testPrefix(t)
	s := open(t, prefix, 1, nil, nil, 0, 1, "a", "b", "c")
	ctx := testCtx(t)
	runs := map[string]int{}
	var mu sync.Mutex
	for i := 0; i < 60; i++ {
		k := etcdstore.Key{ID: "k" + strconv.Itoa(i)}
		for try := 0; try < 2; try++ {
			res, err := s.Do(ctx, k, []byte(`{"n":1}`), func(context.Context, *etcdstore.Claim) ([]byte, error) {
				mu.Lock()
				runs[k.ID]++
				mu.Unlock()
				return []byte("out " + k.ID), nil
			})
			if err != nil || string(res.Body) != "out "+k.ID || res.Replayed != (try == 1) {
				t.Fatalf("%s try %d: %q replayed=%v, %v", k, try, res.Body, res.Replayed, err)
			}
		}
		if _, err := s.Do(ctx, k, []byte(`{"n":2}`), nil); !errors.Is(err, etcdstore.ErrMismatch) {
			t.Fatalf("%s with other params: %v", k, err)
		}
		for _, n := range s.Shards() {
			_, err := s.Shard(n).Get(ctx, k)
			if here := err == nil; here != (n == s.Place(k)) {
				t.Fatalf("%s on shard %s: %v (placed on %s)", k, n, err, s.Place(k))
			}
		}
	}
	for k, n := range runs {
		if n != 1 {
			t.Fatalf("%s ran %d times", k, n)
		}
	}
	if recs, err := s.List(ctx, "", etcdstore.ListOptions{Limit: 1000}); err != nil || len(recs) != 60 {
		t.Fatalf("List over the shards = %d records, %v; want 60", len(recs), err)
	}
}

// The hand-over: processes that place keys on a and b (generation 1) run a
// workload; a third of the way in, processes that add shard c (generation
// 2) start and install their set, and every process learns it on its next
// write. Txns lose a tenth of their replies. Every key's work takes effect
// once, every caller gets the one saved outcome, no key has a live record
// on two shards; then the set is drained (a and b hold no live record of a
// key c now holds), and a third generation without the hand-over finds
// every key where it is, replayed.
func TestHandOver(t *testing.T) {
	handOver(t, nil)
}

// The same while shard c is a three-member cluster whose leader is cut
// off from the others in the middle of the run, then healed.
func TestHandOverWhileALeaderIsCut(t *testing.T) {
	three, err := etcdtest.New(t.TempDir(), 3, etcdtest.Options{Proxies: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(three.Close)
	saved := clusters["c"]
	clusters["c"] = three
	t.Cleanup(func() { clusters["c"] = saved })
	handOver(t, func(ctx context.Context) error {
		lead, err := three.WaitLeader(ctx, three.All())
		if err != nil {
			return err
		}
		if err := three.Isolate(lead); err != nil {
			return err
		}
		if _, err := three.WaitLeader(ctx, others(3, lead), lead); err != nil {
			return err
		}
		three.Heal()
		return nil
	})
}

func others(n, except int) []int {
	var out []int
	for i := 0; i < n; i++ {
		if i != except {
			out = append(out, i)
		}
	}
	return out
}

// handOver runs the hand-over workload, with fault applied once a third of
// the operations are done, and checks its invariants.
func handOver(t *testing.T, fault func(context.Context) error) {
	prefix := testPrefix(t)
	var rmu sync.Mutex
	routers := []*Store{
		open(t, prefix, 1, []string{"a", "b"}, nil, 0.1, 10, "a", "b", "c"),
		open(t, prefix, 1, []string{"a", "b"}, nil, 0.1, 11, "a", "b", "c"),
	}
	pick := func(rng *rand.Rand) *Store {
		rmu.Lock()
		defer rmu.Unlock()
		return routers[rng.IntN(len(routers))]
	}
	ctx := testCtx(t)
	const keys, workers = 120, 16
	var mu sync.Mutex
	effects := map[string]int{}
	highest := map[string]fencing.Token{}
	answers := map[string]map[string]bool{}
	var done atomic.Int64
	faultAt := make(chan struct{})
	var once sync.Once
	faulted := make(chan error, 1)
	var over atomic.Bool    // the change and the fault have run their course: workers may stop
	var changed atomic.Bool // generation 2 is in force
	go func() {
		<-faultAt
		// The change: processes of generation 2 start.
		for i := 0; i < 2; i++ {
			cfg := Config{Placement: Placement{Shards: []string{"a", "b", "c"}}, Generation: 2, Check: 100 * time.Millisecond, Skew: 100 * time.Millisecond}
			for j, n := range []string{"a", "b", "c"} {
				cfg.Shards = append(cfg.Shards, Shard{Name: n, Client: lossy(t, n, 0.1, uint64(20+10*i+j))})
			}
			r, err := New(ctx, cfg, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
			if err != nil {
				over.Store(true)
				faulted <- err
				return
			}
			t.Cleanup(func() { r.Close() })
			rmu.Lock()
			routers = append(routers, r)
			rmu.Unlock()
		}
		changed.Store(true)
		var err error
		if fault != nil {
			err = fault(ctx)
		}
		over.Store(true)
		faulted <- err
	}()
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			// Every worker runs keys operations, and more while the change
			// and the fault are under way, so that they happen in the
			// middle of the work.
			for op := 0; op < keys || !over.Load(); op++ {
				if done.Add(1) == keys*workers/3 {
					once.Do(func() { close(faultAt) })
				}
				// Before the change, only the first half of the keys: the
				// others are first claimed after it, and those c wins are
				// handed over by a Moved record.
				n := keys
				if !changed.Load() {
					n = keys / 2
				}
				k := etcdstore.Key{ID: "k" + strconv.Itoa(rng.IntN(n))}
				r := pick(rng)
				for try := 0; try < 200; try++ {
					res, err := r.Do(ctx, k, []byte(`{}`), func(_ context.Context, c *etcdstore.Claim) ([]byte, error) {
						mu.Lock()
						defer mu.Unlock()
						if c.Token() < highest[k.ID] {
							return nil, errors.New("fenced downstream") // a stale token: refused
						}
						highest[k.ID] = c.Token()
						effects[k.ID]++
						return []byte(fmt.Sprintf("%s by %d", k.ID, c.Token())), nil
					})
					if err == nil {
						mu.Lock()
						if answers[k.ID] == nil {
							answers[k.ID] = map[string]bool{}
						}
						answers[k.ID][string(res.Body)] = true
						mu.Unlock()
						break
					}
					if !errors.Is(err, etcdstore.ErrConflict) && !errors.Is(err, etcdstore.ErrUnavailable) {
						t.Errorf("%s: %v", k, err)
						return
					}
					time.Sleep(20 * time.Millisecond) // a client's retry backoff
				}
			}
		}()
	}
	wg.Wait()
	once.Do(func() { close(faultAt) })
	if err := <-faulted; err != nil {
		t.Fatalf("the change or the fault: %v", err)
	}
	moved := 0
	for i := 0; i < keys; i++ {
		id := "k" + strconv.Itoa(i)
		k := etcdstore.Key{ID: id}
		if effects[id] > 1 {
			t.Errorf("%s took effect %d times", id, effects[id])
		}
		if len(answers[id]) > 1 {
			t.Errorf("%s answered %v: more than one outcome", id, answers[id])
		}
		live := 0
		for _, n := range []string{"a", "b", "c"} {
			rec, err := routers[0].Shard(n).Get(ctx, k)
			switch {
			case err == nil && rec.State == etcdstore.Moved:
				moved++
			case err == nil:
				live++
			case !errors.Is(err, etcdstore.ErrNotFound):
				t.Fatalf("%s on %s: %v", id, n, err)
			}
		}
		if live > 1 {
			t.Errorf("%s has live records on %d shards", id, live)
		}
	}
	t.Logf("%d keys, %d handed over to c through a Moved record", keys, moved)
	if moved == 0 {
		t.Fatal("no key was handed over: the test did not exercise the hand-over")
	}
	// Every process follows generation 2. Keys that stayed on a or b keep
	// the hand-over going until their records end: here, never within the
	// test (a day's retention), so a third generation without the
	// hand-over waits, and says why.
	for _, r := range routers {
		inForce(t, r, 2)
	}
	third := open(t, prefix, 3, []string{"a", "b", "c"}, nil, 0, 40, "a", "b", "c")
	if st := third.Status(); st.InForce.Generation != 2 || !strings.Contains(st.Pending, "drained") {
		t.Fatalf("generation 3 over an undrained hand-over: in force %d, pending %q; want 2, waiting for the drain", st.InForce.Generation, st.Pending)
	}
	ran := 0
	for i := 0; i < keys; i++ {
		k := etcdstore.Key{ID: "k" + strconv.Itoa(i)}
		if effects[k.ID] == 0 {
			continue // no worker drew it (a slow change leaves few draws of the later keys)
		}
		ran++
		res, err := third.Do(ctx, k, []byte(`{}`), func(context.Context, *etcdstore.Claim) ([]byte, error) {
			return nil, fmt.Errorf("%s ran again", k)
		})
		if err != nil || !res.Replayed {
			var where []string
			for _, n := range []string{"a", "b", "c"} {
				rec, gerr := routers[0].Shard(n).Get(ctx, k)
				if gerr != nil {
					where = append(where, n+": "+gerr.Error())
				} else {
					where = append(where, fmt.Sprintf("%s: %s token %d", n, rec.State, rec.Token))
				}
			}
			t.Fatalf("%s through a process asking for generation 3: %v (replayed %v); want its outcome replayed (it took effect %d times; records %v; third: %+v)",
				k, err, res.Replayed, effects[k.ID], where, third.Status())
		}
	}
	if ran < keys*3/4 {
		t.Fatalf("only %d of %d keys ran: the workload did not exercise the hand-over", ran, keys)
	}
}

// A key that moves keeps strictly increasing tokens, though the new
// cluster's revisions are lower: its new shard's epoch is raised above the
// old one's.
func TestTokensGrowAcrossAMove(t *testing.T) {
	prefix := testPrefix(t)
	old := open(t, prefix, 1, []string{"a"}, nil, 0, 1, "a", "b")
	ctx := testCtx(t)
	if _, err := storex.RaiseEpoch(old.Shard("a"), ctx, 4); err != nil { // as after earlier moves
		t.Fatal(err)
	}
	// Find a key the new placement puts on b.
	var k etcdstore.Key
	nw := Placement{Shards: []string{"a", "b"}}
	for i := 0; ; i++ {
		if k = (etcdstore.Key{ID: "k" + strconv.Itoa(i)}); nw.place(k) == "b" {
			break
		}
	}
	res, err := old.Do(ctx, etcdstore.Key{ID: "other"}, nil, func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("x"), nil })
	if err != nil {
		t.Fatal(err)
	}
	onA := res.Token
	if onA>>storex.EpochShift != 5 {
		t.Fatalf("token %d on a: epoch %d; want 5", onA, onA>>storex.EpochShift)
	}
	moving := open(t, prefix, 2, []string{"a", "b"}, nil, 0, 2, "a", "b")
	res, err = moving.Do(ctx, k, nil, func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("y"), nil })
	if err != nil {
		t.Fatal(err)
	}
	if res.Token <= onA || res.Token>>storex.EpochShift <= 5 {
		t.Fatalf("token on b %d (epoch %d) after the move; want above a's %d (epoch 5)", res.Token, res.Token>>storex.EpochShift, onA)
	}
	if rec, err := moving.Shard("a").Get(ctx, k); err != nil || rec.State != etcdstore.Moved || rec.MovedTo != "b" {
		t.Fatalf("a's record of %s = %+v, %v; want Moved to b", k, rec, err)
	}
	// A process configured with the old placement learns the set in
	// force from a's answer, and finds the key on b.
	if res2, err := old.Do(ctx, k, nil, nil); err != nil || !res2.Replayed || string(res2.Body) != "y" {
		t.Fatalf("old placement: %q replayed=%v, %v; want b's outcome", res2.Body, res2.Replayed, err)
	}
	if set, _ := old.current(); set.Generation != 2 {
		t.Fatalf("the old process follows generation %d; want 2", set.Generation)
	}
}

// A store whose cached epoch is stale claims under the shard's current one:
// its Txn's compare fails, it reads the epoch, and tries again.
func TestStaleEpochIsCaught(t *testing.T) {
	prefix := testPrefix(t)
	a1 := open(t, prefix, 1, nil, nil, 0, 1, "a")
	a2 := open(t, prefix, 1, nil, nil, 0, 2, "a")
	ctx := testCtx(t)
	if storex.Epoch(a2.Shard("a")) != 0 {
		t.Fatal("a fresh shard has an epoch")
	}
	if e, err := storex.RaiseEpoch(a1.Shard("a"), ctx, 2); err != nil || e != 3 {
		t.Fatalf("RaiseEpoch = %d, %v", e, err)
	}
	res, err := a2.Do(ctx, etcdstore.Key{ID: "k"}, nil, func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("v"), nil })
	if err != nil || res.Token>>storex.EpochShift != 3 || storex.Epoch(a2.Shard("a")) != 3 {
		t.Fatalf("claim under a stale epoch: token %d, epoch now %d, %v; want epoch 3", res.Token, storex.Epoch(a2.Shard("a")), err)
	}
	rec, err := a1.Get(ctx, etcdstore.Key{ID: "k"})
	if err != nil || rec.Token != res.Token {
		t.Fatalf("another process reads token %v, %v; want %d", rec, err, res.Token)
	}
}

// A shard that cannot be reached makes its own keys unavailable; the
// other shard's keys are served.
func TestShardDownIsolation(t *testing.T) {
	prefix := testPrefix(t)
	proxy, cb := proxied(t, "b")
	ctx := testCtx(t)
	s, err := New(ctx, Config{Shards: []Shard{{Name: "a", Client: lossy(t, "a", 0, 1)}, {Name: "b", Client: cb}}},
		etcdstore.WithPrefix(prefix), etcdstore.WithRequestTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	proxy.Blackhole()
	work := func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("ok"), nil }
	onA, onB := 0, 0
	for i := 0; i < 12; i++ {
		k := etcdstore.Key{ID: "k" + strconv.Itoa(i)}
		_, err := s.Do(ctx, k, nil, work)
		switch s.Place(k) {
		case "a":
			onA++
			if err != nil {
				t.Fatalf("%s on the live shard: %v", k, err)
			}
		default:
			onB++
			if !errors.Is(err, etcdstore.ErrUnavailable) {
				t.Fatalf("%s on the cut-off shard: %v; want ErrUnavailable", k, err)
			}
		}
	}
	if onA == 0 || onB == 0 {
		t.Fatalf("keys on a %d, on b %d: want both", onA, onB)
	}
}

// Bad configurations are refused, naming what is wrong.
func TestConfigValidation(t *testing.T) {
	cli := lossy(t, "a", 0, 1)
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "no shards"},
		{Config{Shards: []Shard{{Name: "A", Client: cli}}}, "must be 1-32"},
		{Config{Shards: []Shard{{Name: "a", Client: cli}, {Name: "a", Client: cli}}}, "named twice"},
		{Config{Shards: []Shard{{Name: "a"}}}, "no etcd client"},
		{Config{Shards: []Shard{{Name: "a", Client: cli}}, Generation: -1}, "generation -1"},
		{Config{Shards: []Shard{{Name: "a", Client: cli}}, Placement: Placement{Shards: []string{"z"}}}, `"z"`},
		{Config{Shards: []Shard{{Name: "a", Client: cli}}, Placement: Placement{Pin: map[string]string{"t": "z"}}}, "pins t"},
		{Config{Shards: []Shard{{Name: "a", Client: cli}}, Previous: &Placement{}}, "previous placement names no shard"},
	} {
		_, err := New(context.Background(), tc.cfg)
		if err == nil || !errors.Is(err, etcdstore.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v; want ErrInvalidArgument naming %q", tc.cfg, err, tc.want)
		}
	}
}
