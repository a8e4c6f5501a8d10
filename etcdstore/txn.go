package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/send"
)

// casResult is the answer of a compare-and-set Txn.
type casResult struct {
	ok  bool    // the compare held and the Then ops ran
	rev int64   // the revision of the Txn: the Put's ModRevision when ok
	cur *Record // the record as it stood, from the Else branch, when !ok; nil when absent
	// ownerGone is true when the Txn checked an owner key (owner != "")
	// and it did not exist: the session behind the write has ended.
	ownerGone bool
	// epoch and set are the shard epoch and shard set etcd holds, when
	// the Txn was guarded by them (WithEpochs) and did not apply.
	epoch int64
	set   Value
}

// write is one write of a Txn's Then branch: a Put on a lease, or a Delete.
type write struct {
	key    string
	value  []byte
	lease  clientv3.LeaseID
	delete bool
}

// cond is one compare of a Txn: a key's CreateRevision or ModRevision
// against a value. Built here rather than with clientv3.Compare, which
// deep-copies through reflection.
type cond struct {
	key    string
	mod    bool // ModRevision; CreateRevision otherwise
	result pb.Compare_CompareResult
	value  int64
	// is: compare the key's value to this instead (EQUAL).
	is    string
	isVal bool
}

func created(key string, result pb.Compare_CompareResult, v int64) cond {
	return cond{key: key, result: result, value: v}
}

func modified(key string, v int64) cond {
	return cond{key: key, mod: true, result: pb.Compare_EQUAL, value: v}
}

func valueIs(key, v string) cond { return cond{key: key, result: pb.Compare_EQUAL, is: v, isVal: true} }

func (c cond) pb() *pb.Compare {
	if c.isVal {
		return &pb.Compare{Key: []byte(c.key), Target: pb.Compare_VALUE, Result: c.result, TargetUnion: &pb.Compare_Value{Value: []byte(c.is)}}
	}
	if c.mod {
		return &pb.Compare{Key: []byte(c.key), Target: pb.Compare_MOD, Result: c.result, TargetUnion: &pb.Compare_ModRevision{ModRevision: c.value}}
	}
	return &pb.Compare{Key: []byte(c.key), Target: pb.Compare_CREATE, Result: c.result, TargetUnion: &pb.Compare_CreateRevision{CreateRevision: c.value}}
}

func (c cond) cmp() clientv3.Cmp {
	op := map[pb.Compare_CompareResult]string{pb.Compare_EQUAL: "=", pb.Compare_GREATER: ">", pb.Compare_LESS: "<", pb.Compare_NOT_EQUAL: "!="}[c.result]
	if c.isVal {
		return clientv3.Compare(clientv3.Value(c.key), op, c.is)
	}
	if c.mod {
		return clientv3.Compare(clientv3.ModRevision(c.key), op, c.value)
	}
	return clientv3.Compare(clientv3.CreateRevision(c.key), op, c.value)
}

