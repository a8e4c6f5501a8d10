package etcdmodel

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/internal/kernel"
)

// pair runs every step on the model and on a real etcd, and reports the
// first difference between their answers or their states.
type pair struct {
	ctx    context.Context // bounds every request
	e      *realEtcd
	m      *Store
	ids    *leaseMap
	prefix string // every key of the run starts with it
	last   struct {
		resp *Response // the model's answer to the last Txn
		err  error     // the model's error of the last step
	}
}

func newPair(t *testing.T, prefix string) *pair {
	return &pair{ctx: bounded(t), e: startEtcd(t), m: New(), ids: newLeaseMap(), prefix: prefix}
}

// The kinds of step.
const (
	stepTxn = iota
	stepGrant
	stepRevoke
	stepKeepAlive
	stepKeys
)

// step is one operation of a run. lease is a model lease id.
type step struct {
	kind  int
	txn   *kernel.Txn
	lease int64
}

func (s step) String() string {
	switch s.kind {
	case stepTxn:
		return "txn " + txnString(s.txn)
	case stepGrant:
		return "grant"
	case stepRevoke:
		return fmt.Sprintf("revoke %d", s.lease)
	case stepKeepAlive:
		return fmt.Sprintf("keepalive %d", s.lease)
	}
	return fmt.Sprintf("keys %d", s.lease)
}

// do runs s on both sides and returns how they differ, or nil.
func (p *pair) do(s step) error {
	p.last.err = nil
	switch s.kind {
	case stepTxn:
		return p.txn(s.txn)
	case stepGrant:
		_, err := p.grant(3600)
		return err
	case stepRevoke:
		r, err := p.e.cli.Revoke(p.ctx, clientv3.LeaseID(p.ids.etcd(s.lease)))
		merr := p.m.Revoke(s.lease)
		p.last.err = merr
		if d := sameError(merr, err); d != nil || err != nil {
			return d
		}
		if r.Header.Revision != p.m.Rev() {
			return fmt.Errorf("revoke: revision etcd %d, model %d", r.Header.Revision, p.m.Rev())
		}
		return nil
	case stepKeepAlive:
		_, err := p.e.cli.KeepAliveOnce(p.ctx, clientv3.LeaseID(p.ids.etcd(s.lease)))
		p.last.err = p.m.KeepAlive(s.lease)
		return sameError(p.last.err, err)
	}
	_, p.last.err = p.m.Keys(s.lease)
	return p.keys(s.lease)
}

// grant grants a lease on both sides and returns the model's id.
func (p *pair) grant(ttl int64) (int64, error) {
	r, err := p.e.cli.Grant(p.ctx, ttl)
	if err != nil {
		return 0, fmt.Errorf("etcd grant: %v", err)
	}
	id := p.m.Grant(ttl)
	p.ids.add(id, int64(r.ID))
	return id, nil
}

// txn runs t on both sides; when both refuse it, their states must still
// be equal.
func (p *pair) txn(t *kernel.Txn) error {
	mr, merr := p.m.Txn(t)
	p.last.resp, p.last.err = mr, merr
	er, err := p.e.kv.Txn(p.ctx, requestPB(t, p.ids))
	if d := sameError(merr, err); d != nil {
		return d
	}
	if err != nil {
		return p.sameState()
	}
	if got := p.response(er); !reflect.DeepEqual(got, mr) {
		return fmt.Errorf("responses differ:\n  etcd  %s\n  model %s", dump(got), dump(mr))
	}
	return nil
}

// response is etcd's answer as the model's, lease ids mapped to the
// model's, empty values nil.
func (p *pair) response(r *pb.TxnResponse) *Response {
	out := &Response{Succeeded: r.Succeeded, Rev: r.Header.GetRevision(), Results: make([]Result, len(r.Responses))}
	for i, op := range r.Responses {
		switch v := op.Response.(type) {
		case *pb.ResponseOp_ResponseRange:
			out.Results[i] = Result{KVs: p.kvs(v.ResponseRange.Kvs), Count: v.ResponseRange.Count}
		case *pb.ResponseOp_ResponseDeleteRange:
			out.Results[i] = Result{Deleted: v.ResponseDeleteRange.Deleted}
		case *pb.ResponseOp_ResponseTxn:
			out.Results[i] = Result{Txn: p.response(v.ResponseTxn)}
		}
	}
	return out
}

func (p *pair) kvs(kvs []*mvccpb.KeyValue) []KV {
	var out []KV
	for _, kv := range kvs {
		lease, ok := p.ids.toModel[kv.Lease]
		if !ok {
			lease = -kv.Lease // unknown to the model: shows as a difference
		}
		out = append(out, KV{Key: string(kv.Key), Value: nonEmpty(kv.Value), CreateRev: kv.CreateRevision,
			ModRev: kv.ModRevision, Version: kv.Version, Lease: lease})
	}
	return out
}

// keys compares the keys attached to a lease (TimeToLive WithAttachedKeys;
// TTL -1 is etcd's "no such lease").
func (p *pair) keys(id int64) error {
	r, err := p.e.cli.TimeToLive(p.ctx, clientv3.LeaseID(p.ids.etcd(id)), clientv3.WithAttachedKeys())
	if err != nil {
		return fmt.Errorf("etcd time to live: %v", err)
	}
	var ekeys []string
	for _, k := range r.Keys {
		ekeys = append(ekeys, string(k))
	}
	slices.Sort(ekeys) // etcd lists them from a map
	mkeys, merr := p.m.Keys(id)
	if (r.TTL == -1) != errors.Is(merr, ErrLeaseNotFound) || !slices.Equal(ekeys, mkeys) {
		return fmt.Errorf("lease %d keys: etcd ttl %d %q, model %v %q", id, r.TTL, ekeys, merr, mkeys)
	}
	return nil
}

