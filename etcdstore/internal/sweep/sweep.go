// Package sweep deletes expired records without stalls. When a lease
// expires, etcd deletes every key on it in one raft entry and applies
// nothing else meanwhile: a bucket of a million keys stalled every request
// for seconds. So the store deletes expired records itself, a few at a
// time, at about the rate they were written, and leaves etcd's expiry of
// the (by then empty) lease as the backstop:
//
//   - Leases live two bucket widths longer than their records need
//     (lease.Buckets.SetGrace): the sweep happens in that time.
//   - Once every record of a bucket has expired (its end plus the
//     retention, plus a margin for clock skew), a sweeper takes each of its
//     leases in turn: it locks the lease (a key on its session's lease, so
//     that a process that dies gives the lease to the next), lists the
//     lease's keys (LeaseTimeToLive), and deletes its records in Txns of
//     Chunk inner Txns, each If Lease(record) == lease Then Delete(record):
//     a record written again since (on a newer lease) is left alone. It
//     paces the Txns to finish the bucket in about half a bucket width, then
//     revokes the lease, which deletes the bucket key and whatever else is
//     left on it.
//
// Each Txn deletes at most Chunk records, about a millisecond of apply;
// requests slip in between.
package sweep

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/kpb"
	"github.com/idem-dev/idem/etcdstore/internal/send"
	"github.com/idem-dev/idem/internal/kernel"
	"github.com/idem-dev/idem/lease"
)

// Chunk is how many records one delete Txn holds at most.
const Chunk = 64

// Config configures a Sweeper.
type Config struct {
	Client *clientv3.Client
	Clock  clock.Clock
	Send   *send.Sender
	// Try prepares one etcd request's context.
	Try func(context.Context) (context.Context, context.CancelFunc)
	// Buckets, Records and Locks are the key prefixes of the bucket keys,
	// of the records, and of the sweepers' locks.
	Buckets, Records, Locks string
	// Width is the store's bucket width, which sets the pace.
	Width time.Duration
	// Session returns the owner id and lease of the current session, or
	// false while there is none.
	Session func() (owner string, id clientv3.LeaseID, ok bool)
	// Margin and Window override the pace, for tests (zero: by the width).
	Margin, Window time.Duration
	// Listed, when set, is called with the records a sweep listed, before
	// it deletes any.
	Listed func(records []string)
}

// Sweeper sweeps expired buckets.
type Sweeper struct {
	cfg             Config
	leases, records atomic.Int64
}

// New returns a Sweeper; Run runs it.
func New(cfg Config) *Sweeper { return &Sweeper{cfg: cfg} }

// Stats are what a Sweeper deleted: leases emptied (and revoked) and the
// expired records deleted from them.
type Stats struct {
	Leases, Records int64
}

// Stats returns the sweeper's counters.
func (s *Sweeper) Stats() Stats {
	return Stats{Leases: s.leases.Load(), Records: s.records.Load()}
}

// Margin is how long after its records' expiry a bucket is swept: the
// records were stamped on their writers' clocks, which may run ahead of
// this process's by up to this much.
func Margin(width time.Duration) time.Duration {
	return min(max(width/10, 5*time.Second), time.Minute)
}

// Run sweeps due buckets until ctx ends.
func (s *Sweeper) Run(ctx context.Context) {
	every := min(max(s.cfg.Width/4, time.Second), 10*time.Second)
	for {
		s.sweepDue(ctx)
		if clock.Sleep(s.cfg.Clock, ctx, every) != nil {
			return
		}
	}
}

