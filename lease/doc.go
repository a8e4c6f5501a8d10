// Package lease manages the two kinds of etcd lease idem uses.
//
// Buckets hands out retention leases. Time is cut into buckets (one hour by
// default); every record written during a bucket, by any process, is attached
// to one of that bucket's leases, whose TTL keeps the record for at least the
// retention. A quiet day therefore uses a couple of dozen leases (a busy one a
// few more, below), not one per key: etcd revokes leases at a bounded rate (about 1000/s) and a lease per
// key would both halve write throughput and stall the cluster when a day's
// worth of keys expires at once. The lease of a bucket is found through a key
// claimed with CreateRevision == 0, so concurrent processes agree on one lease.
// A busy bucket rolls over to further leases after DefaultMaxUses writes, so
// no lease holds so many keys that its expiry (one raft entry deleting them
// all) stalls the cluster.
//
// Session is a process's liveness: one lease kept alive by the process and one
// owner key attached to it. While the key exists, the claims the process holds
// are live; once the lease expires (the process died, or was cut off from etcd
// for longer than the TTL) the key vanishes and its claims may be taken over.
//
// What is not guaranteed:
//
//   - A lease fires on the etcd leader's clock, and etcd resets every lease to
//     its full TTL on a leader change unless lease checkpointing is enabled
//     (feature gates LeaseCheckpoint and LeaseCheckpointPersist on etcd 3.6+,
//     --experimental-enable-lease-checkpoint on 3.4/3.5). Retention is
//     therefore "at least", and idem records also carry their own expiry so a
//     retention that has passed is honoured before the lease deletes them.
//   - A Session's Done channel closes when the client stops being able to
//     renew the lease, which can be later than the moment etcd expired it. Work
//     that outlives its session is stopped by fencing, not by this signal.
package lease
