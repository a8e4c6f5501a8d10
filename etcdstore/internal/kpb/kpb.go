// Package kpb writes the kernel's transactions (internal/kernel) in etcd's
// protobuf and client types: compares, reads, deletes and nested Txns.
// Puts are the store's to encode (a record's value and lease are chosen
// by the store), and are handed in already written.
package kpb

import (
	"fmt"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/internal/kernel"
)

var targets = [...]pb.Compare_CompareTarget{kernel.CreateRev: pb.Compare_CREATE, kernel.ModRev: pb.Compare_MOD,
	kernel.Version: pb.Compare_VERSION, kernel.Value: pb.Compare_VALUE, kernel.Lease: pb.Compare_LEASE}

var results = [...]pb.Compare_CompareResult{kernel.Equal: pb.Compare_EQUAL, kernel.NotEqual: pb.Compare_NOT_EQUAL,
	kernel.Greater: pb.Compare_GREATER, kernel.Less: pb.Compare_LESS}

// Compare is c in etcd's protobuf.
func Compare(c kernel.Cmp) *pb.Compare {
	p := &pb.Compare{Key: []byte(c.Key), Target: targets[c.Target], Result: results[c.Result]}
	switch c.Target {
	case kernel.CreateRev:
		p.TargetUnion = &pb.Compare_CreateRevision{CreateRevision: c.Num}
	case kernel.ModRev:
		p.TargetUnion = &pb.Compare_ModRevision{ModRevision: c.Num}
	case kernel.Version:
		p.TargetUnion = &pb.Compare_Version{Version: c.Num}
	case kernel.Value:
		p.TargetUnion = &pb.Compare_Value{Value: c.Value}
	case kernel.Lease:
		p.TargetUnion = &pb.Compare_Lease{Lease: c.Num}
	}
	return p
}

// Compares is cs in etcd's protobuf.
func Compares(cs []kernel.Cmp) []*pb.Compare {
	out := make([]*pb.Compare, len(cs))
	for i, c := range cs {
		out[i] = Compare(c)
	}
	return out
}

// Op is a read, a delete or a nested Txn (of reads, deletes and nested
// Txns) in etcd's protobuf. A Put is refused: the store encodes those.
func Op(op kernel.Op) (*pb.RequestOp, error) {
	switch op.Kind {
	case kernel.Get, kernel.Count:
		return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(op.Key), CountOnly: op.Kind == kernel.Count}}}, nil
	case kernel.Delete:
		return &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: []byte(op.Key)}}}, nil
	case kernel.Nested:
		t, err := Txn(op.Txn)
		if err != nil {
			return nil, err
		}
		return &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: t}}, nil
	}
	return nil, fmt.Errorf("kpb: a %v is the store's to encode", op)
}

// Ops is ops in etcd's protobuf (no Puts).
func Ops(ops []kernel.Op) ([]*pb.RequestOp, error) {
	out := make([]*pb.RequestOp, len(ops))
	for i, op := range ops {
		r, err := Op(op)
		if err != nil {
			return nil, err
		}
		out[i] = r
	}
	return out, nil
}

// Txn is t in etcd's protobuf, when it puts nothing.
func Txn(t *kernel.Txn) (*pb.TxnRequest, error) {
	then, err := Ops(t.Then)
	if err != nil {
		return nil, err
	}
	els, err := Ops(t.Else)
	if err != nil {
		return nil, err
	}
	return &pb.TxnRequest{Compare: Compares(t.If), Success: then, Failure: els}, nil
}

// Cmps is cs as clientv3's compares.
func Cmps(cs []kernel.Cmp) []clientv3.Cmp {
	out := make([]clientv3.Cmp, len(cs))
	for i, c := range cs {
		out[i] = clientv3.FromCompare(Compare(c))
	}
	return out
}

// ClientOps is ops as clientv3's: puts (with their lease, or
// IgnoreLease, and IgnoreValue), deletes and reads.
func ClientOps(ops []*pb.RequestOp) []clientv3.Op {
	out := make([]clientv3.Op, len(ops))
	for i, r := range ops {
		switch r := r.Request.(type) {
		case *pb.RequestOp_RequestPut:
			p := r.RequestPut
			o := []clientv3.OpOption{clientv3.WithLease(clientv3.LeaseID(p.Lease))}
			if p.IgnoreLease {
				o = []clientv3.OpOption{clientv3.WithIgnoreLease()}
			}
			if p.IgnoreValue {
				o = append(o, clientv3.WithIgnoreValue())
			}
			out[i] = clientv3.OpPut(string(p.Key), string(p.Value), o...)
		case *pb.RequestOp_RequestDeleteRange:
			out[i] = clientv3.OpDelete(string(r.RequestDeleteRange.Key))
		case *pb.RequestOp_RequestRange:
			var o []clientv3.OpOption
			if r.RequestRange.CountOnly {
				o = append(o, clientv3.WithCountOnly())
			}
			out[i] = clientv3.OpGet(string(r.RequestRange.Key), o...)
		}
	}
	return out
}
