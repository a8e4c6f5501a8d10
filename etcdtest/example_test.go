package etcdtest_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"sync/atomic"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
)

// Two services take orders through idem while the etcd leader is cut off
// from the other members: they fail over to the new leader, and every order
// is charged once. (In a test, etcdtest.Start(t, ...) starts the cluster
// and stops it with the test.)
func Example_partitionedLeader() {
	dir, _ := os.MkdirTemp("", "etcdtest-example-")
	defer os.RemoveAll(dir)
	c, err := etcdtest.New(dir, 3, etcdtest.Options{Proxies: true})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()

	var charges atomic.Int32
	charge := func(context.Context, *etcdstore.Claim) ([]byte, error) { charges.Add(1); return []byte("charged"), nil }
	var services []*etcdstore.Store
	for range 2 {
		cli, err := c.Client(c.ProxiedEndpoints()...) // every member, behind its proxy
		if err != nil {
			log.Fatal(err)
		}
		s, err := etcdstore.New(ctx, cli, etcdstore.WithSessionTTL(2*time.Second), etcdstore.WithRequestTimeout(time.Second))
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		services = append(services, s)
	}

	leader := c.Leader()
	if err := c.Isolate(leader); err != nil { // both directions
		log.Fatal(err)
	}
	for i := range 20 {
		key := etcdstore.Key{ID: fmt.Sprintf("order-%d", i)}
		for { // a client retries with the same key until it has the outcome
			_, err := services[i%2].Do(ctx, key, []byte(`{"amount":100}`), charge)
			if err == nil || !errors.Is(err, etcdstore.ErrUnavailable) && !errors.Is(err, etcdstore.ErrConflict) {
				break
			}
			time.Sleep(100 * time.Millisecond) // the client's backoff
		}
	}
	var majority []int
	for _, i := range c.All() {
		if i != leader {
			majority = append(majority, i)
		}
	}
	now, _ := c.WaitLeader(ctx, majority, leader)
	c.Heal()
	fmt.Println("another member leads:", now != leader)
	fmt.Println("orders charged:", charges.Load())
	// Output:
	// another member leads: true
	// orders charged: 20
}
