package etcdstore

import (
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// sessionLease returns the current session's lease, for tests that kill it.
func (s *Store) sessionLease() clientv3.LeaseID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sess.Lease()
}

// setClock replaces the store's clock.
func (s *Store) setClock(now func() time.Time) { s.now = now }