// sweepDue sweeps every lease whose bucket is due and that no other
// process sweeps.
func (s *Sweeper) sweepDue(ctx context.Context) {
	rctx, cancel := s.cfg.Try(ctx)
	resp, err := s.cfg.Client.Get(rctx, s.cfg.Buckets, clientv3.WithPrefix())
	cancel()
	if err != nil {
		return
	}
	now := s.cfg.Clock.Now()
	type due struct {
		id    clientv3.LeaseID
		width time.Duration
	}
	var todo []due
	for _, kv := range resp.Kvs {
		b, ok := lease.ParseBucketKey(s.cfg.Buckets, string(kv.Key))
		margin := Margin(b.Width)
		if s.cfg.Margin > 0 {
			margin = s.cfg.Margin
		}
		if !ok || !kernel.BucketDue(b.End(), b.Retention, margin, now) {
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

// lock takes the sweep of lease id for this process's session: a key on
// the session's lease, created if absent. It reports whether this process
// holds it: it made it now, or an earlier try of its own did (its reply
// lost).
func (s *Sweeper) lock(ctx context.Context, key, owner string, sess clientv3.LeaseID) bool {
	var tr *clientv3.TxnResponse
	err := s.cfg.Send.Do(ctx, func(ctx context.Context) (err error) {
		tr, err = s.cfg.Client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, owner, clientv3.WithLease(sess))).Else(clientv3.OpGet(key)).Commit()
		return err
	})
	if err != nil {
		return false // unknown: the next round reads the lock and knows
	}
	if tr.Succeeded {
		return true
	}
	kvs := tr.Responses[0].GetResponseRange().Kvs
	return len(kvs) == 1 && string(kvs[0].Value) == owner
}

// sweepLease deletes the expired records of lease id, paced so that the
// leases left of its bucket take about half a bucket width, and revokes
// it.
func (s *Sweeper) sweepLease(ctx context.Context, id clientv3.LeaseID, width time.Duration, left int) {
	owner, sess, ok := s.cfg.Session()
	if !ok {
		return // no session to hold the lock with: next round
	}
	lock := s.cfg.Locks + strconv.FormatInt(int64(id), 16)
	if !s.lock(ctx, lock, owner, sess) {
		return // another process sweeps it (or we could not tell)
	}
	defer s.cfg.Send.Do(context.WithoutCancel(ctx), func(ctx context.Context) error {
		_, err := s.cfg.Client.Delete(ctx, lock)
		return err
	})
	rctx, cancel := s.cfg.Try(ctx)
	ttl, err := s.cfg.Client.TimeToLive(rctx, id, clientv3.WithAttachedKeys())
	cancel()
	if err != nil || ttl.TTL == -1 {
		return // gone already, or unreadable this round
	}
	var recs []string
	for _, k := range ttl.Keys {
		if strings.HasPrefix(string(k), s.cfg.Records) {
			recs = append(recs, string(k))
		}
	}
	if s.cfg.Listed != nil {
		s.cfg.Listed(recs)
	}
	window := max(width/2, 10*time.Second)
	if s.cfg.Window > 0 {
		window = s.cfg.Window
	}
	pause := window * Chunk / time.Duration(max(1, len(recs)*left))
	pause = min(max(pause, time.Millisecond), time.Second)
	for start := 0; start < len(recs); start += Chunk {
		if start > 0 && clock.Sleep(s.cfg.Clock, ctx, pause) != nil {
			return
		}
		if !s.deleteChunk(ctx, id, recs[start:min(start+Chunk, len(recs))]) {
			return // next round, from what is left
		}
	}
	err = s.cfg.Send.Do(ctx, func(ctx context.Context) error {
		_, err := s.cfg.Client.Revoke(ctx, id)
		return err
	})
	if err == nil {
		s.leases.Add(1)
	}
}

// deleteChunk deletes the records of chunk that are still on lease id, in
// one Txn, and reports whether etcd answered.
func (s *Sweeper) deleteChunk(ctx context.Context, id clientv3.LeaseID, chunk []string) bool {
	req, err := kpb.Txn(kernel.SweepChunk(chunk, int64(id)))
	if err != nil {
		return false
	}
	// Alone, not batched: the chunk is a batch of its own.
	resp, err := s.cfg.Send.Alone(ctx, req)
	if err != nil {
		return false
	}
	for _, r := range resp.Responses {
		if r.GetResponseTxn().GetSucceeded() {
			s.records.Add(1)
		}
	}
	return true
}
