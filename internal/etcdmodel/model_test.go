package etcdmodel

import (
	"bytes"
	"errors"
	"hash/fnv"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/kernel"
)

// TestNotLowered: what etcd cannot be sent is refused, and nothing changes.
func TestNotLowered(t *testing.T) {
	s := New()
	before := s.AppendState(nil)
	rec := &kernel.Record{Expires: time.Unix(1, 0)}
	for _, tx := range []*kernel.Txn{
		{Then: []kernel.Op{kernel.PutRecord("k", rec)}},
		{Else: []kernel.Op{kernel.PutValue("k", nil, kernel.RetentionLease)}},
		{Then: []kernel.Op{nest(kernel.Txn{Else: []kernel.Op{kernel.PutValue("k", nil, kernel.SessionLease)}})}},
		{Then: []kernel.Op{kernel.PutValue("k", nil, kernel.BucketLease)}},
		{Then: []kernel.Op{{Kind: kernel.Nested + 1, Key: "k"}}},
		{If: []kernel.Cmp{{Key: "k", Target: kernel.Lease + 1}}},
		{If: []kernel.Cmp{{Key: "k", Result: kernel.Less + 1}}},
	} {
		if _, err := s.Txn(tx); !errors.Is(err, ErrNotLowered) {
			t.Errorf("%v: error %v, want ErrNotLowered", tx, err)
		}
	}
	if !bytes.Equal(before, s.AppendState(nil)) {
		t.Fatal("a refused Txn changed the state")
	}
}

// TestCloneAndState: a clone is independent of its original, and equal
// states, however reached, encode (and hash) equal.
func TestCloneAndState(t *testing.T) {
	a := New()
	id := a.Grant(10)
	mustTxn(t, a, &kernel.Txn{Then: []kernel.Op{put("x", "1"), putOn("y", "2", id)}})
	b := a.Clone()
	mustTxn(t, b, &kernel.Txn{Then: []kernel.Op{put("x", "changed"), kernel.Del("y")}})
	if kv, _ := a.Get("x"); string(kv.Value) != "1" || len(a.Range("")) != 2 {
		t.Fatalf("the clone's writes reached the original: %s", dumpKVs(a.Range("")))
	}
	// c reaches a's state another way: a no-op Txn, a failed one, and the
	// keys written in the other order.
	c := New()
	id = c.Grant(10)
	mustTxn(t, c, &kernel.Txn{If: []kernel.Cmp{kernel.Exists("x")}, Then: []kernel.Op{put("x", "no")}, Else: []kernel.Op{putOn("y", "2", id), put("x", "1")}})
	mustTxn(t, c, &kernel.Txn{Then: []kernel.Op{kernel.Del("z"), kernel.Read("x")}})
	if _, err := c.Txn(&kernel.Txn{Then: []kernel.Op{putOn("x", "9", 7)}}); !errors.Is(err, ErrLeaseNotFound) {
		t.Fatalf("put on lease 7: %v", err)
	}
	if !bytes.Equal(a.AppendState(nil), c.AppendState(nil)) || hashOf(a) != hashOf(c) {
		t.Fatalf("equal states encode differently:\n%x\n%x", a.AppendState(nil), c.AppendState(nil))
	}
	for name, change := range map[string]func(*Store){
		"revision": func(s *Store) { s.rev++ },
		"version":  func(s *Store) { kv, _ := s.Get("x"); kv.Version++; s.set(kv) },
		"value":    func(s *Store) { kv, _ := s.Get("x"); kv.Value = []byte("2"); s.set(kv) },
		"lease":    func(s *Store) { s.Grant(10) },
		"ttl":      func(s *Store) { s.leases[0].ttl++ },
		"key":      func(s *Store) { kv, _ := s.Get("y"); kv.Lease = 0; s.set(kv) },
	} {
		d := a.Clone()
		change(d)
		if bytes.Equal(a.AppendState(nil), d.AppendState(nil)) {
			t.Errorf("a different %s encodes the same", name)
		}
	}
}

// TestExpireIsRevoke: expiry deletes the lease's keys in one revision.
func TestExpireIsRevoke(t *testing.T) {
	a := New()
	id := a.Grant(5)
	mustTxn(t, a, &kernel.Txn{Then: []kernel.Op{putOn("x", "1", id), putOn("y", "1", id), put("z", "1")}})
	b := a.Clone()
	if err := a.Expire(id); err != nil {
		t.Fatal(err)
	}
	if err := b.Revoke(id); err != nil {
		t.Fatal(err)
	}
	if a.Rev() != 3 || len(a.Range("")) != 1 || !bytes.Equal(a.AppendState(nil), b.AppendState(nil)) {
		t.Fatalf("expire: rev %d, keys %s", a.Rev(), dumpKVs(a.Range("")))
	}
	for _, err := range []error{a.Expire(id), a.Revoke(id), a.KeepAlive(id)} {
		if !errors.Is(err, ErrLeaseNotFound) {
			t.Fatalf("after expiry: %v", err)
		}
	}
}

func mustTxn(t *testing.T, s *Store, tx *kernel.Txn) *Response {
	t.Helper()
	r, err := s.Txn(tx)
	if err != nil {
		t.Fatalf("%v: %v", tx, err)
	}
	return r
}

func hashOf(s *Store) uint64 {
	h := fnv.New64a()
	s.Hash(h)
	return h.Sum64()
}
