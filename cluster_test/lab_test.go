package cluster_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

var labSeed = flag.Uint64("lab.seed", 1, "seed of the lab's flaky network")

// The network of the lab: a request is lost on the way with probability
// lostRequest (nothing happens, the client times out), and a response is
// lost on the way back with lostResponse (the server acted, the client
// times out). The client retries until it gets a response.
const (
	labOrders    = 100
	lostRequest  = 0.10
	lostResponse = 0.20
	maxTries     = 20
)

type labRow struct {
	name, downstream string
	charges, doubled int
}

// TestLab reproduces the classic lab of idempotency keys against a flaky network:
//
//	go test ./cluster_test -run TestLab -v -args -lab.seed=1
//
// Rows 1-3 are deterministic for a seed; row 4 runs concurrently on a
// 3-member cluster under faults.
func TestLab(t *testing.T) {
	if testing.Short() {
		t.Skip("lab skipped in -short mode")
	}
	single, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer single.Close()
	store := labStore(t, single.MustClient(t), "/lab/")

	rows := []labRow{
		labSequential(t, "no-key", func(rng *rand.Rand, order string, charge func() string) (string, bool) {
			return flaky(rng, charge)
		}),
		labSequential(t, "key-per-try", func(rng *rand.Rand, order string, charge func() string) (string, bool) {
			return flaky(rng, func() string { return doCharge(t, store, uuid.NewString(), order, charge) })
		}),
		labSequential(t, "same-key", func(rng *rand.Rand, order string, charge func() string) (string, bool) {
			return flaky(rng, func() string { return doCharge(t, store, "pay-"+order, order, charge) })
		}),
		labUnderFaults(t),
	}
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d, %d orders, request lost %.0f%%, response lost %.0f%%\n", *labSeed, labOrders, lostRequest*100, lostResponse*100)
	fmt.Fprintf(&b, "  %-30s %8s %22s   %s\n", "version", "charges", "double-charged orders", "downstream")
	for _, r := range rows {
		fmt.Fprintf(&b, "  %-30s %8d %22d   %s\n", r.name, r.charges, r.doubled, r.downstream)
	}
	t.Log("\n" + b.String())

	if rows[0].doubled == 0 || rows[1].doubled == 0 {
		t.Errorf("the flaky network double-charged nobody without a stable key: the lab did not exercise retries")
	}
	for _, r := range rows[2:] {
		if r.charges != labOrders || r.doubled != 0 {
			t.Errorf("%s: %d charges, %d double-charged; want %d and 0", r.name, r.charges, r.doubled, labOrders)
		}
	}
}

// flaky sends one request through the lab's network, retrying until a
// response comes back. It returns the response and whether one came.
func flaky(rng *rand.Rand, serve func() string) (string, bool) {
	for try := 0; try < maxTries; try++ {
		if rng.Float64() < lostRequest {
			continue // lost on the way: the server never saw it
		}
		resp := serve()
		if rng.Float64() < lostResponse {
			continue // the server acted; the answer was lost
		}
		return resp, true
	}
	return "", false
}

// labSequential runs the orders one after another with a seeded network.
func labSequential(t *testing.T, name string, send func(rng *rand.Rand, order string, charge func() string) (string, bool)) labRow {
	rng := rand.New(rand.NewPCG(*labSeed, 0))
	charges := map[string]int{}
	for i := 0; i < labOrders; i++ {
		order := fmt.Sprintf("%s-%03d", name, i)
		charge := func() string { charges[order]++; return fmt.Sprintf("ch_%d", charges[order]) }
		if _, ok := send(rng, order, charge); !ok {
			t.Fatalf("%s: order %s got no answer in %d tries", name, order, maxTries)
		}
	}
	return tally(name, "charges per call", charges)
}

func tally(name, downstream string, charges map[string]int) labRow {
	r := labRow{name: name, downstream: downstream}
	for _, n := range charges {
		r.charges += n
		if n > 1 {
			r.doubled++
		}
	}
	return r
}

// doCharge runs charge under key through idem.
func doCharge(t *testing.T, s *etcdstore.Store, key, order string, charge func() string) string {
	res, err := s.Do(context.Background(), etcdstore.Key{ID: key}, []byte(order), func(context.Context, *etcdstore.Claim) ([]byte, error) {
		return []byte(charge()), nil
	})
	if err != nil {
		t.Fatalf("order %s: %v", order, err)
	}
	return string(res.Body)
}

func labStore(t *testing.T, cli *clientv3.Client, prefix string) *etcdstore.Store {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(sessionTTL),
		etcdstore.WithRequestTimeout(requestTimeout))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// labUnderFaults runs the same-key version concurrently, through clients
// pinned to each member of a 3-member cluster, while the leader is killed
// and a member is partitioned. The work passes its own key downstream
// (charge:<order>), as a work that passes its own key on does.
func labUnderFaults(t *testing.T) labRow {
	e := newEnv(t, 3, etcdtest.Options{})
	for _, p := range []int{0, 1, 2, -1} {
		e.newClient(p)
	}
	var wg sync.WaitGroup
	orders := make(chan string)
	var failed []string
	var mu sync.Mutex
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(*labSeed, uint64(w+1)))
			for order := range orders {
				c := e.clients[w%len(e.clients)]
				_, ok := flaky(rng, func() string { return faultyCharge(e, c, order) })
				if !ok {
					mu.Lock()
					failed = append(failed, order)
					mu.Unlock()
				}
			}
		}()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	faults := make(chan error, 1)
	isolated := -1
	go func() {
		l, err := e.cluster.WaitLeader(ctx, e.cluster.All())
		if err == nil {
			e.cluster.Members[l].Kill()
			_, err = e.cluster.WaitLeader(ctx, others(3, l), l)
		}
		if err == nil {
			err = e.cluster.Members[l].Restart(ctx)
		}
		if err == nil {
			var nl int
			if nl, err = e.cluster.WaitLeader(ctx, e.cluster.All()); err == nil {
				isolated = (nl + 1) % 3
				if err = e.cluster.Isolate(isolated); err == nil {
					err = e.cluster.WaitIsolated(ctx, isolated)
				}
				time.Sleep(time.Second) // hold the partition while orders flow
				e.cluster.Heal()
			}
		}
		faults <- err
	}()
	for i := 0; i < labOrders; i++ {
		orders <- fmt.Sprintf("faults-%03d", i)
	}
	close(orders)
	wg.Wait()
	if err := <-faults; err != nil {
		t.Fatalf("lab faults: %v", err)
	}
	if isolated < 0 {
		t.Fatal("INVALID: the faults row partitioned nothing")
	}
	if len(failed) > 0 {
		t.Fatalf("orders without an answer under faults: %v", failed)
	}
	effects, _ := e.sink.snapshot()
	return tally("same-key, 3 members, faults", "dedupes charge:<order>", effects)
}

// faultyCharge is one request of the faults row: it answers only once the
// order is done, retrying idem's own transient errors (a conflict, an
// unavailable cluster) as a client would.
func faultyCharge(e *env, c *client, order string) string {
	for {
		ctx, cancel := context.WithTimeout(context.Background(), attemptTimeout)
		res, err := c.store.Do(ctx, etcdstore.Key{ID: "pay-" + order}, []byte(order), e.work(order, "charged "+order),
			etcdstore.OnError(etcdstore.EndAbandon))
		cancel()
		if err == nil {
			return string(res.Body)
		}
		if errors.Is(err, etcdstore.ErrMismatch) {
			e.t.Fatalf("order %s: %v", order, err)
		}
		time.Sleep(50 * time.Millisecond) // the client's retry backoff
	}
}
