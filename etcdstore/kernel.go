package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore/internal/kpb"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"
)

// The store is the kernel's shell: every decision about a record is the
// kernel's (internal/kernel), and the store executes it: it reads, sends
// the kernel's Txns to etcd (encoding records, choosing their leases),
// waits, and feeds back what happened.

// kcfg is the store's constant part of every kernel decision.
func (s *Store) kcfg() kernel.Config {
	// Every store guards its claims with the epoch (outside a shard set,
	// the epoch alone, 0 until a restore raises it): a store learns a raise
	// from the first claim it refuses (review: a store that had not seen
	// the restore claimed under epoch 0 after another raised it, and its
	// takeover's token went down).
	return kernel.Config{Keys: kernel.Keys{Prefix: s.ks.prefix}, Retention: s.retention, Epochs: s.epochs, EpochGuard: true}
}

// view is the store's view of its world for a decision on key k.
func (s *Store) view(k Key) kernel.View {
	v := kernel.View{Now: s.now(), Epoch: s.epoch.Load(), HeldHere: func(a string) bool { return s.runningHere(k, a) }}
	if s.epochs {
		v.SetRev = s.shardSet().Revision
	}
	return v
}

// learn takes what a refused guarded write taught of the shard.
func (s *Store) learn(n kernel.Notes) {
	if n.Found {
		s.observe(true)
	}
	if n.NewSet {
		s.noteSet(namedValue{Name: shardSetValue, Value: n.Set.Value, Revision: n.Set.Rev})
	}
	if n.NewEpoch {
		if was := s.epoch.Load(); n.Epoch < was {
			if n.Rev > s.epochAt.Load() {
				// Epochs only grow: a restore took it back. (An answer
				// older than the one that taught the epoch believed in is
				// only late: review.)
				s.sawEpochBack(was, n.Epoch)
			}
			return
		}
		s.noteEpoch(n.Epoch, n.Rev) // the epoch was raised: claim under it
	}
}

var (
	kernelKinds = map[Kind]kernel.Kind{KindKey: kernel.KindKey, KindJob: kernel.KindJob}
	storeKinds  = map[kernel.Kind]Kind{kernel.KindKey: KindKey, kernel.KindJob: KindJob}
)

var kernelStates = map[State]kernel.State{InFlight: kernel.InFlight, Done: kernel.Done, Moved: kernel.Moved}
var storeStates = map[kernel.State]State{kernel.InFlight: InFlight, kernel.Done: Done, kernel.Moved: Moved}

// kernelRecord is r as the kernel knows it (nil: absent).
func kernelRecord(r *Record) *kernel.Record {
	if r == nil {
		return nil
	}
	kr := &kernel.Record{
		State: kernelStates[r.State], Fingerprint: r.Fingerprint, Owner: r.Owner, Attempt: r.Attempt,
		Token: int64(r.Token), Created: r.Created, Expires: r.Expires, Deadline: r.Deadline,
		Checkpoint: r.Checkpoint, Takeovers: r.Takeovers, MovedTo: r.MovedTo, Epoch: r.Epoch,
		Fence: r.Fence, Revision: r.Revision, Lease: r.Lease, Kind: kernelKinds[r.Kind], CutShort: r.CutShort,
	}
	if o := r.Outcome; o != nil {
		kr.Outcome = &kernel.Outcome{Status: o.Status, Header: o.Header, Body: o.Body, Err: o.Err}
	}
	return kr
}

// storeRecord is the kernel's record kr of key k (nil: absent).
func storeRecord(k Key, kr *kernel.Record) *Record {
	if kr == nil {
		return nil
	}
	r := &Record{
		Key: k, State: storeStates[kr.State], Fingerprint: kr.Fingerprint, Owner: kr.Owner, Attempt: kr.Attempt,
		Token: fencing.Token(kr.Token), Created: kr.Created, Expires: kr.Expires, Deadline: kr.Deadline,
		Checkpoint: kr.Checkpoint, Takeovers: kr.Takeovers, MovedTo: kr.MovedTo, Epoch: kr.Epoch,
		Fence: kr.Fence, Revision: kr.Revision, Lease: kr.Lease, Kind: storeKinds[kr.Kind], CutShort: kr.CutShort,
	}
	if o := kr.Outcome; o != nil {
		r.Outcome = &Outcome{Status: o.Status, Header: o.Header, Body: o.Body, Err: o.Err}
	}
	return r
}

