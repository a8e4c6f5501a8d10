package idemhttp

import (
	"context"
	"time"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
)

// Store is what the middleware and the worker API need of idem's store: a
// part of the store contract (idem.Store), which *etcdstore.Store on one
// etcd cluster and *shard.Store over several keep (package idemtest checks
// them), as does any wrapper of them that passes idemtest.
type Store interface {
	Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error)
	Claim(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, opts ...etcdstore.ClaimOption) (*etcdstore.Claim, *etcdstore.Record, error)
	Attach(ctx context.Context, h etcdstore.Handle) (*etcdstore.Claim, error)
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	Wait(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	Retention() time.Duration
	MaxRecordSize() int
}

var _ Store = idem.Store(nil) // the edge needs nothing beyond the contract
