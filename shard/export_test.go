package shard

import "github.com/idem-dev/idem/etcdtest"

// Clusters are the package's shared one-member clusters a, b and c, for
// the external tests (the conformance suite).
func Clusters() map[string]*etcdtest.Cluster { return clusters }
