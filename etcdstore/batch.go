package etcdstore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"
)

// Group commit. The store's conditional writes (claims, takeovers,
// completes, checkpoints, renewals, releases, abandons, enqueues) issued
// concurrently by one Store go to etcd together: one outer Txn whose Then
// holds each write's own Txn, unchanged (its compares, its Then, its
// Else). etcd evaluates each inner Txn on its own and applies them all in
// one raft entry, at one revision; what each inner Txn answers is what it
// would have answered alone.
//
// Nothing waits when the store is idle: a write that finds fewer than
// maxInflight batches in flight is sent at once, alone. Under load, writes
// that arrive while batches are in flight wait for a slot, and go together.
//
// A batch never writes one key twice (etcd refuses the whole request): a
// write whose key is already in the batch waits for the next. A batch that
// etcd refuses as a whole for what it holds (a lease one member names does
// not exist, too many ops, too large, permission denied) is split: each
// member is sent again alone, and gets its own answer. A batch whose reply
// is lost is an unknown outcome for each member, which the store's per-key
// rules already handle (a retry recognises its own write).
type batcher struct {
	kv          pb.KVClient
	try         func(context.Context) (context.Context, context.CancelFunc)
	maxMembers  int // inner Txns per batch
	maxBytes    int // request bytes per batch
	maxInflight int
	observe     func(time.Duration) // WithTxnObserver; nil: none

	mu       sync.Mutex
	queue    []*member
	inflight int
	lastSent time.Time
	timer    *time.Timer // armed to launch a batch when spacing allows

	// Counters, for Store.BatchStats.
	batches, members, split atomic.Int64
}

// member is one write waiting for its batch.
type member struct {
	req  *pb.TxnRequest
	keys []string // keys its Then writes
	size int
	ctx  context.Context // the caller's: a member whose caller left is not sent
	done chan struct{}
	resp *pb.TxnResponse
	err  error
}

// Defaults of the batches (WithBatchLimits). etcd refuses a Txn of more
// than --max-txn-ops (default 128) ops in a branch, counting each inner
// Txn as one, and a request over --max-request-bytes (default 1.5 MiB).
const (
	DefaultBatchMembers = 64
	DefaultBatchBytes   = 1 << 20
	batchesInflight     = 4
	batchSpacing        = 2 * time.Millisecond
	batchTimeout        = 30 * time.Second
)

func newBatcher(kv pb.KVClient, try func(context.Context) (context.Context, context.CancelFunc), members, bytes int) *batcher {
	return &batcher{kv: kv, try: try, maxMembers: members, maxBytes: bytes, maxInflight: batchesInflight}
}

