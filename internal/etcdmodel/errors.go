package etcdmodel

import "errors"

// The errors of a Txn and of the lease calls. Those etcd returns carry
// etcd's message; they are sentinels, compared with errors.Is.
var (
	// ErrLeaseNotFound: a put names a lease that does not exist
	// (txn.checkLease), or Revoke, Expire, KeepAlive or Keys does
	// (lessor.Revoke, lessor.Renew).
	ErrLeaseNotFound = errors.New("etcdserver: requested lease not found")
	// ErrKeyNotFound: a put keeps the value or the lease (IgnoreValue,
	// IgnoreLease) of a key that does not exist (txn.checkAndGetPrevKV).
	ErrKeyNotFound = errors.New("etcdserver: key not found")
	// ErrDuplicateKey: a branch writes a key twice (v3rpc's checkIntervals).
	ErrDuplicateKey = errors.New("etcdserver: duplicate key given in txn request")
	// ErrEmptyKey: a compare or an op has an empty key (v3rpc's
	// checkTxnRequest).
	ErrEmptyKey = errors.New("etcdserver: key is not provided")
	// ErrValueProvided: a put keeps the value (IgnoreValue) and gives one
	// (v3rpc's checkPutRequest).
	ErrValueProvided = errors.New("etcdserver: value is provided")
	// ErrTooManyOps: a Txn has more than MaxTxnOps compares or ops in a
	// branch (v3rpc's checkTxnRequest).
	ErrTooManyOps = errors.New("etcdserver: too many operations in txn request")
	// ErrNotLowered: the Txn cannot be sent to etcd as it is: a put of a
	// Record, a put on a lease kind the caller maps to a lease id
	// (RetentionLease, BucketLease, SessionLease), or an op kind, compare
	// target or relation etcd does not have. The model's own error.
	ErrNotLowered = errors.New("etcdmodel: the op must be lowered first")
)

// MaxTxnOps is etcd's default bound on the compares, and on the ops of a
// branch, of one Txn (embed.DefaultMaxTxnOps); idem does not change it.
const MaxTxnOps = 128
