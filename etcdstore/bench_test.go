package etcdstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// benchConcurrency is the number of concurrent callers, as in the goals.
const benchConcurrency = 64

// BenchmarkDoVsRawTxnPair runs idem's Do (claim, trivial work, fenced
// complete) and the raw etcd Txn pair it is built on (claim by
// CreateRevision == 0, complete by ModRevision == mine) against the same
// cluster in the same run, interleaved, and reports both rates and their
// ratio. b.N is the number of keys per side. Run it with
//
//	go test -run '^$' -bench DoVsRawTxnPair -benchtime 4000x ./etcdstore/
func BenchmarkDoVsRawTxnPair(b *testing.B) {
	for _, members := range []int{1, 3} {
		b.Run(fmt.Sprintf("members=%d", members), func(b *testing.B) {
			cli := single.MustClient(b)
			if members == 3 {
				cli = threeMembers(b).MustClient(b)
			}
			prefix := fmt.Sprintf("/bench/%d/%d/", members, time.Now().UnixNano())
			s := newStore(b, cli, prefix)
			ctx := context.Background()
			id, err := s.buckets.For(ctx, time.Now())
			if err != nil {
				b.Fatal(err)
			}
			value := string(make([]byte, 200)) // about the size of a record
			raw := func(i int) error {
				k := fmt.Sprintf("%sraw/%d", prefix, i)
				r, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
					Then(clientv3.OpPut(k, value, clientv3.WithLease(id))).Else(clientv3.OpGet(k)).Commit()
				if err != nil {
					return err
				}
				_, err = cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", r.Header.Revision)).
					Then(clientv3.OpPut(k, value, clientv3.WithLease(id))).Else(clientv3.OpGet(k)).Commit()
				return err
			}
			body := []byte(`{"charge":"ch_1"}`)
			do := func(i int) error {
				_, err := s.Do(ctx, Key{ID: fmt.Sprintf("do-%d", i)}, []byte(`{"amount":100}`),
					func(context.Context, *Claim) ([]byte, error) { return body, nil })
				return err
			}
			b.ResetTimer()
			var rawDur, doDur time.Duration
			half := (b.N + 1) / 2
			for _, part := range []int{0, 1} { // interleave so drift hits both sides
				base := part * half
				rawDur += runConcurrently(b, base, half, raw)
				doDur += runConcurrently(b, base, half, do)
			}
			b.StopTimer()
			rawRate := float64(2*half) / rawDur.Seconds()
			doRate := float64(2*half) / doDur.Seconds()
			b.ReportMetric(rawRate, "raw-pairs/s")
			b.ReportMetric(doRate, "do/s")
			b.ReportMetric(doRate/rawRate, "do/raw")
		})
	}
}

// runConcurrently runs f for keys [base, base+n) on benchConcurrency
// goroutines and returns the wall time.
func runConcurrently(b *testing.B, base, n int, f func(int) error) time.Duration {
	var next atomic.Int64
	next.Store(int64(base))
	end := int64(base + n)
	var wg sync.WaitGroup
	start := time.Now()
	for g := 0; g < benchConcurrency; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= end {
					return
				}
				if err := f(int(i)); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(start)
}