// do sends req, which writes keys, in a batch, and returns its own answer:
// a response whose header is the batch's, or the error of the request
// (a context error when ctx ended first: the outcome is then unknown).
func (b *batcher) do(ctx context.Context, req *pb.TxnRequest, keys []string) (*pb.TxnResponse, error) {
	m := &member{req: req, keys: keys, size: proto.Size(req), ctx: ctx, done: make(chan struct{})}
	b.mu.Lock()
	b.queue = append(b.queue, m)
	if b.inflight == 0 {
		// Idle: this caller sends the batch itself (at once, and most
		// often alone), sparing a hand-over to another goroutine.
		if batch := b.takeLocked(); len(batch) > 0 {
			b.inflight++
			b.lastSent = time.Now()
			b.mu.Unlock()
			b.send(batch)
			b.mu.Lock()
		}
	}
	b.launchLocked()
	b.mu.Unlock()
	select {
	case <-m.done:
		return m.resp, m.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// launchLocked starts batches while writes wait: one whenever none is in
// flight; another (up to maxInflight) when a full batch waits, or when
// batchSpacing has passed since the last one was sent. Batches that go out
// at most every batchSpacing are large, which etcd's apply and fsync
// reward (measured: four at once made batches of 9.5 writes and lost a
// third of the throughput to one at a time, 32 writes); a write never waits
// longer than that spacing for a batch in flight to return, which across
// data centres takes a round trip to the quorum.
func (b *batcher) launchLocked() {
	for len(b.queue) > 0 && b.inflight < b.maxInflight {
		if b.inflight > 0 && len(b.queue) < b.maxMembers {
			if wait := batchSpacing - time.Since(b.lastSent); wait > 0 {
				if b.timer == nil {
					b.timer = time.AfterFunc(wait, func() {
						b.mu.Lock()
						b.timer = nil
						b.launchLocked()
						b.mu.Unlock()
					})
				}
				return
			}
		}
		batch := b.takeLocked()
		if len(batch) == 0 {
			return
		}
		b.inflight++
		b.lastSent = time.Now()
		go b.send(batch)
	}
}

// takeLocked takes the next batch from the queue, oldest first, within the
// limits and without writing a key twice; members whose caller has left
// are answered and dropped.
func (b *batcher) takeLocked() []*member {
	var batch []*member
	var rest []*member
	written := map[string]bool{}
	bytes := 0
	for i, m := range b.queue {
		if m.ctx.Err() != nil {
			m.err = m.ctx.Err()
			close(m.done)
			continue
		}
		fits := len(batch) < b.maxMembers && (len(batch) == 0 || bytes+m.size <= b.maxBytes)
		for _, k := range m.keys {
			fits = fits && !written[k]
		}
		if !fits {
			rest = append(rest, m)
			if len(batch) >= b.maxMembers {
				rest = append(rest, b.queue[i+1:]...)
				break
			}
			continue
		}
		batch = append(batch, m)
		bytes += m.size
		for _, k := range m.keys {
			written[k] = true
		}
	}
	b.queue = rest
	return batch
}

// send sends one batch and answers its members.
func (b *batcher) send(batch []*member) {
	defer func() {
		b.mu.Lock()
		b.inflight--
		b.launchLocked()
		b.mu.Unlock()
	}()
	b.batches.Add(1)
	b.members.Add(int64(len(batch)))
	if len(batch) == 1 {
		b.alone(batch[0])
		return
	}
	outer := &pb.TxnRequest{Success: make([]*pb.RequestOp, len(batch))}
	for i, m := range batch {
		outer.Success[i] = &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: m.req}}
	}
	resp, err := b.txn(outer)
	if err != nil {
		if !mayHaveLanded(err) {
			// Refused as a whole, for what one member holds, or by a
			// state (no leader, no space) that a member alone may be
			// spared (a release is allowed when etcd is full): each on
			// its own.
			b.split.Add(1)
			for _, m := range batch {
				b.alone(m)
			}
			return
		}
		for _, m := range batch {
			m.err = err
			close(m.done)
		}
		return
	}
	for i, m := range batch {
		inner := resp.Responses[i].GetResponseTxn()
		m.resp = &pb.TxnResponse{Header: resp.Header, Succeeded: inner.Succeeded, Responses: inner.Responses}
		close(m.done)
	}
}

// alone sends one member's Txn as it is.
func (b *batcher) alone(m *member) {
	m.resp, m.err = b.txn(m.req)
	close(m.done)
}

func (b *batcher) txn(req *pb.TxnRequest) (*pb.TxnResponse, error) {
	ctx, cancel := b.try(context.Background())
	defer cancel()
	if _, ok := ctx.Deadline(); !ok {
		// No request timeout (WithRequestTimeout(0)): a batch still gives
		// its slot back, though its members wait only on their own contexts.
		var c2 context.CancelFunc
		ctx, c2 = context.WithTimeout(ctx, batchTimeout)
		defer c2()
	}
	start := time.Now()
	resp, err := b.kv.Txn(ctx, req, callOpts...)
	if b.observe != nil {
		b.observe(time.Since(start))
	}
	if err != nil {
		return nil, clientv3.ContextError(ctx, err)
	}
	return resp, nil
}

// BatchStats reports the store's group commit: how many batches it sent,
// how many writes they held (Members/Batches is the mean batch size), and
// how many etcd refused as a whole, so that their writes went again alone.
type BatchStats struct {
	Batches, Members, Split int64
}

// BatchStats returns the group commit's counters; zero without batching.
func (s *Store) BatchStats() BatchStats {
	if s.batch == nil {
		return BatchStats{}
	}
	return BatchStats{Batches: s.batch.batches.Load(), Members: s.batch.members.Load(), Split: s.batch.split.Load()}
}
