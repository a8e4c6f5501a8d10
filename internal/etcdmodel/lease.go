package etcdmodel

import (
	"cmp"
	"slices"
)

// Grant grants a lease of ttl seconds and returns its id: 1, 2, 3... in
// grant order. The ttl is kept but time is not modelled (see Expire).
func (s *Store) Grant(ttl int64) int64 {
	s.last++
	s.leases = append(s.leases, lease{id: s.last, ttl: ttl})
	return s.last
}

// Revoke deletes the lease and every key attached to it, all in one
// revision, and none if it had no keys (lessor.Revoke deletes them in one
// write txn, which moves the revision only if it changed something). It
// returns ErrLeaseNotFound if there is no such lease.
func (s *Store) Revoke(id int64) error {
	i, ok := s.findLease(id)
	if !ok {
		return ErrLeaseNotFound
	}
	s.leases = slices.Delete(s.leases, i, i+1)
	n := len(s.kvs)
	s.kvs = slices.DeleteFunc(s.kvs, func(kv KV) bool { return kv.Lease == id })
	if len(s.kvs) != n {
		s.rev++
	}
	return nil
}

// Expire is the lease running out of time: etcd's leader then revokes it
// (lessor.revokeExpiredLeases, then a LeaseRevoke through raft), so it is
// Revoke.
func (s *Store) Expire(id int64) error { return s.Revoke(id) }

// KeepAlive renews the lease: a no-op, time not being modelled. It returns
// ErrLeaseNotFound if there is no such lease (lessor.Renew).
func (s *Store) KeepAlive(id int64) error {
	if _, ok := s.findLease(id); !ok {
		return ErrLeaseNotFound
	}
	return nil
}

// Keys returns the keys attached to the lease, sorted (TimeToLive
// WithAttachedKeys), or ErrLeaseNotFound. etcd answers TimeToLive of an
// unknown lease with TTL -1 rather than an error.
func (s *Store) Keys(id int64) ([]string, error) {
	if _, ok := s.findLease(id); !ok {
		return nil, ErrLeaseNotFound
	}
	var keys []string
	for _, kv := range s.kvs {
		if kv.Lease == id {
			keys = append(keys, kv.Key)
		}
	}
	return keys, nil
}

// Leases returns the ids of the leases granted and not yet revoked, in
// increasing order.
func (s *Store) Leases() []int64 {
	ids := make([]int64, len(s.leases))
	for i, l := range s.leases {
		ids[i] = l.id
	}
	return ids
}

// TTL returns the ttl the lease was granted with, or ErrLeaseNotFound.
func (s *Store) TTL(id int64) (int64, error) {
	i, ok := s.findLease(id)
	if !ok {
		return 0, ErrLeaseNotFound
	}
	return s.leases[i].ttl, nil
}

// findLease returns the index of lease id in s.leases.
func (s *Store) findLease(id int64) (int, bool) {
	return slices.BinarySearchFunc(s.leases, id, func(l lease, id int64) int { return cmp.Compare(l.id, id) })
}
