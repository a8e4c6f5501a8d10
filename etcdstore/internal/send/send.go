// Package send sends a store's etcd writes: every conditional write goes
// through one Sender, which batches those issued at the same time (group
// commit) and says, for every write that failed, whether it may have
// landed all the same (MayHaveLanded). That is the one definition of an
// ambiguous write in idem; every write of the store is classified by it.
//
// # Group commit
//
// Writes issued concurrently go to etcd together: one outer Txn whose Then
// holds each write's own Txn, unchanged (its compares, its Then, its Else).
// etcd evaluates each inner Txn on its own and applies them all in one raft
// entry, at one revision; what each inner Txn answers is what it would have
// answered alone.
//
// There is no sending goroutine: a caller whose write finds a slot free
// sends the batch itself (its own write and the oldest waiting ones), and
// answers every member of it; the others wait, through the clock, for
// their answer or for a slot. Nothing waits when the store is idle: a write
// that finds no batch in flight is sent at once, most often alone. A further
// batch goes while others fly only when a full one waits or the hold has
// passed since the last one was sent; at most maxInflight fly. The hold is
// not a constant: the Sender measures its batches' round trips and holds
// writes for company about as long as etcd is queueing them (see pacer).
//
// Invariants:
//   - A batch never writes one key twice (etcd refuses the whole request):
//     a write whose key is already in the batch waits for the next.
//   - A write that has left this process is answered by etcd's answer, or
//     by an error that MayHaveLanded says may have landed; its caller waits
//     for that even if its own context ends meanwhile (bounded by the
//     request's own timeout), so that a caller never learns "unknown" while
//     the write is still on its way and may land after the caller acted on
//     that answer.
//   - A write whose caller leaves before it was sent is taken out of the
//     queue: ErrNotSent, and it did not land.
//   - A batch etcd refuses as a whole for what it holds (a lease one member
//     names does not exist, too many ops, too large, permission denied, no
//     space) is split: each member is sent again alone and gets its own
//     answer. A batch whose reply is lost is an unknown outcome for each of
//     its members.
package send

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
)

// ErrNotSent wraps the error of a write that never left this process: its
// caller's context ended first. It did not land.
var ErrNotSent = errors.New("etcd request not sent")

// MayHaveLanded reports whether a write that failed with err may have been
// applied all the same: every error but ErrNotSent and those etcd returns
// before it proposes a request.
func MayHaveLanded(err error) bool {
	if err == nil || errors.Is(err, ErrNotSent) {
		return false
	}
	for _, definite := range []error{rpctypes.ErrLeaseNotFound, rpctypes.ErrNoSpace, rpctypes.ErrRequestTooLarge,
		rpctypes.ErrTooManyOps, rpctypes.ErrDuplicateKey, rpctypes.ErrPermissionDenied, rpctypes.ErrNoLeader,
		rpctypes.ErrInvalidAuthToken, rpctypes.ErrAuthOldRevision} {
		if errors.Is(err, definite) {
			return false
		}
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		switch ee.Code() {
		case codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated, codes.FailedPrecondition, codes.OutOfRange, codes.ResourceExhausted:
			return false
		}
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated, codes.FailedPrecondition, codes.OutOfRange, codes.ResourceExhausted:
		return false
	}
	return true
}

// Config configures a Sender.
type Config struct {
	KV    pb.KVClient
	Clock clock.Clock
	// Try prepares the context of one etcd request: a leader required,
	// and a timeout, which must be set: a request that has left is waited
	// for until it answers or times out.
	Try func(context.Context) (context.Context, context.CancelFunc)
	// Batching turns group commit on.
	Batching bool
	// MaxMembers and MaxBytes bound a batch.
	MaxMembers, MaxBytes int
	// Observe, when set, is told how long each etcd request took.
	Observe func(time.Duration)
}

// Defaults of the batches. etcd refuses a Txn of more than --max-txn-ops
// (default 128) ops in a branch, counting each inner Txn as one, and a
// request over --max-request-bytes (default 1.5 MiB).
const (
	DefaultMaxMembers = 64
	DefaultMaxBytes   = 1 << 20
	maxInflight       = 4
)

// Sender sends a store's writes. It is safe for concurrent use and starts
// no goroutines.
type Sender struct {
	cfg Config

	mu       sync.Mutex
	queue    []*member
	inflight int
	lastSent time.Time
	timer    func() bool // the armed hold timer, or nil
	timerAt  time.Time   // when it fires
	launched int64       // batches sent so far
	pace     pacer

	batches, members, split atomic.Int64
	left, waited            atomic.Int64
	beside, full            atomic.Int64
}