// kernelOutcome is o as the kernel knows it.
func kernelOutcome(o *Outcome) *kernel.Outcome {
	return &kernel.Outcome{Status: o.Status, Header: o.Header, Body: o.Body, Err: o.Err}
}

// exec sends the kernel's Txn t about key k's record, with the caller's
// own ops (extra) in its Then branch, and returns what became of it. A
// retention lease etcd no longer knows is refreshed once.
func (s *Store) exec(ctx context.Context, k Key, t *kernel.Txn, extra []clientv3.Op) kernel.Reply {
	if err := s.refusal(); err != nil {
		return s.failed(ctx, err) // not sent: the epoch is being raised after a restore
	}
	for refreshed := false; ; refreshed = true {
		floor := s.floor()
		resp, leases, err := s.send(ctx, k, t, extra)
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && !refreshed && len(leases) > 0 {
			for _, id := range leases {
				s.buckets.Invalidate(id)
				s.dicts.Forget(id)
			}
			continue
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && len(extra) > 0 {
			// Not found with a fresh bucket lease too: a lease of the
			// caller's ops. Nothing was applied.
			err = fmt.Errorf("%w: a lease in the extra ops does not exist (%v)", ErrInvalidArgument, err)
		}
		r := s.reply(ctx, k, t, resp, err, floor)
		if r.Delivery == kernel.Applied && len(leases) > 0 {
			r.Lease = int64(leases[0]) // the answered record is the stored one
		}
		return r
	}
}

// send encodes t and sends it: through the group commit, or, with the
// caller's own ops, as a Txn of its own. It returns the retention leases
// its records were put on.
func (s *Store) send(ctx context.Context, k Key, t *kernel.Txn, extra []clientv3.Op) (*clientv3.TxnResponse, []clientv3.LeaseID, error) {
	var leases []clientv3.LeaseID
	then := make([]*pb.RequestOp, 0, len(t.Then))
	var keys []string
	for _, op := range t.Then {
		r, id, err := s.requestOp(ctx, k, op)
		if err != nil {
			return nil, leases, err
		}
		if id != 0 {
			leases = append(leases, id)
		}
		then = append(then, r)
		keys = append(keys, op.Key)
	}
	els, err := kpb.Ops(t.Else)
	if err != nil {
		return nil, leases, err
	}
	req := &pb.TxnRequest{Compare: kpb.Compares(t.If), Success: then, Failure: els}
	if len(extra) == 0 {
		r, err := s.kv.Txn(ctx, req, keys)
		return (*clientv3.TxnResponse)(r), leases, err
	}
	var resp *clientv3.TxnResponse
	err = s.kv.Do(ctx, func(ctx context.Context) (err error) {
		resp, err = s.client.Txn(ctx).If(kpb.Cmps(t.If)...).Then(append(kpb.ClientOps(req.Success), extra...)...).Else(kpb.ClientOps(req.Failure)...).Commit()
		return err
	})
	return resp, leases, err
}

// requestOp encodes one op of a Then branch: a record on the retention
// lease that outlives its expiry, or a value on the lease its op names.
func (s *Store) requestOp(ctx context.Context, k Key, op kernel.Op) (*pb.RequestOp, clientv3.LeaseID, error) {
	if op.Kind != kernel.Put {
		r, err := kpb.Op(op)
		return r, 0, err
	}
	put := &pb.PutRequest{Key: []byte(op.Key), Value: op.Value, IgnoreValue: op.KeepValue}
	var id clientv3.LeaseID
	var err error
	switch op.Lease {
	case kernel.RetentionLease:
		id, err = s.buckets.Until(ctx, s.now(), op.Until)
	case kernel.BucketLease:
		id, err = s.buckets.For(ctx, s.now())
	case kernel.SessionLease:
		var sess interface{ Lease() clientv3.LeaseID }
		if sess, err = s.session(); err == nil {
			put.Lease = int64(sess.Lease())
		}
	case kernel.KeepLease:
		put.IgnoreLease = true
	case kernel.LeaseID:
		put.Lease = op.ID
	}
	if err != nil {
		return nil, 0, err
	}
	if id != 0 {
		put.Lease = int64(id)
	}
	if op.Record != nil {
		put.Value = s.encodeAs(ctx, s.format, storeRecord(k, op.Record), fencing.Token(op.Record.Token), id)
	}
	if op.Lease != kernel.RetentionLease {
		id = 0 // only records' leases are refreshed
	}
	return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: put}}, id, nil
}

