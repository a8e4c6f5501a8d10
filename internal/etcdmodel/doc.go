// Package etcdmodel is a small, deterministic, in-memory model of the etcd
// v3 semantics idem relies on: single-key Txns (compares, puts, deletes,
// gets, counts and nested Txns, expressed as a kernel.Txn) and leases.
//
// It is meant for a model checker: a Store has no goroutines, no clock and
// no I/O, Clone is two slice copies, and AppendState writes a canonical
// encoding of the whole state, so equal states hash equal.
//
// Every rule is taken from etcd v3.7's source and cited where it is
// implemented here:
//
//   - A Txn is refused before anything is read when it is malformed
//     (v3rpc's checkTxnRequest: too many ops, an empty key, IgnoreValue with a
//     value) or when one branch writes a key twice (v3rpc's checkIntervals:
//     ErrDuplicateKey). Both branches are checked, whichever would run.
//   - Then the compares of the Txn, and of every nested Txn on the branch
//     taken, are all evaluated against the state before the Txn
//     (txn.compareToPath): a nested Txn's compares do not see the writes of
//     the ops before it.
//   - Then the puts on the path taken are checked against that same state
//     (txn.checkTxn, checkPut): a lease that does not exist fails the Txn
//     with ErrLeaseNotFound, IgnoreValue or IgnoreLease on an absent key with
//     ErrKeyNotFound. Nothing is applied.
//   - Then the ops run in order (txn.executeTxn), each seeing the writes of
//     the ops before it; all writes share one revision, and the revision
//     moves by one if and only if some op changed a key (storeTxnWrite.End).
//   - Revoking a lease (or its expiry) deletes its keys in one revision
//     (lessor.Revoke), none if it had none.
//
// The model keeps a key's lease only in the key (KV.Lease): etcd's lessor
// keeps the same relation from the other side, and the two never disagree,
// so a lease's keys are the keys whose Lease is its id.
//
// Lease ids are 1, 2, 3... in grant order; etcd's differ, so a test that
// compares the two maps them. Time is not modelled: a lease expires when
// Expire is called.
package etcdmodel