// member is one write waiting for its batch, or in one.
type member struct {
	ctx   context.Context // its caller's: a write whose caller left is not sent
	req   *pb.TxnRequest
	keys  []string // the keys its Then writes
	size  int
	state int // queued, flying, answered
	done  chan struct{}
	// wake is closed to make a queued write look again at whether it may
	// send a batch (it is the oldest: a slot freed, the hold passed, the
	// write before it left) or at its answer; replaced when it waits again.
	wake  chan struct{}
	woken bool
	resp  *pb.TxnResponse
	err   error
}

const (
	queued = iota
	flying
	answered
)

// New returns a Sender.
func New(cfg Config) *Sender {
	if cfg.MaxMembers <= 0 {
		cfg.MaxMembers = DefaultMaxMembers
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	return &Sender{cfg: cfg}
}

// Stats are a Sender's counters: batches sent (a write alone is a batch
// of one), the writes in them, batches refused as a whole and split,
// writes whose caller left before they were sent (not sent: they did not
// land), and writes whose caller's context ended while they flew (waited
// for: their answer is etcd's). Beside counts the batches sent while
// others flew, Full those of them that went because a full batch waited
// (the rest went when the hold had passed). RoundTrip is the smoothed
// round trip of a batch and Hold the hold it gives (see pacer).
type Stats struct {
	Batches, Members, Split int64
	Left, Waited            int64
	Beside, Full            int64
	RoundTrip, Hold         time.Duration
}

// Stats returns the Sender's counters.
func (s *Sender) Stats() Stats {
	st := Stats{Batches: s.batches.Load(), Members: s.members.Load(), Split: s.split.Load(),
		Left: s.left.Load(), Waited: s.waited.Load(), Beside: s.beside.Load(), Full: s.full.Load()}
	s.mu.Lock()
	st.RoundTrip = s.pace.srtt
	st.Hold, _ = s.pace.hold()
	s.mu.Unlock()
	return st
}

// callOpts are clientv3's default call options, for the Txns sent as
// protobuf requests.
var callOpts = []grpc.CallOption{grpc.WaitForReady(true), grpc.MaxCallSendMsgSize(2 << 20), grpc.MaxCallRecvMsgSize(math.MaxInt32)}

// Txn sends req, whose Then writes keys, and returns its own answer (with
// batching, a response whose header is its batch's) or an error. See the
// package documentation for what an error means.
func (s *Sender) Txn(ctx context.Context, req *pb.TxnRequest, keys []string) (*pb.TxnResponse, error) {
	if err := ctx.Err(); err != nil {
		return nil, notSent(ctx)
	}
	if !s.cfg.Batching {
		return s.Alone(ctx, req)
	}
	m := &member{ctx: ctx, req: req, keys: keys, size: sizeAtMost(req), done: make(chan struct{}), wake: make(chan struct{})}
	s.mu.Lock()
	s.queue = append(s.queue, m)
	for {
		switch m.state {
		case answered:
			s.mu.Unlock()
			return m.resp, m.err
		case flying:
			s.mu.Unlock()
			// Sent: wait for its answer whatever ctx does (the request
			// has a timeout of its own).
			s.cfg.Clock.Wait(context.WithoutCancel(ctx), m.done)
			s.mu.Lock()
			continue
		}
		if ctx.Err() != nil {
			s.removeLocked(m)
			s.left.Add(1)
			s.signalLocked() // it may have been the oldest, told to look
			s.mu.Unlock()
			return nil, notSent(ctx)
		}
		if why := s.mayLaunchLocked(); why != wait {
			if batch := s.takeLocked(m); len(batch) > 0 {
				alone := s.inflight == 0
				if !alone {
					s.beside.Add(1)
					if why == full {
						s.full.Add(1)
					}
				}
				s.inflight++
				s.launched++
				launched := s.launched
				s.lastSent = s.cfg.Clock.Now()
				s.signalLocked() // the next oldest: a full batch may wait too
				s.mu.Unlock()
				s.send(ctx, batch, alone, launched)
				s.mu.Lock()
				s.inflight--
				s.signalLocked()
				continue
			}
		}
		if m.woken {
			m.wake, m.woken = make(chan struct{}), false
		}
		ch := m.wake
		s.mu.Unlock()
		s.cfg.Clock.Wait(ctx, ch) // ctx ending is seen above
		s.mu.Lock()
	}
}

func notSent(ctx context.Context) error {
	return errors.Join(ErrNotSent, context.Cause(ctx))
}

// Why a batch may go, or wait.
const (
	wait = iota
	idle // none in flight
	full // a full batch waits
	held // the hold has passed since the last batch left
)

// mayLaunchLocked says whether a batch may go now, and why: none is in
// flight, or fewer than maxInflight are and a full batch waits or the
// pacer's hold has passed since the last one left. When only the hold
// stands in the way it arms a timer that signals when it has passed; when
// nothing is measured yet, the answer of a batch in flight is the signal.
func (s *Sender) mayLaunchLocked() int {
	switch {
	case s.inflight == 0:
		return idle
	case s.inflight >= maxInflight:
		return wait
	case len(s.queue) >= s.cfg.MaxMembers:
		return full
	}
	hold, ok := s.pace.hold()
	if !ok {
		return wait
	}
	left := hold - s.cfg.Clock.Now().Sub(s.lastSent)
	if left <= 0 {
		return held
	}
	at := s.cfg.Clock.Now().Add(left)
	if s.timer != nil && at.Before(s.timerAt) && s.timer() {
		s.timer = nil // the hold shrank: a timer armed for a longer one is too late
	}
	if s.timer == nil {
		s.timerAt = at
		s.timer = s.cfg.Clock.AfterFunc(left, func() {
			s.mu.Lock()
			if s.timerAt.Equal(at) {
				s.timer = nil
			}
			s.signalLocked()
			s.mu.Unlock()
		})
	}
	return wait
}

// signalLocked wakes the oldest queued write whose caller is still there:
// the one that sends the next batch, if one may go. (Waking every waiting
// caller on every event made each of them take the lock to find nothing
// to do.)
func (s *Sender) signalLocked() {
	for _, m := range s.queue {
		if m.state == queued && m.ctx.Err() == nil {
			m.signal()
			return
		}
	}
}

// signal wakes m (under the Sender's lock).
func (m *member) signal() {
	if !m.woken {
		m.woken = true
		close(m.wake)
	}
}

func (s *Sender) removeLocked(m *member) {
	for i, q := range s.queue {
		if q == m {
			s.queue = append(s.queue[:i], s.queue[i+1:]...)
			return
		}
	}
}

// takeLocked takes the next batch for lead to send: lead's own write
// first, then the others oldest first, within the limits and without
// writing a key twice; members whose caller has left stay, to take
// themselves out. The caller that sends a batch always carries its own
// write: a write left out of the batch its own caller is sending would
// wait, its caller deaf in an etcd call, for a batch it is not in.
func (s *Sender) takeLocked(lead *member) []*member {
	var batch, rest []*member
	written := map[string]bool{}
	bytes := 0
	take := func(m *member) {
		m.state = flying
		batch = append(batch, m)
		bytes += m.size
		for _, k := range m.keys {
			written[k] = true
		}
	}
	take(lead)
	for i, m := range s.queue {
		if m == lead {
			continue
		}
		if len(batch) >= s.cfg.MaxMembers {
			for _, r := range s.queue[i:] {
				if r != lead {
					rest = append(rest, r)
				}
			}
			break
		}
		fits := m.ctx.Err() == nil && bytes+m.size <= s.cfg.MaxBytes
		for _, k := range m.keys {
			fits = fits && !written[k]
		}
		if !fits {
			rest = append(rest, m)
			continue
		}
		take(m)
	}
	s.queue = rest
	return batch
}

// send sends one batch under the context of the caller that leads it and
// answers its members; alone says no other batch flew when it left, and
// launched is the count of batches sent, this one included, when it left.
func (s *Sender) send(ctx context.Context, batch []*member, alone bool, launched int64) {
	start := s.cfg.Clock.Now()
	measure := func() {
		now := s.cfg.Clock.Now()
		s.mu.Lock()
		// Alone: one write, no other batch in flight when it left, and
		// none sent beside it since.
		s.pace.observe(now.Sub(start), alone && len(batch) == 1 && s.launched == launched, now)
		s.mu.Unlock()
	}
	answer := func(m *member, resp *pb.TxnResponse, err error) {
		if m.ctx.Err() != nil {
			s.waited.Add(1) // its caller left while it flew, and waits for this
		}
		s.mu.Lock()
		m.resp, m.err, m.state = resp, err, answered
		close(m.done)
		m.signal() // it may be waiting as it was while queued
		s.mu.Unlock()
	}
	one := func(m *member) error {
		var resp *pb.TxnResponse
		err := s.call(ctx, func(ctx context.Context) (err error) {
			resp, err = s.cfg.KV.Txn(ctx, m.req, callOpts...)
			return err
		})
		answer(m, resp, err)
		return err
	}
	s.batches.Add(1)
	s.members.Add(int64(len(batch)))
	if len(batch) == 1 {
		if one(batch[0]) == nil {
			measure()
		}
		return
	}
	outer := &pb.TxnRequest{Success: make([]*pb.RequestOp, len(batch))}
	for i, m := range batch {
		outer.Success[i] = &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: m.req}}
	}
	var resp *pb.TxnResponse
	err := s.call(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cfg.KV.Txn(ctx, outer, callOpts...)
		return err
	})
	switch {
	case err != nil && !MayHaveLanded(err):
		// Refused as a whole, for what one member holds, or by a state (no
		// leader, no space) that a member alone may be spared (a release
		// is allowed when etcd is full): each on its own.
		s.split.Add(1)
		for _, m := range batch {
			one(m)
		}
	case err != nil:
		for _, m := range batch {
			answer(m, nil, err)
		}
	default:
		measure()
		for i, m := range batch {
			inner := resp.Responses[i].GetResponseTxn()
			answer(m, &pb.TxnResponse{Header: resp.Header, Succeeded: inner.Succeeded, Responses: inner.Responses}, nil)
		}
	}
}

