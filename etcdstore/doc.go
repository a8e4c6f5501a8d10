// Package etcdstore is idem's idempotency store on etcd: it makes a
// non-idempotent operation (a charge, an email, a POST) safe to retry across
// processes and data centres.
//
// A client names one logical operation with a Key and sends it on every
// retry. Do (or Claim and Complete, for callers that hold the steps
// themselves) claims the key atomically, runs the work once, saves its first
// outcome and replays it to every retry with the same parameters.
//
// # What a claim guarantees
//
//   - Claims are linearizable etcd transactions. For one key, at most one
//     caller at a time holds a live claim: a claim is won by a Txn comparing
//     CreateRevision == 0, and a stale claim is taken over by a
//     compare-and-set on the record's ModRevision, which one caller wins.
//   - Each claim has a fencing token, the etcd revision at which it was
//     made. Every takeover yields a strictly greater token. Complete,
//     Checkpoint, Release and Abandon are conditioned on the record still
//     being the one this claim last wrote: a worker that was taken over can
//     no longer save, checkpoint or delete anything (ErrFenced).
//   - An outcome once saved is final: every later request with the same key
//     and fingerprint gets it, byte for byte, until retention ends. A request
//     with different parameters gets ErrMismatch and never a replay.
//   - A claim's reply that was lost (timeout, reset connection) does not
//     strand the key: a retry with the same attempt id recognises its own
//     claim, and a claim of this process (without a deadline) that nobody
//     here runs any more is taken over at once by the next request.
//
// # What it does not guarantee
//
//   - The work can run more than once. A claim is taken over when its owner's
//     session lease expires or its deadline passes; a worker that was only
//     slow or partitioned may still be running. It cannot save its outcome,
//     but whatever it did outside etcd, it did. Exactly-once effects need the
//     work itself to be fenced or idempotent downstream: send Claim.Token
//     with every downstream write and have the downstream refuse lower tokens
//     (package fencing), or pass your own key on (charge:<orderId>).
//     Effects that live in etcd can commit in Complete's own Txn, and are
//     then exactly-once.
//   - An error wrapping ErrUnavailable leaves the outcome of that write
//     unknown: it may have been applied. The store retries its own writes
//     with the same attempt id; callers retry Claim with WithAttempt, or
//     Complete with the same outcome.
//   - Retention is "at least": records are deleted by shared etcd leases some
//     time after they expire, and are treated as absent once their own expiry
//     passes (on the reading machine's clock). After retention, the same key
//     is a new operation: clients must stop retrying well inside it.
//   - Deadlines (WithDeadline) and record expiry compare wall clocks of
//     different machines; keep them synchronised and allow for skew.
//
// # Data in etcd
//
// Under a prefix (default "/idem/"): a record per key at k/<tenant>/<id> on a
// shared retention lease (a few per hour bucket, never one per key), an
// owner key per process at o/<owner> on its session lease, and a key per
// retention bucket at l/... naming the bucket's lease. See
// docs/ARCHITECTURE.md for each transaction.
package etcdstore
