// Package check is a model checker for idem's record protocol: it runs the
// kernel's machines (internal/kernel), the same ones package etcdstore
// executes, against an in-memory model of etcd (internal/etcdmodel), and
// explores every interleaving of a small world exhaustively: which
// process takes its next step, whether a Txn's answer arrives, is lost,
// or the Txn is held in the network to land later (or never), processes
// crashing, sessions expiring, clocks moving and disagreeing, the shard
// epoch raised, the reaper and the final writes retried in the background.
// Each state is hashed; a state met before is not explored again. Every
// transition is checked against idem's invariants (Invariants), and every
// state where nothing more can happen against liveness.
//
// This is what FoundationDB's and TigerBeetle's simulators cannot give:
// not a sample of schedules, but all of them, for a small scope. The
// fault-schedule explorer (package explore) runs the real store on a real
// etcd in worlds too large to enumerate; the two share the invariants'
// names.
//
// The model is kept honest by the differential test of etcdmodel (random
// operation sequences give the same answers and revisions on the model and
// on an embedded etcd).
package check