// sameState compares the revisions, every key of the run and every lease
// with its keys.
func (p *pair) sameState() error {
	r, err := p.e.cli.Get(p.ctx, p.prefix, clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("etcd get: %v", err)
	}
	ekvs, mkvs := p.kvs(r.Kvs), p.m.Range(p.prefix)
	for i := range mkvs {
		mkvs[i].Value = nonEmpty(mkvs[i].Value)
	}
	if r.Header.Revision != p.m.Rev() || !reflect.DeepEqual(ekvs, mkvs) {
		return fmt.Errorf("states differ:\n  etcd  rev %d %s\n  model rev %d %s", r.Header.Revision, dumpKVs(ekvs), p.m.Rev(), dumpKVs(mkvs))
	}
	l, err := p.e.cli.Leases(p.ctx)
	if err != nil {
		return fmt.Errorf("etcd leases: %v", err)
	}
	var eids []int64
	for _, s := range l.Leases {
		eids = append(eids, p.ids.toModel[int64(s.ID)])
	}
	slices.Sort(eids)
	if mids := p.m.Leases(); !slices.Equal(eids, mids) {
		return fmt.Errorf("leases differ: etcd %v, model %v", eids, mids)
	}
	for _, id := range eids {
		if err := p.keys(id); err != nil {
			return err
		}
	}
	return nil
}

// errorPairs are the model's errors and etcd's (as its client returns
// them) that say the same.
var errorPairs = []struct{ model, etcd error }{
	{ErrLeaseNotFound, rpctypes.ErrLeaseNotFound},
	{ErrKeyNotFound, rpctypes.ErrKeyNotFound},
	{ErrDuplicateKey, rpctypes.ErrDuplicateKey},
	{ErrEmptyKey, rpctypes.ErrEmptyKey},
	{ErrValueProvided, rpctypes.ErrValueProvided},
	{ErrTooManyOps, rpctypes.ErrTooManyOps},
}

// sameError returns nil if the model's error and etcd's are both nil or
// say the same.
func sameError(merr, eerr error) error {
	if merr == nil && eerr == nil {
		return nil
	}
	eerr = rpctypes.Error(eerr)
	for _, e := range errorPairs {
		if errors.Is(merr, e.model) && errors.Is(eerr, e.etcd) {
			if merr.Error() != rpctypes.ErrorDesc(eerr) {
				return fmt.Errorf("messages differ: etcd %q, model %q", rpctypes.ErrorDesc(eerr), merr)
			}
			return nil
		}
	}
	return fmt.Errorf("errors differ: etcd %v, model %v", eerr, merr)
}

func nonEmpty(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return b
}

// txnString writes t as kernel's String does, with what a put writes:
// put(key=value@lease), @keep for KeepLease, =keep for KeepValue.
func txnString(t *kernel.Txn) string {
	var b strings.Builder
	branch := func(name string, ops []kernel.Op) {
		b.WriteString(name + " [")
		for i, op := range ops {
			if i > 0 {
				b.WriteString(" ")
			}
			switch op.Kind {
			case kernel.Put:
				v := strconv.Quote(string(op.Value))
				if op.KeepValue {
					v = "keep" + strings.Repeat("+"+v, min(len(op.Value), 1))
				}
				fmt.Fprintf(&b, "put(%s=%s", op.Key, v)
				switch op.Lease {
				case kernel.KeepLease:
					b.WriteString("@keep")
				case kernel.LeaseID:
					fmt.Fprintf(&b, "@%d", op.ID)
				}
				b.WriteString(")")
			case kernel.Nested:
				b.WriteString("txn(" + txnString(txnOf(op)) + ")")
			default:
				b.WriteString(op.String())
			}
		}
		b.WriteString("]")
	}
	b.WriteString("if [")
	for i, c := range t.If {
		if i > 0 {
			b.WriteString(" ")
		}
		b.WriteString(c.String())
	}
	b.WriteString("] ")
	branch("then", t.Then)
	if len(t.Else) > 0 {
		branch(" else", t.Else)
	}
	return b.String()
}

func dump(r *Response) string {
	if r == nil {
		return "nil"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "{ok=%v rev=%d", r.Succeeded, r.Rev)
	for _, x := range r.Results {
		fmt.Fprintf(&b, " [%s count=%d deleted=%d", dumpKVs(x.KVs), x.Count, x.Deleted)
		if x.Txn != nil {
			b.WriteString(" txn=" + dump(x.Txn))
		}
		b.WriteString("]")
	}
	return b.String() + "}"
}

func dumpKVs(kvs []KV) string {
	var b strings.Builder
	for _, kv := range kvs {
		fmt.Fprintf(&b, "%s=%q(c%d m%d v%d l%d) ", kv.Key, kv.Value, kv.CreateRev, kv.ModRev, kv.Version, kv.Lease)
	}
	return strings.TrimSpace(b.String())
}
