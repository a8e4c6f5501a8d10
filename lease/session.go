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

	"github.com/idem-dev/idem/internal/sim"
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
	owner  string
	key    string
	id     clientv3.LeaseID
	ttl    time.Duration

	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
}

// NewSession grants a lease of ttl, writes the owner key prefix+owner on it,
// and starts keeping the lease alive. The keepalive goroutine runs until the
// lease can no longer be renewed or Close is called; Done reports its end.
func NewSession(ctx context.Context, client *clientv3.Client, prefix string, ttl time.Duration) (*Session, error) {
	if ttl < MinTTL || ttl%time.Second != 0 {
		return nil, fmt.Errorf("session: ttl %v must be a whole number of seconds, at least %v", ttl, MinTTL)
	}
	// The session's own calls: a fault-injecting simulation leaves them be.
	ctx = sim.WithTag(clientv3.WithRequireLeader(ctx), "session") // a cut-off member fails fast
	sent := time.Now()
	g, err := client.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return nil, fmt.Errorf("session: grant lease: %w", err)
	}
	owner := uuid.NewString()
	s := &Session{client: client, owner: owner, key: prefix + owner, id: g.ID, ttl: ttl, done: make(chan struct{})}
	host, _ := os.Hostname()
	info, _ := json.Marshal(struct {
		Host    string `json:"host"`
		PID     int    `json:"pid"`
		Started string `json:"started"`
	}{host, os.Getpid(), time.Now().UTC().Format(time.RFC3339)})
	if _, err := client.Put(ctx, s.key, string(info), clientv3.WithLease(g.ID)); err != nil {
		s.revoke()
		return nil, fmt.Errorf("session: write owner key: %w", err)
	}
	kctx, cancel := context.WithCancel(sim.WithTag(context.Background(), "session"))
	s.cancel = cancel
	var poke <-chan struct{}
	if h := sim.Lookup(client); h != nil {
		poke = h.Renew
	}
	go s.keepAlive(kctx, sent.Add(time.Duration(g.TTL)*time.Second), poke)
	return s, nil
}

// keepAlive renews the lease until ctx ends, etcd says the lease is gone,
// or the lease may have expired: expire is the latest time it surely has
// not, counted from when the last successful renewal was sent (etcd counts
// from when it arrived, later), so the session is given up no later than
// etcd lets it go.
// poke, from a simulation, asks for a renewal at once.
func (s *Session) keepAlive(ctx context.Context, expire time.Time, poke <-chan struct{}) {
	defer close(s.done)
	interval := s.ttl / 3
	tryTimeout := s.ttl / 4
	next := time.Now().Add(interval)
	retry := 50 * time.Millisecond
	for {
		t := time.NewTimer(time.Until(minTime(next, expire)))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		case <-poke:
			t.Stop()
		}
		if !time.Now().Before(expire) {
			return // not renewed in time: the lease may be gone in etcd
		}
		sent := time.Now()
		tctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), min(tryTimeout, time.Until(expire)))
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
			next = time.Now().Add(retry)
			retry = min(2*retry, interval/2)
		case ctx.Err() != nil:
			return
		default:
			// Try again soon, as a new RPC: most likely on another member.
			next = time.Now().Add(retry)
			retry = min(2*retry, interval/2)
		}
	}
}

// ownerKeyGone reports whether a linearizable read finds the owner key
// absent. An error is not an answer: the caller tries again.
func (s *Session) ownerKeyGone(ctx context.Context, timeout time.Duration) bool {
	rctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), timeout)
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
func (s *Session) Close() error {
	var err error
	s.closeOnce.Do(func() {
		if s.cancel != nil {
			s.cancel()
			<-s.done
		}
		err = s.revoke()
	})
	return err
}

// revoke revokes the lease, retrying for up to its TTL (after which it has
// expired anyway), each try on its own short timeout so that a hung member
// does not hold it.
func (s *Session) revoke() error {
	ctx, cancel := context.WithTimeout(sim.WithTag(clientv3.WithRequireLeader(context.Background()), "session"), s.ttl)
	defer cancel()
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		tctx, tcancel := context.WithTimeout(ctx, s.ttl/4)
		_, err := s.client.Revoke(tctx, s.id)
		tcancel()
		if err == nil || errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return nil
		}
		if c := status.Code(err); c != codes.Unavailable && c != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("session: revoke lease: %w", err) // a closed client, a denied request: no retry mends it
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("session: revoke lease: %w", err)
		case <-time.After(wait):
		}
	}
}
