package main

import (
	"context"
	"runtime/pprof"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// rawBatcher is group commit on raw etcd, the limit idem's own is measured
// against: each request's Txn goes as an inner Txn of an outer one, whatever
// waits while a batch is in flight going together, at most rawBatchMax at a
// time (and up to batchesInflight batches while full ones wait). It knows nothing of idem: no records, no sessions,
// no recognition of lost replies.
type rawBatcher struct {
	cli      *clientv3.Client
	mu       sync.Mutex
	queue    []*rawReq
	inflight int
	lastSent time.Time
	timer    *time.Timer
	pace     pacer // etcdstore's, copied (pace.go)
	// labels: a caller's context, whose profiler labels (the side) the
	// timer's goroutine takes, so that --client-cpu counts the batches it
	// sends to this side.
	labels context.Context
}

type rawReq struct {
	op   clientv3.Op // an OpTxn
	done chan struct{}
	resp *clientv3.TxnResponse
	err  error
}

const (
	rawBatchMax     = 64
	batchesInflight = 4
)

func (b *rawBatcher) do(ctx context.Context, op clientv3.Op) (*clientv3.TxnResponse, error) {
	r := &rawReq{op: op, done: make(chan struct{})}
	b.mu.Lock()
	if b.labels == nil {
		b.labels = ctx
	}
	b.queue = append(b.queue, r)
	b.launchLocked()
	b.mu.Unlock()
	select {
	case <-r.done:
		return r.resp, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// launchLocked follows idem's rule: a batch whenever none is in flight;
// another when a full one waits or the pacer's hold has passed since the
// last.
func (b *rawBatcher) launchLocked() {
	for len(b.queue) > 0 && b.inflight < batchesInflight {
		if b.inflight > 0 && len(b.queue) < rawBatchMax {
			hold, ok := b.pace.hold()
			if !ok {
				return // the batch in flight is the first measurement
			}
			if wait := hold - time.Since(b.lastSent); wait > 0 {
				if b.timer == nil {
					b.timer = time.AfterFunc(wait, func() {
						pprof.SetGoroutineLabels(b.labels)
						b.mu.Lock()
						b.timer = nil
						b.launchLocked()
						b.mu.Unlock()
					})
				}
				return
			}
		}
		n := min(len(b.queue), rawBatchMax)
		batch := b.queue[:n:n]
		b.queue = b.queue[n:]
		alone := b.inflight == 0 && n == 1
		b.inflight++
		b.lastSent = time.Now()
		go b.send(batch, alone)
	}
}

func (b *rawBatcher) send(batch []*rawReq, alone bool) {
	ops := make([]clientv3.Op, len(batch))
	for i, r := range batch {
		ops[i] = r.op
	}
	start := time.Now()
	resp, err := b.cli.Txn(context.Background()).Then(ops...).Commit()
	if err == nil {
		now := time.Now()
		b.mu.Lock()
		b.pace.observe(now.Sub(start), alone, now)
		b.mu.Unlock()
	}
	for i, r := range batch {
		if err != nil {
			r.err = err
		} else {
			inner := (*clientv3.TxnResponse)(resp.Responses[i].GetResponseTxn())
			inner.Header = resp.Header
			r.resp = inner
		}
		close(r.done)
	}
	b.mu.Lock()
	b.inflight--
	b.launchLocked()
	b.mu.Unlock()
}

// rawBatchedPair is rawPair with group commit: the claim and the fenced
// complete of each key go through batchers (one per client).
func rawBatchedPair(batchers []*rawBatcher, leaseID clientv3.LeaseID, k *keys, claimSize, doneSize int) op {
	claimVal, doneVal := string(payload(claimSize)), string(payload(doneSize))
	return func(ctx context.Context, w int) (string, error) {
		b, key := batchers[w%len(batchers)], k.next()
		r, err := b.do(ctx, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(key, claimVal, clientv3.WithLease(leaseID))},
			[]clientv3.Op{clientv3.OpGet(key)}))
		if err != nil {
			return "", err
		}
		_, err = b.do(ctx, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", r.Header.Revision)},
			[]clientv3.Op{clientv3.OpPut(key, doneVal, clientv3.WithLease(leaseID))},
			[]clientv3.Op{clientv3.OpGet(key)}))
		return "pair", err
	}
}
