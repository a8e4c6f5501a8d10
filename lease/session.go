package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/google/uuid"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
)

// Session is one process incarnation's liveness in etcd: a lease kept alive in
// the background and an owner key attached to it. A new Session always has a
// new owner id, so claims of a dead incarnation never look alive again.
//
// The lease is renewed every third of its TTL, each renewal a short stream
// of its own with a timeout and WithRequireLeader, rather than one stream
// for the client's lifetime: a stream stays on the member it was opened to,
// and a member that is paused or cut off from the quorum would hold the
// renewals until the lease expired. A failed renewal is retried at once,
// as a new RPC, which the client's balancer sends to the next member.
type Session struct {
	client *clientv3.Client
	clock  clock.Clock
	owner  string
	key    string
	id     clientv3.LeaseID
	ttl    time.Duration

	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
}

// Option configures a Session or Buckets.
type Option func(*options)

type options struct{ clock clock.Clock }

// WithClock sets the clock the Session or Buckets run on: its time, its
// timers, its goroutine and its waits (default clock.Real).
func WithClock(c clock.Clock) Option {
	return func(o *options) {
		if c != nil {
			o.clock = c
		}
	}
}

func applyOptions(opts []Option) options {
	o := options{clock: clock.Real}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// NewSession grants a lease of ttl, writes the owner key prefix+owner on it,
// and starts keeping the lease alive. The keepalive runs, as background
// work of the session's clock, until the lease can no longer be renewed or
// Close is called; Done reports its end.
func NewSession(ctx context.Context, client *clientv3.Client, prefix string, ttl time.Duration, opts ...Option) (*Session, error) {
	if ttl < MinTTL || ttl%time.Second != 0 {
		return nil, fmt.Errorf("session: ttl %v must be a whole number of seconds, at least %v", ttl, MinTTL)
	}
	o := applyOptions(opts)
	ctx = clientv3.WithRequireLeader(ctx) // a cut-off member fails fast
	sent := o.clock.Now()
	g, err := client.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return nil, fmt.Errorf("session: grant lease: %w", err)
	}
	owner := uuid.NewString()
	s := &Session{client: client, clock: o.clock, owner: owner, key: prefix + owner, id: g.ID, ttl: ttl, done: make(chan struct{})}
	host, _ := os.Hostname()
	info, _ := json.Marshal(struct {
		Host    string `json:"host"`
		PID     int    `json:"pid"`
		Started string `json:"started"`
	}{host, os.Getpid(), o.clock.Now().UTC().Format(time.RFC3339)})
	if _, err := client.Put(ctx, s.key, string(info), clientv3.WithLease(g.ID)); err != nil {
		s.revoke(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("session: write owner key: %w", err)
	}
	kctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	expire := sent.Add(time.Duration(g.TTL) * time.Second)
	o.clock.Go(kctx, "session "+owner, func(ctx context.Context) { s.keepAlive(ctx, expire) })
	return s, nil
}

// keepAlive renews the lease until ctx ends, etcd says the lease is gone,
// or the lease may have expired: expire is the latest time it surely has
// not, counted from when the last successful renewal was sent (etcd counts
// from when it arrived, later), so the session is given up no later than
// etcd lets it go.
func (s *Session) keepAlive(ctx context.Context, expire time.Time) {
	defer close(s.done)
	c := s.clock
	interval := s.ttl / 3
	tryTimeout := s.ttl / 4
	next := c.Now().Add(interval)
	retry := 50 * time.Millisecond
	for {
		if clock.Sleep(c, ctx, minTime(next, expire).Sub(c.Now())) != nil {
			return
		}
		if !c.Now().Before(expire) {
			return // not renewed in time: the lease may be gone in etcd
		}
		sent := c.Now()
		tctx, cancel := c.WithTimeout(clientv3.WithRequireLeader(ctx), min(tryTimeout, expire.Sub(sent)))
		resp, err := s.client.KeepAliveOnce(tctx, s.id)
		cancel()
		switch {
		case err == nil && resp.TTL > 0:
			expire = sent.Add(time.Duration(resp.TTL) * time.Second)
			next = sent.Add(interval)
			retry = 50 * time.Millisecond
		case err == nil, errors.Is(err, rpctypes.ErrLeaseNotFound):
			// Expired or revoked, says the member that answered. A leader
			// that was paused and has not yet learnt that it was replaced
			// may say so of a lease the cluster keeps: believe it only if a
			// linearizable read (which needs a quorum) finds the owner key
			// gone too.
			if s.ownerKeyGone(ctx, tryTimeout) {
				return
			}
			next = c.Now().Add(retry)
			retry = min(2*retry, interval/2)
		case ctx.Err() != nil:
			return
		default:
			// Try again soon, as a new RPC: most likely on another member.
			next = c.Now().Add(retry)
			retry = min(2*retry, interval/2)
		}
	}
}

// ownerKeyGone reports whether a linearizable read finds the owner key
// absent. An error is not an answer: the caller tries again.
func (s *Session) ownerKeyGone(ctx context.Context, timeout time.Duration) bool {
	rctx, cancel := s.clock.WithTimeout(clientv3.WithRequireLeader(ctx), timeout)
	defer cancel()
	resp, err := s.client.Get(rctx, s.key, clientv3.WithCountOnly())
	return err == nil && resp.Count == 0
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// Owner returns the owner id: unique to this session, never reused.
func (s *Session) Owner() string { return s.owner }

// Lease returns the session's lease.
func (s *Session) Lease() clientv3.LeaseID { return s.id }

// Done returns a channel that is closed when the lease is no longer renewed:
// it expired, was revoked, could not be renewed within its TTL, or the
// session was closed.
func (s *Session) Done() <-chan struct{} { return s.done }

// Close stops renewing the lease and revokes it, which deletes the owner key at
// once so other processes can take over this session's claims without waiting
// for the TTL. If the revoke fails the lease still expires after its TTL.
func (s *Session) Close() error { return s.CloseContext(context.Background()) }

// CloseContext is Close; ctx says, to a simulated clock, who is closing
// (its cancellation is ignored: the revoke is bounded by the TTL).
func (s *Session) CloseContext(ctx context.Context) error {
	var err error
	s.closeOnce.Do(func() {
		ctx := context.WithoutCancel(ctx)
		if s.cancel != nil {
			s.cancel()
			s.clock.Wait(ctx, s.done)
		}
		err = s.revoke(ctx)
	})
	return err
}

// revoke revokes the lease, retrying for up to its TTL (after which it has
// expired anyway), each try on its own short timeout so that a hung member
// does not hold it.
func (s *Session) revoke(ctx context.Context) error {
	ctx, cancel := s.clock.WithTimeout(clientv3.WithRequireLeader(ctx), s.ttl)
	defer cancel()
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		tctx, tcancel := s.clock.WithTimeout(ctx, s.ttl/4)
		_, err := s.client.Revoke(tctx, s.id)
		timedOut := tctx.Err() != nil && ctx.Err() == nil // this try's own timeout, whatever the clock calls it
		tcancel()
		if err == nil || errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return nil
		}
		if c := status.Code(err); !timedOut && c != codes.Unavailable && c != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("session: revoke lease: %w", err) // a closed client, a denied request: no retry mends it
		}
		if clock.Sleep(s.clock, ctx, wait) != nil {
			return fmt.Errorf("session: revoke lease: %w", err)
		}
	}
}