// cas runs If(cmps [, owner key exists]) Then(w, extra...) Else(Get(record)
// [, count owner key]): one round trip that either writes or tells the
// caller what the record is now. An undecodable record in the Else branch
// is returned as an error wrapping ErrCorrupt.
//
// Without extra ops the Txn goes out as a protobuf request through the
// client's connection (its retries, auth and interceptors apply), which
// spares clientv3's deep copy of every compare on the hot path.
func (s *Store) cas(ctx context.Context, k Key, owner string, cmps []cond, w write, extra []clientv3.Op) (casResult, error) {
	ekey := s.ks.record(k)
	var okey string
	if owner != "" {
		okey = s.ks.owner(owner)
		cmps = append(cmps, created(okey, pb.Compare_GREATER, 0))
	}
	guarded := false // a claim or move under a shard epoch (WithEpochs)
	for _, c := range cmps {
		guarded = guarded || s.epochs && c.key == s.epochKey()
	}
	var resp *clientv3.TxnResponse
	var err error
	if len(extra) == 0 {
		req := &pb.TxnRequest{Compare: make([]*pb.Compare, len(cmps)), Success: []*pb.RequestOp{w.pb()},
			Failure: []*pb.RequestOp{{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(ekey)}}}}}
		for i, c := range cmps {
			req.Compare[i] = c.pb()
		}
		if okey != "" {
			req.Failure = append(req.Failure, &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(okey), CountOnly: true}}})
		}
		if guarded {
			req.Failure = append(req.Failure, &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(s.epochKey())}}},
				&pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte(s.setKey())}}})
		}
		var r *pb.TxnResponse
		r, err = s.kv.Txn(ctx, req, []string{w.key})
		resp = (*clientv3.TxnResponse)(r)
	} else {
		els := []clientv3.Op{clientv3.OpGet(ekey)}
		if okey != "" {
			els = append(els, clientv3.OpGet(okey, clientv3.WithCountOnly()))
		}
		if guarded {
			els = append(els, clientv3.OpGet(s.epochKey()), clientv3.OpGet(s.setKey()))
		}
		ifs := make([]clientv3.Cmp, len(cmps))
		for i, c := range cmps {
			ifs[i] = c.cmp()
		}
		err = s.kv.Do(ctx, func(ctx context.Context) (err error) {
			resp, err = s.client.Txn(ctx).If(ifs...).Then(append([]clientv3.Op{w.op()}, extra...)...).Else(els...).Commit()
			return err
		})
	}
	if errors.Is(err, rpctypes.ErrNoSpace) {
		s.noteFull(true)
	}
	if err != nil {
		return casResult{}, err
	}
	if !w.delete {
		s.noteFull(false) // a Put was accepted: etcd has room again
	}
	if resp.Succeeded {
		return casResult{ok: true, rev: resp.Header.Revision}, nil
	}
	res := casResult{rev: resp.Header.Revision}
	if okey != "" {
		res.ownerGone = resp.Responses[1].GetResponseRange().Count == 0
	}
	if guarded {
		n := len(resp.Responses)
		if kvs := resp.Responses[n-2].GetResponseRange().Kvs; len(kvs) > 0 {
			if res.epoch, err = parseEpoch(kvs[0].Value); err != nil {
				return casResult{}, notApplied{err}
			}
		}
		res.set = Value{Name: ShardSetValue}
		if kvs := resp.Responses[n-1].GetResponseRange().Kvs; len(kvs) > 0 {
			res.set.Value, res.set.Revision = kvs[0].Value, kvs[0].ModRevision
		}
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if res.cur, err = s.decode(ctx, k, kvs[0]); err != nil {
			// etcd answered that it ran the Else branch: whatever kept us
			// from reading the record (a dictionary we could not fetch),
			// the write did not land.
			return casResult{}, notApplied{err}
		}
	}
	return res, nil
}

// notApplied is the error of a write that etcd answered it did not apply
// (its Else branch ran) but whose answer the store could not read.
type notApplied struct{ err error }

func (e notApplied) Error() string { return e.err.Error() }
func (e notApplied) Unwrap() error { return e.err }

func (w write) pb() *pb.RequestOp {
	if w.delete {
		return &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: []byte(w.key)}}}
	}
	return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte(w.key), Value: w.value, Lease: int64(w.lease)}}}
}

func (w write) op() clientv3.Op {
	if w.delete {
		return clientv3.OpDelete(w.key)
	}
	return clientv3.OpPut(w.key, string(w.value), clientv3.WithLease(w.lease))
}

// retryable reports whether an etcd error may be retried by the store with
// the same attempt: the request may or may not have been applied, and
// trying again is safe because every write is conditional and the attempt id
// lets the store recognise its own earlier write.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil || err == nil || errors.Is(err, ErrInvalidArgument) {
		return false
	}
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return true // definitely not applied; the caller refreshes the lease
	}
	// etcd's own errors carry their gRPC code; others may be transport
	// errors. A request timeout (not the caller's) surfaces as
	// DeadlineExceeded while ctx is still alive: the outcome is unknown.
	switch etcdCode(err) {
	case codes.Unavailable, codes.Unknown, codes.Internal, codes.Aborted, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

// etcdCode returns the gRPC code of an error from etcd.
func etcdCode(err error) codes.Code {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code()
	}
	return status.Code(err)
}

// mayHaveLanded reports whether a write that failed with err may have been
// applied all the same (send.MayHaveLanded), except that an answer etcd
// gave but the store could not read (ErrCorrupt, or a dictionary it could
// not fetch: the Else branch ran) says it did not.
func mayHaveLanded(err error) bool {
	return send.MayHaveLanded(err) && !errors.Is(err, ErrCorrupt) && !errors.As(err, new(notApplied))
}

// landing follows the tries of one write: once a try may have landed, the
// write as a whole may have, and a later try that was never sent
// (ErrNotSent) no longer speaks for it. Every loop that retries a write
// passes each try's error through it.
type landing struct{ maybe bool }

// failed notes a try's error and returns the error the write reports.
func (l *landing) failed(err error) error {
	switch {
	case mayHaveLanded(err):
		l.maybe = true
	case l.maybe && errors.Is(err, ErrNotSent):
		// This try never left, but an earlier one may have landed.
		return fmt.Errorf("an earlier try may have landed; the last was not sent (%v)", err)
	}
	return err
}

// backoff sleeps, on the store's clock, before retry try (0-based), or
// returns false when ctx ends first.
func (a *Admin) backoff(ctx context.Context, try int) bool {
	return clock.Sleep(a.clock, ctx, time.Duration(25<<min(try, 5))*time.Millisecond) == nil
}

// maxTries bounds the store's own retries of one etcd write.
const maxTries = 4
