package etcdmodel

import (
	"context"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/internal/kernel"
)

// realEtcd is a fresh single-member etcd (revision 1, no keys, no
// leases), stopped with the test.
type realEtcd struct {
	cli *clientv3.Client
	kv  pb.KVClient
}

// startEtcd starts a fresh member on loopback ports the kernel picks. Fast
// raft ticks make it elect itself at once and make the minimum lease TTL
// 1 s (etcd: ceil(1.5 election timeouts)).
func startEtcd(t *testing.T) *realEtcd {
	t.Helper()
	c := etcdtest.Start(t, 1, etcdtest.Options{TickMs: 10, ElectionMs: 100})
	cli := c.MustClient(t)
	return &realEtcd{cli: cli, kv: pb.NewKVClient(cli.ActiveConnection())}
}

// bounded returns a context that ends with the test or after two
// minutes: a hung etcd fails the test instead of hanging it.
func bounded(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// leaseMap maps the model's lease ids to etcd's and back. A lease
// revoked stays mapped, so a put on it reaches etcd with the id etcd
// gave it.
type leaseMap struct {
	toEtcd, toModel map[int64]int64
}

func newLeaseMap() *leaseMap {
	return &leaseMap{toEtcd: map[int64]int64{0: 0}, toModel: map[int64]int64{0: 0}}
}

func (m *leaseMap) add(model, etcd int64) {
	m.toEtcd[model], m.toModel[etcd] = etcd, model
}

// etcd returns etcd's id for the model's: an id the model never granted
// maps to one etcd never granted (etcd's ids are positive, so its
// negation).
func (m *leaseMap) etcd(id int64) int64 {
	if e, ok := m.toEtcd[id]; ok {
		return e
	}
	return -id
}

// requestPB is t as etcd's TxnRequest, lowered the way etcdstore lowers a
// kernel Txn: KeepValue is IgnoreValue (its Value sent as is), KeepLease
// IgnoreLease, LeaseID the lease's etcd id.
func requestPB(t *kernel.Txn, m *leaseMap) *pb.TxnRequest {
	r := &pb.TxnRequest{}
	for _, c := range t.If {
		r.Compare = append(r.Compare, comparePB(c, m))
	}
	for _, op := range t.Then {
		r.Success = append(r.Success, opPB(op, m))
	}
	for _, op := range t.Else {
		r.Failure = append(r.Failure, opPB(op, m))
	}
	return r
}

func comparePB(c kernel.Cmp, m *leaseMap) *pb.Compare {
	p := &pb.Compare{Key: []byte(c.Key), Result: [...]pb.Compare_CompareResult{
		kernel.Equal: pb.Compare_EQUAL, kernel.NotEqual: pb.Compare_NOT_EQUAL,
		kernel.Greater: pb.Compare_GREATER, kernel.Less: pb.Compare_LESS}[c.Result]}
	switch c.Target {
	case kernel.CreateRev:
		p.Target, p.TargetUnion = pb.Compare_CREATE, &pb.Compare_CreateRevision{CreateRevision: c.Num}
	case kernel.ModRev:
		p.Target, p.TargetUnion = pb.Compare_MOD, &pb.Compare_ModRevision{ModRevision: c.Num}
	case kernel.Version:
		p.Target, p.TargetUnion = pb.Compare_VERSION, &pb.Compare_Version{Version: c.Num}
	case kernel.Value:
		p.Target, p.TargetUnion = pb.Compare_VALUE, &pb.Compare_Value{Value: c.Value}
	case kernel.Lease:
		p.Target, p.TargetUnion = pb.Compare_LEASE, &pb.Compare_Lease{Lease: m.etcd(c.Num)}
	}
	return p
}

func opPB(op kernel.Op, m *leaseMap) *pb.RequestOp {
	key := []byte(op.Key)
	switch op.Kind {
	case kernel.Put:
		p := &pb.PutRequest{Key: key, Value: op.Value, IgnoreValue: op.KeepValue}
		switch op.Lease {
		case kernel.KeepLease:
			p.IgnoreLease = true
		case kernel.LeaseID:
			p.Lease = m.etcd(op.ID)
		}
		return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: p}}
	case kernel.Delete:
		return &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: key}}}
	case kernel.Get:
		return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: key}}}
	case kernel.Count:
		return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: key, CountOnly: true}}}
	}
	return &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: requestPB(txnOf(op), m)}}
}
