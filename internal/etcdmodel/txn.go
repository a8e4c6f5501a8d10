package etcdmodel

import "github.com/idem-dev/idem/internal/kernel"

// Response is etcd's answer to a Txn (pb.TxnResponse).
type Response struct {
	Succeeded bool  // the compares held: Then ran
	Rev       int64 // the header revision: the store's after the Txn; 0 in a nested Txn's, as etcd leaves it
	Results   []Result
}

// Result is the answer to one op of the branch that ran: for a Get its
// key (0 or 1 KV) and Count; for a Count its Count alone; for a Delete the
// number of keys it deleted; for a nested Txn its Response; for a Put
// nothing.
type Result struct {
	KVs     []KV
	Count   int64
	Deleted int64
	Txn     *Response
}

// Txn runs t as etcd does, or changes nothing and returns the error:
//   - ErrNotLowered, ErrTooManyOps, ErrEmptyKey, ErrValueProvided,
//     ErrDuplicateKey: the request is refused before anything is read
//     (lowered, checkRequest, checkIntervals);
//   - ErrLeaseNotFound, ErrKeyNotFound: a put on the path taken fails its
//     check (plan).
//
// All writes share the revision Rev()+1, and the revision moves to it
// only if some op changed a key: a Put always does, a Delete if the key
// existed (txn.txn: header revision = txnWrite.Rev(), +1 if it has
// changes).
func (s *Store) Txn(t *kernel.Txn) (*Response, error) {
	if err := lowered(t); err != nil {
		return nil, err
	}
	if err := checkRequest(t, MaxTxnOps); err != nil {
		return nil, err
	}
	for _, branch := range [...][]kernel.Op{t.Then, t.Else} {
		if _, _, err := checkIntervals(branch); err != nil {
			return nil, err
		}
	}
	path, err := s.plan(t, nil)
	if err != nil {
		return nil, err
	}
	w := write{rev: s.rev + 1}
	resp, _ := s.exec(t, path, &w)
	if w.changed {
		s.rev = w.rev
	}
	resp.Rev = s.rev
	return resp, nil
}

// plan decides which branch t and every nested Txn on the branch taken
// run, all against the state before the Txn (txn.compareToPath: a nested
// Txn's compares do not see the ops before it), and checks the puts on
// that path in op order, depth first (txn.checkTxn). It returns path with
// the decisions appended in that order.
func (s *Store) plan(t *kernel.Txn, path []bool) ([]bool, error) {
	ok := s.holds(t.If)
	path = append(path, ok)
	for _, op := range branchOf(t, ok) {
		var err error
		switch op.Kind {
		case kernel.Put:
			err = s.checkPut(op)
		case kernel.Nested:
			path, err = s.plan(txnOf(op), path)
		}
		if err != nil {
			return nil, err
		}
	}
	return path, nil
}

// checkPut is txn.checkPut: the put's lease must exist (checkLease; lease
// 0 is none), and a put that keeps the value or the lease needs the key
// (checkAndGetPrevKV).
func (s *Store) checkPut(op kernel.Op) error {
	if id := leaseOf(op); id != 0 {
		if _, ok := s.findLease(id); !ok {
			return ErrLeaseNotFound
		}
	}
	if op.KeepValue || op.Lease == kernel.KeepLease {
		if _, ok := s.find(op.Key); !ok {
			return ErrKeyNotFound
		}
	}
	return nil
}

// write is what a Txn being applied knows: its revision, and whether it
// changed anything yet.
type write struct {
	rev     int64
	changed bool
}

// exec runs the branch path[0] says of t, in op order, each op seeing the
// writes before it (txn.executeTxn), and returns its response and the rest
// of path.
func (s *Store) exec(t *kernel.Txn, path []bool, w *write) (*Response, []bool) {
	ok := path[0]
	path = path[1:]
	ops := branchOf(t, ok)
	resp := &Response{Succeeded: ok, Results: make([]Result, len(ops))}
	for i, op := range ops {
		r := &resp.Results[i]
		switch op.Kind {
		case kernel.Put:
			s.put(op, w.rev)
			w.changed = true
		case kernel.Delete: // storeTxnWrite.deleteRange: also detaches the key from its lease
			if s.remove(op.Key) {
				r.Deleted = 1
				w.changed = true
			}
		case kernel.Get:
			if kv, found := s.Get(op.Key); found {
				r.KVs, r.Count = []KV{kv}, 1
			}
		case kernel.Count:
			if _, found := s.find(op.Key); found {
				r.Count = 1
			}
		case kernel.Nested:
			r.Txn, path = s.exec(txnOf(op), path, w)
		}
	}
	return resp, path
}

// put is storeTxnWrite.put: a new key gets CreateRev = ModRev = rev and
// Version 1; an existing one ModRev = rev and Version+1, its CreateRev
// kept. KeepValue keeps the value (IgnoreValue), KeepLease the lease
// (IgnoreLease); otherwise the key moves to the op's lease, or to none.
func (s *Store) put(op kernel.Op, rev int64) {
	kv := KV{Key: op.Key, Value: append([]byte(nil), op.Value...), CreateRev: rev, ModRev: rev, Version: 1, Lease: leaseOf(op)}
	if old, ok := s.Get(op.Key); ok {
		kv.CreateRev, kv.Version = old.CreateRev, old.Version+1
		if op.KeepValue {
			kv.Value = old.Value
		}
		if op.Lease == kernel.KeepLease {
			kv.Lease = old.Lease
		}
	}
	s.set(kv)
}

// branchOf is the branch of t that runs when its compares hold (ok) or not.
func branchOf(t *kernel.Txn, ok bool) []kernel.Op {
	if ok {
		return t.Then
	}
	return t.Else
}

// leaseOf is the lease id a lowered put names: op.ID for LeaseID, none (0)
// otherwise (NoLease, and KeepLease, which keeps the key's).
func leaseOf(op kernel.Op) int64 {
	if op.Lease == kernel.LeaseID {
		return op.ID
	}
	return 0
}
