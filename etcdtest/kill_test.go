package etcdtest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
)

// A member killed while clients read from it must not take the process
// down: etcd closes its backend before its gRPC servers stop, and a read
// that reaches the closed backend panics (etcd-io/etcd#14256). The reads
// are serializable (straight to the backend) and every write is committed
// at once (batch limit 1), so they read the bolt file rather than the
// write buffer; the member is killed while every reader is mid-loop.
func TestKillUnderReadsDoesNotPanic(t *testing.T) {
	for round := range 5 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			c := Start(t, 1, Options{Configure: func(cfg *embed.Config) { cfg.BackendBatchLimit = 1 }})
			cli := c.MustClient(t)
			for i := range 20 {
				if _, err := cli.Put(context.Background(), fmt.Sprint("k", i), "v"); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			const readers = 8
			var wg, warm sync.WaitGroup
			var served atomic.Int64
			warm.Add(readers)
			for range readers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					first := true
					for ctx.Err() == nil {
						rctx, rc := context.WithTimeout(ctx, time.Second)
						_, err := cli.Get(rctx, "k", clientv3.WithPrefix(), clientv3.WithSerializable())
						rc()
						if err == nil {
							served.Add(1)
							if first {
								first = false
								warm.Done()
							}
						}
					}
				}()
			}
			warm.Wait() // every reader has been served once: all are reading now
			c.Members[0].Kill()
			cancel()
			wg.Wait()
			if served.Load() < readers {
				t.Fatalf("%d reads served, want at least %d", served.Load(), readers)
			}
		})
	}
}
