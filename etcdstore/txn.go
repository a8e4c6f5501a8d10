package etcdstore

import (
	"context"
	"errors"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// casResult is the answer of a compare-and-set Txn.
type casResult struct {
	ok  bool    // the compare held and the Then ops ran
	rev int64   // the revision of the Txn: the Put's ModRevision when ok
	cur *Record // the record as it stood, from the Else branch, when !ok; nil when absent
	// ownerGone is true when the Txn checked an owner key (owner != "")
	// and it did not exist: the session behind the write has ended.
	ownerGone bool
}

// cas runs If(cmps [, owner key exists]) Then(then) Else(Get(record) [, count
// owner key]): one round trip that either writes or tells the caller what
// the record is now. An undecodable record in the Else branch is returned as
// an error wrapping ErrCorrupt.
func (s *Store) cas(ctx context.Context, k Key, owner string, cmps []clientv3.Cmp, then []clientv3.Op) (casResult, error) {
	ekey := s.ks.record(k)
	els := []clientv3.Op{clientv3.OpGet(ekey)}
	if owner != "" {
		okey := s.ks.owner(owner)
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(okey), ">", 0))
		els = append(els, clientv3.OpGet(okey, clientv3.WithCountOnly()))
	}
	rctx, cancel := s.request(ctx)
	defer cancel()
	resp, err := s.client.Txn(rctx).If(cmps...).Then(then...).Else(els...).Commit()
	if err != nil {
		return casResult{}, err
	}
	if resp.Succeeded {
		return casResult{ok: true, rev: resp.Header.Revision}, nil
	}
	res := casResult{rev: resp.Header.Revision}
	if owner != "" {
		res.ownerGone = resp.Responses[1].GetResponseRange().Count == 0
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if res.cur, err = decode(k, kvs[0]); err != nil {
			return casResult{}, err
		}
	}
	return res, nil
}

// retryable reports whether an etcd error may be retried by the store with
// the same attempt: the request may or may not have been applied, and
// trying again is safe because every write is conditional and the attempt id
// lets the store recognise its own earlier write.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil || err == nil {
		return false
	}
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return true // definitely not applied; the caller refreshes the lease
	}
	// etcd's own errors carry their gRPC code; others may be transport
	// errors. A request timeout (not the caller's) surfaces as
	// DeadlineExceeded while ctx is still alive: the outcome is unknown.
	code := status.Code(err)
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		code = ee.Code()
	}
	switch code {
	case codes.Unavailable, codes.Unknown, codes.Internal, codes.Aborted, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

// backoff sleeps before retry try (0-based), or returns false when ctx ends
// first.
func backoff(ctx context.Context, try int) bool {
	d := time.Duration(25<<min(try, 5)) * time.Millisecond
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// maxTries bounds the store's own retries of one etcd write.
const maxTries = 4
