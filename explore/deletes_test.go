package explore

import (
	"fmt"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/idem-dev/idem/etcdstore"
)

// Every delete by its rule (invariant 18): the explorer notes, for every
// record a call deleted, who deleted it (the caller's class: an actor's
// kind, or the store's background work) and how (a Txn that compared the
// record's revision, or its lease; a plain delete). A record is deleted
// only by a rule that allows it:
//
//   - the sweeper, a record on the lease it sweeps (its Txn compares the
//     lease) whose retention has passed;
//   - a drain (package shard) or a schedule forgetting its previous job
//     (EvictIf), a record whose retention has passed;
//   - a release, the releasing claim's own in-flight record, compared by
//     its revision;
//   - an operator's eviction, any record (the evict actors evict done
//     records only, compared by revision);
//   - etcd, the records of a lease that expired or was revoked, whose
//     retention has passed.
//
// Retention passed means by the true time plus the largest clock skew:
// the deleter judged on its own clock.

// deleter is who deleted a record, at a revision.
type deleter struct {
	class string // the caller's class (see class); "" for etcd (a lease)
	how   string // "lease": the Txn compared the record's lease; "revision": its ModRevision; "plain": no compare
	lease int64  // the lease compared
}

// noteDeletes notes the records an answered call deleted.
func (w *world) noteDeletes(a *actor, req, reply any) {
	who := ""
	if a != nil {
		who = class(a)
	}
	switch r := reply.(type) {
	case *pb.DeleteRangeResponse:
		q, ok := req.(*pb.DeleteRangeRequest)
		if ok && r.Deleted > 0 && r.Header != nil {
			w.noteDelete(r.Header.Revision, string(q.Key), deleter{class: who, how: "plain"})
		}
	case *pb.TxnResponse:
		if t, ok := req.(*pb.TxnRequest); ok && r.Header != nil {
			w.txnDeletes(r.Header.Revision, who, t, r)
		}
	}
}

// txnDeletes notes the deletes of a Txn's branch that ran, nested Txns
// included.
func (w *world) txnDeletes(rev int64, who string, t *pb.TxnRequest, r *pb.TxnResponse) {
	ops := t.Failure
	if r.Succeeded {
		ops = t.Success
	}
	for i, op := range ops {
		if i >= len(r.Responses) {
			break
		}
		switch o := op.Request.(type) {
		case *pb.RequestOp_RequestDeleteRange:
			if r.Responses[i].GetResponseDeleteRange().GetDeleted() > 0 {
				w.noteDelete(rev, string(o.RequestDeleteRange.Key), deleterOf(who, t, string(o.RequestDeleteRange.Key)))
			}
		case *pb.RequestOp_RequestTxn:
			if inner := r.Responses[i].GetResponseTxn(); inner != nil {
				w.txnDeletes(rev, who, o.RequestTxn, inner)
			}
		}
	}
}

// deleterOf says how a Txn deleted key: what it compared of it.
func deleterOf(who string, t *pb.TxnRequest, key string) deleter {
	d := deleter{class: who, how: "plain"}
	for _, c := range t.Compare {
		if string(c.Key) != key {
			continue
		}
		switch c.Target {
		case pb.Compare_LEASE:
			d.how, d.lease = "lease", c.GetLease()
		case pb.Compare_MOD:
			d.how = "revision"
		}
	}
	return d
}

func (w *world) noteDelete(rev int64, key string, d deleter) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.deletes == nil {
		w.deletes = map[string]deleter{}
	}
	w.deletes[fmt.Sprint(rev, " ", key)] = d
}

// deleterAt returns who deleted the record key at rev.
func (w *world) deleterAt(rev int64, key string) (deleter, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	d, ok := w.deletes[fmt.Sprint(rev, " ", key)]
	return d, ok
}

// checkDelete returns what is wrong with the deletion at rev of prev, the
// record etcd key ekey held (invariant 18), or "".
func (w *world) checkDelete(key, ekey string, rev int64, prev *etcdstore.Record, skew time.Duration) string {
	at, ok := w.timeOf(rev)
	expired := ok && !at.Add(skew).Before(prev.Expires) || prev.Fence
	d, known := w.deleterAt(rev, ekey)
	switch {
	case !known:
		// etcd deleted it with its lease (expired, or revoked by the
		// sweeper once emptied, or by the explorer as etcd would).
		if !expired && !prev.Fence {
			return fmt.Sprintf("%s: a live record (expires %s) went with its lease at revision %d", key, prev.Expires.Format("15:04:05.000"), rev)
		}
	case d.class == "sweeper":
		if d.how != "lease" || d.lease != prev.Lease || !expired {
			return fmt.Sprintf("%s: the sweeper deleted a record at revision %d that is not an expired record of the lease it swept (compared %s %d; record lease %d, expires %s)",
				key, rev, d.how, d.lease, prev.Lease, prev.Expires.Format("15:04:05.000"))
		}
	case d.class == "shard" || d.class == "schedule":
		if d.how != "revision" || !expired {
			return fmt.Sprintf("%s: %s deleted a record at revision %d that is live (expires %s) or not as it read it (%s)",
				key, d.class, rev, prev.Expires.Format("15:04:05.000"), d.how)
		}
	case d.class == "operator":
	case d.class == "evict" && prev.State == etcdstore.Done:
		// The evict actor's eviction (its own Do's releases are releases).
		if d.how != "revision" {
			return fmt.Sprintf("%s: an eviction of a done record at revision %d did not compare its revision (%s)", key, rev, d.how)
		}
	default:
		// A release: the claim's own record, compared by its revision.
		if d.how != "revision" || prev.State != etcdstore.InFlight {
			return fmt.Sprintf("%s: %s deleted a %s record at revision %d by no rule (%s)", key, d.class, prev.State, rev, d.how)
		}
	}
	return ""
}
