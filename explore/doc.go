// Package explore is idem's fault-schedule explorer, in the spirit of
// FoundationDB's simulation tests and Jepsen's nemeses. It has no code of
// its own outside its tests: run it with
//
//	go test ./explore                          # a few thousand schedules
//	go test ./explore -run TestExplore -seed N # replay one schedule exactly
//	IDEM_EXPLORE_SOAK=1 go test ./explore -timeout 60m
//
// A schedule is a small world on a real embedded etcd: three idem
// processes (stores, each with its own etcd client and HTTP proxy), a few
// keys, and actors that use them: Do, Claim+Checkpoint+Complete, worker-API
// claims held WithoutSession and carried between processes by handle,
// clients of the proxy whose upstream answers, breaks off, times out or
// cannot be reached, and read-only Wait observers. Every etcd call an actor
// makes goes through a fault injector that, driven by the seed, lets it
// succeed, fails it before it reaches etcd, applies it and loses its
// reply, or holds it (before or after etcd applies it) while other actors
// run. A nemesis ends sessions, crashes processes, closes them gracefully
// and moves the simulated clock past deadlines.
//
// The world is deterministic: one actor runs at a time, the seed picks
// which, and the store's clock, deadline timers and background retries are
// driven by the explorer through internal/sim. A schedule's seed therefore
// replays it exactly (the same faults at the same calls, in the same
// order). After each schedule the explorer heals every fault, lets pending
// background writes finish, and checks the invariants listed in
// invariants_test.go.
package explore
