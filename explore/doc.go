// Package explore is idem's fault-schedule explorer, in the spirit of
// FoundationDB's simulation tests and Jepsen's nemeses. It has no code of
// its own outside its tests: run it with
//
//	go test ./explore                          # a minute of schedules
//	go test ./explore -run TestExplore -seed N # replay one schedule exactly
//	IDEM_EXPLORE_SOAK=1 go test ./explore -run 'TestExplore$' -timeout 60m
//
// A schedule is a small world on a real embedded etcd: three idem
// processes (stores built as idem serve builds them: group commit, the
// expiry sweeper, compressed records, the cache and shard epochs; each with
// its own etcd client, HTTP proxy and gRPC interceptor), a few keys, and
// actors that use them: Do, Claim+Checkpoint+Complete, worker-API claims
// held WithoutSession and carried between processes by handle, bulk
// writers whose writes meet in batches, clients of the proxy whose
// upstream answers, breaks off, times out or cannot be reached, gRPC
// callers, jobs, and read-only Wait observers. Every etcd call goes
// through a fault injector: each fault site (who calls, which RPC, which
// fault) is switched on for a whole schedule with some probability and
// then fires with another, as FoundationDB's BUGGIFY does. A nemesis ends
// sessions, crashes processes, closes them gracefully, cuts a process off,
// skews and moves the simulated clock, raises the shard epoch, and takes
// and restores snapshots.
//
// The world is deterministic: one actor runs at a time, the seed picks
// which, and every store runs on a simulated clock handed to it through
// etcdstore.WithClock, the seam through which production stores get the
// real clock; the store's timers and background work (batches, the
// sweeper, retried final writes) are the explorer's to schedule. A
// schedule's seed therefore replays it exactly. After each schedule the
// explorer heals every fault, checks liveness (every key done or free,
// every job ended or parked, within a bound in simulated time), and checks
// the invariants listed in invariants_test.go. A coverage ledger counts
// the fault sites fired and the store's paths reached; a long run fails
// when an expected path was never reached.
package explore
