package etcdmodel

import (
	"slices"
	"strings"
)

// KV is a key as etcd holds it (mvccpb.KeyValue). Lease 0 is no lease.
type KV struct {
	Key       string
	Value     []byte
	CreateRev int64 // the revision that created the key
	ModRev    int64 // the revision that last wrote it
	Version   int64 // how many puts since it was created: 1 after the first
	Lease     int64
}

// Store is the state of an etcd keyspace at one revision: its keys and
// leases. The zero Store is not ready: use New.
//
// Values are never modified in place: a Store, its clones and the KVs it
// returns share them, and callers must not modify a returned Value.
type Store struct {
	rev    int64
	kvs    []KV    // sorted by Key
	leases []lease // sorted by id
	last   int64   // the last lease id granted
}

// lease is a granted lease. Its keys are the KVs whose Lease is its id.
type lease struct {
	id, ttl int64
}

// New returns an empty store at revision 1, as a fresh etcd cluster is.
func New() *Store { return &Store{rev: 1} }

// Clone returns an independent copy of s (values shared, see Store).
func (s *Store) Clone() *Store {
	return &Store{rev: s.rev, kvs: slices.Clone(s.kvs), leases: slices.Clone(s.leases), last: s.last}
}

// Rev returns the current revision: the revision of the last change.
func (s *Store) Rev() int64 { return s.rev }

// Get returns key, and whether it exists.
func (s *Store) Get(key string) (KV, bool) {
	i, ok := s.find(key)
	if !ok {
		return KV{}, false
	}
	return s.kvs[i], true
}

// Range returns the keys that start with prefix, sorted by key (a Range
// WithPrefix; etcd sorts by key too).
func (s *Store) Range(prefix string) []KV {
	i, _ := s.find(prefix)
	j := i
	for j < len(s.kvs) && strings.HasPrefix(s.kvs[j].Key, prefix) {
		j++
	}
	if i == j {
		return nil
	}
	return slices.Clone(s.kvs[i:j])
}

// find returns the index of key in s.kvs, or where it would go.
func (s *Store) find(key string) (int, bool) {
	return slices.BinarySearchFunc(s.kvs, key, func(kv KV, k string) int { return strings.Compare(kv.Key, k) })
}

// set writes kv, inserting it or replacing the key.
func (s *Store) set(kv KV) {
	i, ok := s.find(kv.Key)
	if ok {
		s.kvs[i] = kv
		return
	}
	s.kvs = slices.Insert(s.kvs, i, kv)
}

// remove deletes key and reports whether it existed.
func (s *Store) remove(key string) bool {
	i, ok := s.find(key)
	if ok {
		s.kvs = slices.Delete(s.kvs, i, i+1)
	}
	return ok
}
