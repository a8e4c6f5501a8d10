// Package fencing carries idem's fencing tokens to downstream systems and lets
// those systems refuse writes from a worker that has lost its claim.
//
// A Token is the etcd revision at which a worker claimed (or took over) an
// idempotency key. Tokens are totally ordered across one etcd cluster: every
// takeover of a key produces a strictly greater token than the claim it
// replaced. A downstream system that remembers the highest token it has
// accepted for a resource, and refuses anything lower, cannot be overwritten by
// a slow worker that was declared dead while it was still running.
//
// What this package does not guarantee:
//
//   - Tokens from two different etcd clusters are not comparable. A downstream
//     system fed by two idem deployments on separate clusters must keep their
//     tokens apart (for example, per resource and per cluster).
//   - The Checker is an in-memory, single-process guard. It fences writes that
//     pass through that process only, and forgets everything on restart. A
//     downstream database must store the highest token next to the data it
//     protects and compare in the same statement that writes; see the SQL
//     pattern in the Checker documentation.
//   - A token proves a claim was held when it was issued, not that it is still
//     held. Fencing only works when the downstream write itself checks it.
//
// This package has no dependency on etcd, so a downstream service can check
// tokens without linking an etcd client.
package fencing