// reply reads etcd's answer to t (or its error) as the kernel knows it.
func (s *Store) reply(ctx context.Context, k Key, t *kernel.Txn, resp *clientv3.TxnResponse, err error, floor int64) kernel.Reply {
	if errors.Is(err, rpctypes.ErrNoSpace) {
		s.noteFull(true)
		return kernel.Reply{Delivery: kernel.Full, Err: err}
	}
	if err != nil {
		return s.failed(ctx, err)
	}
	if err := s.noteHeader(resp.Header, floor); err != nil {
		// etcd was restored: this write may have landed, with a token
		// from before the epoch is raised; it fails, not retried.
		return s.failed(ctx, err)
	}
	if puts(t) {
		s.noteFull(false) // a Put was accepted: etcd has room again
	}
	r := kernel.Reply{Rev: resp.Header.Revision, Delivery: kernel.Refused}
	if resp.Succeeded {
		r.Delivery = kernel.Applied
		return r
	}
	for i, op := range t.Else {
		rr := resp.Responses[i].GetResponseRange()
		if err := s.readElse(ctx, k, op, rr, &r); err != nil {
			// etcd answered that it ran the Else branch: whatever kept us
			// from reading it (a dictionary we could not fetch), the write
			// did not land.
			return s.failed(ctx, notApplied{err})
		}
	}
	return r
}

// readElse reads one read of a refused Txn into r.
func (s *Store) readElse(ctx context.Context, k Key, op kernel.Op, rr *pb.RangeResponse, r *kernel.Reply) error {
	var kv *mvccpb.KeyValue
	if len(rr.Kvs) > 0 {
		kv = rr.Kvs[0]
	}
	switch {
	case op.Key == s.ks.record(k) && op.Kind == kernel.Get:
		if kv != nil {
			rec, err := s.decode(ctx, k, kv)
			if err != nil {
				return err
			}
			r.Cur = kernelRecord(rec)
		}
	case op.Kind == kernel.Count && strings.HasPrefix(op.Key, s.ks.owners()):
		r.OwnerGone = rr.Count == 0
	case op.Key == s.epochKey() && kv != nil:
		e, err := parseEpoch(kv.Value)
		if err != nil {
			return err
		}
		r.Epoch = e
	case op.Key == s.setKey() && kv != nil:
		r.Set = kernel.SetValue{Value: kv.Value, Rev: kv.ModRevision}
	}
	return nil
}

// failed classifies a write's error for the kernel: whether it may have
// landed, whether it was never sent, and whether it may be retried.
func (s *Store) failed(ctx context.Context, err error) kernel.Reply {
	return kernel.Reply{Delivery: kernel.Failed, Err: err, MayHaveLanded: mayHaveLanded(err),
		NotSent: errors.Is(err, ErrNotSent), Retry: !errors.Is(err, ErrCorrupt) && retryable(ctx, err) &&
			(!errors.Is(err, ErrRestored) || errors.Is(err, ErrNotSent))}
}

// puts reports whether t's Then branch puts anything.
func puts(t *kernel.Txn) bool {
	for _, op := range t.Then {
		if op.Kind == kernel.Put {
			return true
		}
	}
	return false
}
