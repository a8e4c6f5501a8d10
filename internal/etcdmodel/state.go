package etcdmodel

import (
	"encoding/binary"
	"hash"
)

// AppendState appends a canonical encoding of the whole state to b and
// returns it: equal states encode equal, different states differently.
// In order: the revision, the last lease id granted, the keys in key
// order with every field, the leases in id order with their ttl. A
// lease's keys are those whose Lease field is its id, so they are
// encoded with the keys.
func (s *Store) AppendState(b []byte) []byte {
	b = binary.AppendVarint(b, s.rev)
	b = binary.AppendVarint(b, s.last)
	b = binary.AppendUvarint(b, uint64(len(s.kvs)))
	for _, kv := range s.kvs {
		b = binary.AppendUvarint(b, uint64(len(kv.Key)))
		b = append(b, kv.Key...)
		b = binary.AppendUvarint(b, uint64(len(kv.Value)))
		b = append(b, kv.Value...)
		for _, n := range [...]int64{kv.CreateRev, kv.ModRev, kv.Version, kv.Lease} {
			b = binary.AppendVarint(b, n)
		}
	}
	b = binary.AppendUvarint(b, uint64(len(s.leases)))
	for _, l := range s.leases {
		b = binary.AppendVarint(b, l.id)
		b = binary.AppendVarint(b, l.ttl)
	}
	return b
}

// Hash writes the state's canonical encoding (AppendState) to h. A model
// checker that hashes many states can reuse a buffer with AppendState
// instead.
func (s *Store) Hash(h hash.Hash64) {
	var buf [256]byte
	h.Write(s.AppendState(buf[:0]))
}
