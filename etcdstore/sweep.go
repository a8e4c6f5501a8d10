package etcdstore

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/lease"
)

// Expiry without stalls. When a lease expires, etcd deletes every key on it
// in one raft entry and applies nothing else meanwhile: a bucket of a million
// keys stalled every request for seconds. So the store deletes expired
// records itself, a few at a time, at about the rate they were written, and
// leaves etcd's expiry of the (by then empty) lease as the backstop:
//
//   - Leases live two bucket widths longer than their records need
//     (lease.Buckets.SetGrace): the sweep happens in that time.
//   - Once every record of a bucket has expired (its end plus the retention,
//     plus a margin for clock skew), a sweeper takes each of its leases in
//     turn: it locks the lease (a key on its session's lease, so that a
//     process that dies gives the lease to the next), lists the lease's
//     keys (LeaseTimeToLive), and deletes its records in Txns of sweepChunk
//     inner Txns, each If Lease(record) == lease Then Delete(record): a record
//     written again since (on a newer lease) is left alone. It paces the
//     Txns to finish the bucket in about half a bucket width, then revokes
//     the lease, which deletes the bucket key and whatever else is left.
//
// Each Txn deletes at most sweepChunk records, about a millisecond of apply;
// requests slip in between.
type sweeper struct {
	leases, records atomic.Int64 // swept, for Store.SweepStats
}

const sweepChunk = 64

// SweepStats reports what the store's sweeper deleted: leases emptied (and
// revoked) and the expired records deleted from them.
type SweepStats struct {
	Leases, Records int64
}

// SweepStats returns the sweeper's counters; zero without it.
func (s *Store) SweepStats() SweepStats {
	if s.sweep == nil {
		return SweepStats{}
	}
	return SweepStats{Leases: s.sweep.leases.Load(), Records: s.sweep.records.Load()}
}

// sweepMargin is how long after its records' expiry a bucket is swept:
// the records were stamped on their writers' clocks.
func sweepMargin(width time.Duration) time.Duration {
	return min(max(width/10, 5*time.Second), time.Minute)
}

// runSweeper sweeps due buckets until the store closes.
func (s *Store) runSweeper() {
	defer s.wg.Done()
	every := min(max(s.buckets.Width()/4, time.Second), 10*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	ctx, cancel := s.untilClosed()
	defer cancel()
	for {
		s.sweepDue(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// sweepDue sweeps every lease whose bucket is due and that no other process
// sweeps.
func (s *Store) sweepDue(ctx context.Context) {
	rctx, cancel := s.try(ctx)
	resp, err := s.client.Get(rctx, s.ks.buckets(), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return
	}
	now := s.now()
	type due struct {
		id    clientv3.LeaseID
		width time.Duration
	}
	var todo []due
	for _, kv := range resp.Kvs {
		b, ok := lease.ParseBucketKey(s.ks.buckets(), string(kv.Key))
		margin := sweepMargin(b.Width)
		if m, _, _ := s.sweepTest(); m > 0 {
			margin = m
		}
		if !ok || now.Before(b.End().Add(b.Retention+margin)) {
			continue
		}
		id, err := lease.ParseLeaseID(string(kv.Key), kv.Value)
		if err != nil {
			continue
		}
		todo = append(todo, due{id, b.Width})
	}
	for i, d := range todo {
		if ctx.Err() != nil {
			return
		}
		s.sweepLease(ctx, d.id, d.width, len(todo)-i)
	}
}

// sweepLease deletes the expired records of lease id, paced so that the
// leases left of its bucket take about half a bucket width, and revokes it.
func (s *Store) sweepLease(ctx context.Context, id clientv3.LeaseID, width time.Duration, left int) {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess == nil {
		return // no session to hold the lock with: next round
	}
	lock := s.ks.sweeps() + strconv.FormatInt(int64(id), 16)
	rctx, cancel := s.try(ctx)
	tr, err := s.client.Txn(rctx).If(clientv3.Compare(clientv3.CreateRevision(lock), "=", 0)).
		Then(clientv3.OpPut(lock, sess.Owner(), clientv3.WithLease(sess.Lease()))).Commit()
	cancel()
	if err != nil || !tr.Succeeded {
		return // another process sweeps it (or we could not tell)
	}
	defer func() {
		dctx, cancel := s.try(context.WithoutCancel(ctx))
		s.client.Delete(dctx, lock)
		cancel()
	}()
	rctx, cancel = s.try(ctx)
	ttl, err := s.client.TimeToLive(rctx, id, clientv3.WithAttachedKeys())
	cancel()
	if err != nil || ttl.TTL == -1 {
		return // gone already, or unreadable this round
	}
	var recs []string
	for _, k := range ttl.Keys {
		if strings.HasPrefix(string(k), s.ks.records()) {
			recs = append(recs, string(k))
		}
	}
	_, testWindow, listed := s.sweepTest()
	if listed != nil {
		listed(recs)
	}
	window := max(width/2, 10*time.Second)
	if testWindow > 0 {
		window = testWindow
	}
	pause := window * sweepChunk / time.Duration(max(1, len(recs)*left))
	pause = min(max(pause, time.Millisecond), time.Second)
	for start := 0; start < len(recs); start += sweepChunk {
		if start > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(pause):
			}
		}
		chunk := recs[start:min(start+sweepChunk, len(recs))]
		ops := make([]clientv3.Op, len(chunk))
		for i, k := range chunk {
			ops[i] = clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(k), "=", int64(id))},
				[]clientv3.Op{clientv3.OpDelete(k)}, nil)
		}
		rctx, cancel := s.try(ctx)
		resp, err := s.client.Txn(rctx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return // next round, from what is left
		}
		for _, r := range resp.Responses {
			if r.GetResponseTxn().GetSucceeded() {
				s.sweep.records.Add(1)
			}
		}
	}
	rctx, cancel = s.try(ctx)
	_, err = s.client.Revoke(rctx, id)
	cancel()
	if err == nil {
		s.sweep.leases.Add(1)
	}
}

// sweepTest returns what a test set of the sweeper's pace, and its hook.
func (s *Store) sweepTest() (margin, window time.Duration, listed func([]string)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sweepMargin, s.sweepWindow, s.sweepListed
}
