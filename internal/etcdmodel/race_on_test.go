//go:build race

package etcdmodel

// raceOn: the race detector slows etcd several times over, so the
// differential test runs fewer operations under it.
const raceOn = true
