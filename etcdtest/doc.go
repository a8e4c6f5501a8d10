// Package etcdtest runs real etcd clusters inside a test process, to test
// code built on etcd (idem's store, and services built on idem) against the
// faults a network and a cluster have: partitions, a paused member, a killed
// and restarted member, slow links.
//
// A cluster is 1, 3 or 5 embedded etcd members (go.etcd.io/etcd/server/v3/embed)
// on loopback ports the kernel picks, so tests run in parallel, started
// by one call and stopped with the test:
//
//	c := etcdtest.Start(t, 3, etcdtest.Options{Proxies: true})
//	cli := c.MustClient(t, c.ProxiedEndpoints()...)
//
// With Options.Proxies, every member has a TCP proxy in front of its peer
// port (advertised to the other members, so all raft traffic to it crosses
// the proxy) and one in front of its client port. The faults:
//
//   - Isolate(i) cuts member i off from the others in both directions
//     (etcd's own CutPeer on both sides, as etcd's integration framework
//     does, and its peer proxy dropping what still arrives); WaitIsolated
//     proves it took effect; Reconnect(i) or Heal undoes it.
//   - Pause(i) makes member i look stopped: isolated, and its client proxy
//     holding every request open without an answer.
//   - Member.Kill stops a member at once, as a crash; Member.Stop stops it
//     gracefully; Member.Restart starts it again on its data.
//   - Proxy.Delay adds latency (and jitter) to a link, Proxy.Blackhole drops
//     everything silently, Proxy.Hold keeps everything until Heal (a
//     partition TCP outlives), Proxy.DropConnections resets connections.
//   - Leader, WaitLeader and LeaderOf tell where the leader is.
//
// Start and MustClient clean up with the test. A package whose tests share
// one cluster uses Main in its TestMain; New starts a cluster outside a
// test (a benchmark program).
//
// For a store on a cluster in one call, see package
// github.com/idem-dev/idem/etcdstore/etcdstoretest.
//
// Members run with fsync off unless Options.Fsync: most tests are not about
// disk durability, and fsync on a shared CI disk dominates their time.
package etcdtest