// Queued returns how many writes wait to be sent.
func (s *Sender) Queued() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue)
}

// Alone sends req by itself, never in a batch (a Txn of Txns already, for
// one), with Txn's guarantees.
func (s *Sender) Alone(ctx context.Context, req *pb.TxnRequest) (*pb.TxnResponse, error) {
	var resp *pb.TxnResponse
	err := s.Do(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cfg.KV.Txn(ctx, req, callOpts...)
		return err
	})
	return resp, err
}

// Do sends one request that f makes with the context it is given: not
// batched, with the Sender's try context and its errors classified as
// Txn's are. It returns ErrNotSent if ctx has ended before f was called.
func (s *Sender) Do(ctx context.Context, f func(ctx context.Context) error) error {
	if ctx.Err() != nil {
		return notSent(ctx)
	}
	return s.call(ctx, f)
}

// call makes one etcd request under a try context detached from ctx's
// cancellation: once sent, a request is waited for.
func (s *Sender) call(ctx context.Context, f func(ctx context.Context) error) error {
	tctx, cancel := s.cfg.Try(context.WithoutCancel(ctx))
	defer cancel()
	start := s.cfg.Clock.Now()
	err := f(tctx)
	if s.cfg.Observe != nil {
		s.cfg.Observe(s.cfg.Clock.Now().Sub(start))
	}
	return clientv3.ContextError(tctx, err)
}

// perField bounds the bytes protobuf adds to one compare or op beyond its
// keys and values: tags, lengths, enums, revisions, leases, flags.
const perField = 128

// sizeAtMost returns an upper bound of req's encoded size, for the batch's
// byte limit, without proto.Size's walk through reflection tables (a tenth
// of a write's client CPU when it was measured).
func sizeAtMost(req *pb.TxnRequest) int {
	n := perField
	for _, c := range req.Compare {
		n += perField + len(c.Key) + len(c.RangeEnd) + len(c.GetValue())
	}
	for _, ops := range [][]*pb.RequestOp{req.Success, req.Failure} {
		for _, op := range ops {
			n += perField
			switch r := op.Request.(type) {
			case *pb.RequestOp_RequestPut:
				n += len(r.RequestPut.Key) + len(r.RequestPut.Value)
			case *pb.RequestOp_RequestRange:
				n += len(r.RequestRange.Key) + len(r.RequestRange.RangeEnd)
			case *pb.RequestOp_RequestDeleteRange:
				n += len(r.RequestDeleteRange.Key) + len(r.RequestDeleteRange.RangeEnd)
			case *pb.RequestOp_RequestTxn:
				n += sizeAtMost(r.RequestTxn)
			}
		}
	}
	return n
}
