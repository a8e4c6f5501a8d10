package idemhttp

import (
	"context"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// Store is what the middleware and the worker API need of idem's store:
// an *etcdstore.Store on one etcd cluster, or a *shard.Store over several.
type Store interface {
	Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error)
	Claim(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, opts ...etcdstore.ClaimOption) (*etcdstore.Claim, *etcdstore.Record, error)
	Attach(ctx context.Context, h etcdstore.Handle) (*etcdstore.Claim, error)
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	Wait(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	Retention() time.Duration
	MaxRecordSize() int
}

var _ Store = (*etcdstore.Store)(nil)
