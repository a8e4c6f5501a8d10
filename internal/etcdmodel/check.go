package etcdmodel

import (
	"fmt"
	"slices"

	"github.com/idem-dev/idem/internal/kernel"
)

// The checks of a Txn request before anything is read: the model's own
// (lowered), then etcd's (v3rpc's kvServer.Txn: checkTxnRequest, then
// checkIntervals of each branch). They depend on the request alone, so
// both branches are checked, whichever would run.

// lowered checks that every compare and op of t can be sent to etcd: a put
// of a value (not a Record) on no lease, a lease id, or the key's lease
// (KeepLease, etcd's IgnoreLease).
func lowered(t *kernel.Txn) error {
	for _, c := range t.If {
		if c.Target > kernel.Lease || c.Result > kernel.Less {
			return fmt.Errorf("%w: compare %v", ErrNotLowered, c)
		}
	}
	for _, branch := range [...][]kernel.Op{t.Then, t.Else} {
		for _, op := range branch {
			if err := loweredOp(op); err != nil {
				return err
			}
		}
	}
	return nil
}

// loweredOp is lowered for one op (a nested Txn's, recursively).
func loweredOp(op kernel.Op) error {
	switch op.Kind {
	case kernel.Put:
		if op.Record != nil {
			return fmt.Errorf("%w: %v puts a record", ErrNotLowered, op)
		}
		if op.Lease != kernel.NoLease && op.Lease != kernel.LeaseID && op.Lease != kernel.KeepLease {
			return fmt.Errorf("%w: %v names lease kind %d, not an id", ErrNotLowered, op, op.Lease)
		}
	case kernel.Delete, kernel.Get, kernel.Count:
	case kernel.Nested:
		return lowered(txnOf(op))
	default:
		return fmt.Errorf("%w: op kind %d", ErrNotLowered, op.Kind)
	}
	return nil
}

// checkRequest is v3rpc's checkTxnRequest: at most maxOps compares, and
// ops in each branch (a nested Txn gets what its parent left: maxOps less
// the parent's largest count); no empty key; no put that both keeps the
// value and gives one (checkPutRequest). The first failure, in the order
// compares, Then, Else, depth first, is the error.
func checkRequest(t *kernel.Txn, maxOps int) error {
	opc := max(len(t.If), len(t.Then), len(t.Else))
	if opc > maxOps {
		return ErrTooManyOps
	}
	for _, c := range t.If {
		if c.Key == "" {
			return ErrEmptyKey
		}
	}
	for _, branch := range [...][]kernel.Op{t.Then, t.Else} {
		for _, op := range branch {
			switch {
			case op.Kind == kernel.Nested:
				if err := checkRequest(txnOf(op), maxOps-opc); err != nil {
					return err
				}
			case op.Key == "":
				return ErrEmptyKey
			case op.Kind == kernel.Put && op.KeepValue && len(op.Value) != 0:
				return ErrValueProvided
			}
		}
	}
	return nil
}

// checkIntervals is v3rpc's checkIntervals, for single keys: it returns
// the keys ops (a branch) puts and deletes, nested Txns included, or
// ErrDuplicateKey. Its rule, with its quirks:
//   - a put may not be deleted by a delete of its own level, wherever
//     that delete stands, nor by a delete of a nested Txn before it;
//   - a nested Txn's puts (of either branch) may not be put by an earlier
//     nested Txn, nor deleted as above; its Then and Else may put the same
//     key (only one runs);
//   - two puts of one level conflict; two deletes never do;
//   - a nested Txn's deletes are not checked against the puts before
//     them: a put in one nested Txn followed by a delete of the key in a
//     later one passes, and both run.
func checkIntervals(ops []kernel.Op) (puts, dels []string, err error) {
	for _, op := range ops {
		if op.Kind == kernel.Delete {
			dels = append(dels, op.Key)
		}
	}
	for _, op := range ops {
		if op.Kind != kernel.Nested {
			continue
		}
		t := txnOf(op)
		putsThen, delsThen, err := checkIntervals(t.Then)
		if err != nil {
			return nil, nil, err
		}
		putsElse, delsElse, err := checkIntervals(t.Else)
		if err != nil {
			return nil, nil, err
		}
		for _, k := range putsThen {
			if slices.Contains(puts, k) || slices.Contains(dels, k) {
				return nil, nil, ErrDuplicateKey
			}
			puts = append(puts, k)
		}
		for _, k := range putsElse {
			if slices.Contains(puts, k) && !slices.Contains(putsThen, k) || slices.Contains(dels, k) {
				return nil, nil, ErrDuplicateKey
			}
			if !slices.Contains(puts, k) {
				puts = append(puts, k)
			}
		}
		dels = append(append(dels, delsThen...), delsElse...)
	}
	for _, op := range ops {
		if op.Kind != kernel.Put {
			continue
		}
		if slices.Contains(puts, op.Key) || slices.Contains(dels, op.Key) {
			return nil, nil, ErrDuplicateKey
		}
		puts = append(puts, op.Key)
	}
	return puts, dels, nil
}

var empty kernel.Txn

// txnOf is the Txn of a Nested op; nil is an empty Txn, as etcd decodes
// an empty RequestTxn.
func txnOf(op kernel.Op) *kernel.Txn {
	if op.Txn == nil {
		return &empty
	}
	return op.Txn
}
