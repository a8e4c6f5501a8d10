package etcdmodel

import (
	"bytes"
	"cmp"

	"github.com/idem-dev/idem/internal/kernel"
)

// holds reports whether every compare holds in s (txn.applyCompares).
func (s *Store) holds(cmps []kernel.Cmp) bool {
	for _, c := range cmps {
		kv, ok := s.Get(c.Key)
		if !compare(c, kv, ok) {
			return false
		}
	}
	return true
}

// compare is one compare of key kv (found: it exists), as etcd's
// txn.applyCompare and compareKV: a Value compare of an absent key fails,
// whatever its relation; any other target compares an absent key as all
// zeros (CreateRev, ModRev, Version and Lease 0). Values compare bytewise
// (bytes.Compare: nil and empty are equal), numbers as int64.
func compare(c kernel.Cmp, kv KV, found bool) bool {
	var r int
	switch c.Target {
	case kernel.Value:
		if !found {
			return false
		}
		r = bytes.Compare(kv.Value, c.Value)
	case kernel.CreateRev:
		r = cmp.Compare(kv.CreateRev, c.Num)
	case kernel.ModRev:
		r = cmp.Compare(kv.ModRev, c.Num)
	case kernel.Version:
		r = cmp.Compare(kv.Version, c.Num)
	case kernel.Lease:
		r = cmp.Compare(kv.Lease, c.Num)
	}
	switch c.Result {
	case kernel.Equal:
		return r == 0
	case kernel.NotEqual:
		return r != 0
	case kernel.Greater:
		return r > 0
	case kernel.Less:
		return r < 0
	}
	return true // etcd: an unknown relation holds (lowered refuses it first)
}
