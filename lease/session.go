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
)

// Session is one process incarnation's liveness in etcd: a lease kept alive in
// the background and an owner key attached to it. A new Session always has a
// new owner id, so claims of a dead incarnation never look alive again.
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

// NewSession grants a lease of ttl, starts keeping it alive and writes the
// owner key prefix+owner on it. The keepalive goroutine runs until the lease
// can no longer be renewed or Close is called; Done reports its end.
func NewSession(ctx context.Context, client *clientv3.Client, prefix string, ttl time.Duration) (*Session, error) {
	if ttl < MinTTL || ttl%time.Second != 0 {
		return nil, fmt.Errorf("session: ttl %v must be a whole number of seconds, at least %v", ttl, MinTTL)
	}
	ctx = clientv3.WithRequireLeader(ctx) // a cut-off member fails fast
	g, err := client.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return nil, fmt.Errorf("session: grant lease: %w", err)
	}
	owner := uuid.NewString()
	s := &Session{client: client, owner: owner, key: prefix + owner, id: g.ID, ttl: ttl, done: make(chan struct{})}
	kctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	ka, err := client.KeepAlive(kctx, g.ID)
	if err != nil {
		cancel()
		s.revoke()
		return nil, fmt.Errorf("session: keep lease alive: %w", err)
	}
	go func() {
		defer close(s.done)
		for range ka { // drain: the channel closes when renewal stops
		}
	}()
	host, _ := os.Hostname()
	info, _ := json.Marshal(struct {
		Host    string `json:"host"`
		PID     int    `json:"pid"`
		Started string `json:"started"`
	}{host, os.Getpid(), time.Now().UTC().Format(time.RFC3339)})
	if _, err := client.Put(ctx, s.key, string(info), clientv3.WithLease(g.ID)); err != nil {
		s.Close()
		return nil, fmt.Errorf("session: write owner key: %w", err)
	}
	return s, nil
}

// Owner returns the owner id: unique to this session, never reused.
func (s *Session) Owner() string { return s.owner }

// Key returns the owner key, which exists exactly while the session lives.
func (s *Session) Key() string { return s.key }

// Lease returns the session's lease.
func (s *Session) Lease() clientv3.LeaseID { return s.id }

// TTL returns the session lease's TTL.
func (s *Session) TTL() time.Duration { return s.ttl }

// Done returns a channel that is closed when the lease is no longer renewed:
// it expired, was revoked, or the session was closed.
func (s *Session) Done() <-chan struct{} { return s.done }

// Close stops renewing the lease and revokes it, which deletes the owner key at
// once so other processes can take over this session's claims without waiting
// for the TTL. If the revoke fails the lease still expires after its TTL.
func (s *Session) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.cancel()
		<-s.done
		err = s.revoke()
	})
	return err
}

func (s *Session) revoke() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.ttl)
	defer cancel()
	_, err := s.client.Revoke(ctx, s.id)
	if err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("session: revoke lease: %w", err)
	}
	return nil
}
