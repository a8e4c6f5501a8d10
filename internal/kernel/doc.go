// Package kernel is idem's record protocol as a deterministic state
// machine: every decision idem makes about a record, and nothing else.
//
// Given a record as read (with its revisions), a request, and the caller's
// view of time, session and epoch, the kernel returns the answer, or the
// etcd transaction to send (its compares and ops, as data) and what each
// outcome of that transaction means: applied, refused (its Else branch
// ran), refused for space, or failed, "may have landed" included. The
// caller does the storage, the network and the time: package etcdstore
// executes the kernel's transactions on etcd, package shard and package
// jobs route and schedule around them, and the model checker
// (internal/kernel/check) executes them on an in-memory model of etcd,
// where every interleaving of a small world is explored.
//
// As etcd's raft package does for consensus, nothing here does I/O,
// reads a clock, or starts a goroutine: a decision depends on its inputs
// alone, so every one of them can be enumerated in a test (the decision
// table, TestDecisionTable) and replayed in the model checker. The
// operations that take several round trips are machines: Next returns
// the action to take (read, send, wait, or the answer), and the caller
// feeds back what happened (Read, Sent, Owner, Awaited).
//
// The rules are those of docs/ARCHITECTURE.md ("The claim protocol"),
// whose decision table is generated from this package's test.
package kernel
