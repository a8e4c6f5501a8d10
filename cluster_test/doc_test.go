// Package cluster_test proves idem under faults on embedded multi-member etcd
// clusters: leaders killed, minority partitions, an isolated leader, a worker
// paused (SIGSTOP) past its session lease, client links blackholed and
// delayed, WAN latency between members, member restarts.
//
// Every scenario runs many clients with retries and client timeouts against
// a fault, heals, lets every key settle, and then checks invariants:
//
//   - every key's work took effect once at the downstream sink;
//   - no acknowledged outcome was lost: every key that answered once is done,
//     with that answer;
//   - every replay is byte-identical to the first outcome;
//   - the history of every client operation is linearizable (porcupine)
//     against a per-key model of the store;
//   - the fault fired: leaders changed, takeovers happened, proxy counters
//     moved, stale writes were refused. A scenario whose fault did not fire
//     fails as invalid.
//
// The default run keeps each scenario short. Set IDEM_SOAK=1 (or -soak) for
// longer runs: see docs/TESTING.md.
package cluster_test
