package explore

import (
	"fmt"
	"strings"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// A shard set's guard holds on every write (invariant 22): in a shard
// world, every write that makes a key's claim (a claim, a takeover, an
// enqueue, a hand-over's Moved record: a record whose token is its own
// write's revision) compares its shard's epoch and shard set, so that a
// process that routed the key by an older set, or believes an older
// epoch, is refused. Checked on each Txn etcd applied, as it left the
// process.

// checkGuards notes the claim writes of an applied Txn (and of the Txns a
// batch holds) that compare neither their shard's epoch nor its set.
func (w *world) checkGuards(t *pb.TxnRequest, r *pb.TxnResponse) {
	if !w.cfg.shards {
		return
	}
	ops := t.Failure
	if r.Succeeded {
		ops = t.Success
	}
	for i, op := range ops {
		if i >= len(r.Responses) {
			break
		}
		switch o := op.Request.(type) {
		case *pb.RequestOp_RequestPut:
			if !r.Succeeded {
				continue
			}
			if why := w.guardOf(t, o.RequestPut); why != "" {
				w.mu.Lock()
				w.broken = append(w.broken, why)
				w.mu.Unlock()
			}
		case *pb.RequestOp_RequestTxn:
			if inner := r.Responses[i].GetResponseTxn(); inner != nil {
				w.checkGuards(o.RequestTxn, inner)
			}
		}
	}
}

// guardOf returns what a claim write put by t lacks of its shard's
// guards, or "".
func (w *world) guardOf(t *pb.TxnRequest, put *pb.PutRequest) string {
	key := string(put.Key)
	shard, rest, ok := w.shardOf(key)
	if !ok || !strings.HasPrefix(rest, "k/") {
		return ""
	}
	rec, err := w.decodeRecord(&mvccpb.KeyValue{Key: put.Key, Value: put.Value})
	if err != nil || tokenRev(int64(rec.Token)) != 0 {
		return "" // a claim's later write: fenced by the record's revision
	}
	epoch, set := w.shardPrefix(shard)+"epoch", w.shardPrefix(shard)+"j/shard/set"
	var hasEpoch, hasSet bool
	for _, c := range t.Compare {
		hasEpoch = hasEpoch || string(c.Key) == epoch
		hasSet = hasSet || string(c.Key) == set
	}
	if hasEpoch && hasSet {
		return ""
	}
	return fmt.Sprintf("%s: a %s record was written on shard %s by a Txn that compares %s (epoch %v, set %v)",
		rest, rec.State, shard, describeCmps(t.Compare), hasEpoch, hasSet)
}

func describeCmps(cs []*pb.Compare) string {
	var out []string
	for _, c := range cs {
		out = append(out, c.Target.String()+"("+string(c.Key)+")")
	}
	return "[" + strings.Join(out, " ") + "]"
}
