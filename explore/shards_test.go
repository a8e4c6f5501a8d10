package explore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/shard"
)

// Shard worlds: a shard set over sub-prefixes of the world's prefix, one per
// shard, each standing for an etcd cluster of its own (a store, a session,
// leases, dictionaries and an epoch per shard). Each process is started
// with a shard file (a plan: a generation and a placement); the nemesis
// writes new ones (add a shard, retire one, take the last change back, add
// one again) and rolls them out as OPERATIONS.md says: a process at a
// time, restarted with the new file, in order, out of order, and now and
// then backwards (a process restarted with an older file). It also cuts
// one shard off from a process, and restores one shard from a snapshot.
// Every process learns the set in force from etcd whatever file it has.
// The invariants are the ones every world is checked for, on each key's
// history merged across the shards: one live owner, one effect unless
// taken over, replays the saved outcome, tokens that only grow; and
// liveness: every key reachable, and claimable when free, once faults stop.

// keyStore is what actors use of a process's store: one cluster's
// (*etcdstore.Store) or a shard set's (*shard.Store).
type keyStore interface {
	idemhttp.Store
	Do(ctx context.Context, key etcdstore.Key, params []byte, work etcdstore.Work, opts ...etcdstore.RunOption) (etcdstore.Result, error)
	Metrics() etcdstore.Metrics
	EvictIf(ctx context.Context, key etcdstore.Key, rev int64) (bool, error)
	Owner() string
	Close() error
}

var (
	_ keyStore = (*etcdstore.Store)(nil)
	_ keyStore = (*shard.Store)(nil)
)

// shardNames are the shards a shard world may use.
var shardNames = []string{"a", "b", "c"}

// plan is a shard file.
type plan struct {
	gen       int64
	placement []string
}

func (w *world) shardPrefix(name string) string { return w.prefix + "s/" + name + "/" }

// shardOf splits an etcd key of a shard world into its shard and the key
// under the shard's prefix; ok is false for a key of no shard.
func (w *world) shardOf(k string) (name, rest string, ok bool) {
	rest, ok = strings.CutPrefix(k, w.prefix+"s/")
	if !ok {
		return "", "", false
	}
	name, rest, ok = strings.Cut(rest, "/")
	return name, rest, ok
}

// storeRest is k under the store's own prefix: the world's, or its
// shard's in a shard world.
func (w *world) storeRest(k string) (string, bool) {
	if w.cfg.shards {
		_, rest, ok := w.shardOf(k)
		return rest, ok
	}
	return strings.CutPrefix(k, w.prefix)
}

// pickShards draws a shard world's first shard file.
func (w *world) pickShards() {
	first := plan{gen: 1, placement: []string{"a", "b"}}
	if w.rng.IntN(3) == 0 {
		first.placement = []string{"a", "b", "c"}
	}
	w.plans = []plan{first}
	w.slotPlan = map[int]int{}
	w.ledger.hit("config:shards")
}

// newShardSet makes p's shard set, from the plan it is started with, each
// shard on its own sub-prefix, through p's etcd client (its faults).
func (w *world) newShardSet(ctx context.Context, p *process, opts []etcdstore.Option) (*shard.Store, error) {
	p.plan = w.slotPlan[p.slot]
	pl := w.plans[p.plan]
	cfg := shard.Config{Placement: shard.Placement{Shards: pl.placement}, Generation: pl.gen, Clock: p.clock,
		Log: slog.New(&ledgerLog{w: w, p: p}), Check: 2 * time.Second, Skew: 5 * time.Second}
	for _, n := range shardNames {
		cfg.Shards = append(cfg.Shards, shard.Shard{Name: n, Client: p.cli, Options: []etcdstore.Option{etcdstore.WithPrefix(w.shardPrefix(n)),
			etcdstore.WithClock(shardClock{simClock: p.clock, shard: n})}})
	}
	// The world's options; each shard's own prefix comes after.
	return shard.New(ctx, cfg, opts...)
}

// shardClock is a process's clock as one shard's store gets it: its
// background work is named for the shard (" on shard a"), so that a final
// write pending is told apart from another shard's.
type shardClock struct {
	*simClock
	shard string
}

func (c shardClock) Go(ctx context.Context, name string, f func(context.Context)) {
	c.simClock.Go(ctx, name+" on shard "+c.shard, f)
}

// ownersOf returns the sessions p's store holds: one per shard in a shard
// world.
func (w *world) ownersOf(p *process) []string {
	if p.set == nil {
		return []string{p.store.Owner()}
	}
	var out []string
	for _, n := range shardNames {
		if st := p.set.Shard(n); st != nil {
			out = append(out, st.Owner())
		}
	}
	return out
}

// shardOfOwner returns the shard whose store of p holds session owner
// ("" without shards).
func (w *world) shardOfOwner(p *process, owner string) string {
	if p.set == nil {
		return ""
	}
	for _, n := range shardNames {
		if st := p.set.Shard(n); st != nil && st.Owner() == owner {
			return n
		}
	}
	return ""
}

// admins returns an Admin per shard (one, for the world's prefix, in a
// world without shards), keyed by shard name ("" then).
func (w *world) admins() map[string]*etcdstore.Admin {
	if !w.cfg.shards {
		return map[string]*etcdstore.Admin{"": w.decoder}
	}
	out := map[string]*etcdstore.Admin{}
	for _, n := range shardNames {
		adm, err := etcdstore.NewAdmin(w.admin, etcdstore.WithPrefix(w.shardPrefix(n)))
		if err == nil {
			out[n] = adm
		}
	}
	return out
}

// liveRecord returns key's record wherever it lives: in a shard world, the
// live record of the shards (a Moved record is where it is not), or, when
// none has one, ErrNotFound.
func (w *world) liveRecord(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	if !w.cfg.shards {
		return w.decoder.Get(ctx, key)
	}
	var found *etcdstore.Record
	for _, n := range shardNames {
		adm, err := etcdstore.NewAdmin(w.admin, etcdstore.WithPrefix(w.shardPrefix(n)))
		if err != nil {
			return nil, err
		}
		rec, err := adm.Get(ctx, key)
		switch {
		case errors.Is(err, etcdstore.ErrNotFound):
			continue
		case err != nil:
			return nil, err
		case rec.State == etcdstore.Moved:
			continue
		case found != nil:
			return nil, fmt.Errorf("%s has live records on two shards", key)
		}
		found = rec
	}
	if found == nil {
		return nil, fmt.Errorf("%s: %w", key, etcdstore.ErrNotFound)
	}
	return found, nil
}

// decodeRecord decodes a record of the world's history, with the Admin of
// its shard (dictionaries are per shard).
func (w *world) decodeRecord(kv *mvccpb.KeyValue) (*etcdstore.Record, error) {
	if !w.cfg.shards {
		return storex.DecodeRecord(w.decoder, kv)
	}
	name, _, _ := w.shardOf(string(kv.Key))
	adm := w.shardDecoders[name]
	if adm == nil {
		var err error
		if adm, err = etcdstore.NewAdmin(w.admin, etcdstore.WithPrefix(w.shardPrefix(name))); err != nil {
			return nil, err
		}
		w.shardDecoders[name] = adm
	}
	return storex.DecodeRecord(adm, kv)
}

// shardChange writes the next shard file and rolls it out.
func (w *world) shardChange() error {
	cur := w.plans[len(w.plans)-1]
	next := plan{gen: cur.gen + 1}
	var prev []string
	if len(w.plans) > 1 {
		prev = w.plans[len(w.plans)-2].placement
	}
	switch {
	case prev != nil && w.s.rng.IntN(3) == 0:
		next.placement = prev // take the last change back
		w.ledger.hit("path:shard change taken back")
	case len(cur.placement) == 3:
		// Retire one.
		gone := shardNames[w.s.rng.IntN(3)]
		for _, n := range cur.placement {
			if n != gone {
				next.placement = append(next.placement, n)
			}
		}
		w.ledger.hit("path:shard retired")
	default:
		// Add the one missing.
		next.placement = slices.Clone(cur.placement)
		for _, n := range shardNames {
			if !slices.Contains(next.placement, n) {
				next.placement = append(next.placement, n)
				break
			}
		}
		w.ledger.hit("path:shard added")
	}
	w.plans = append(w.plans, next)
	w.log(event{kind: evClock, body: fmt.Sprintf("shard file %d: %v", next.gen, next.placement)})
	// The rollout: each process in turn, in order or not, restarted with
	// the new file; now and then one restarted with an older one, and now
	// and then the rollout stops half way (the next change comes first).
	order := w.s.rng.Perm(len(w.procs))
	stop := len(order)
	if w.s.rng.IntN(3) == 0 {
		stop = w.s.rng.IntN(len(order))
	}
	for _, i := range order[:stop] {
		p := w.procs[i]
		if p.dead || p.closing {
			continue
		}
		idx := len(w.plans) - 1
		if w.s.rng.IntN(6) == 0 && idx > 0 {
			idx = w.s.rng.IntN(idx) // backwards
			w.ledger.hit("path:shard file rolled back on a process")
		}
		if err := w.restartWithPlan(p, idx); err != nil {
			return err
		}
	}
	return nil
}

// restartWithPlan restarts p, as a rollout does (gracefully: its store is
// closed first, and afterTurn starts its next incarnation), with shard
// file idx.
func (w *world) restartWithPlan(p *process, idx int) error {
	for _, o := range w.ownersOf(p) {
		w.log(event{kind: evClose, proc: p.name, owner: o, task: w.shardOfOwner(p, o), body: fmt.Sprintf("restarted with shard file %d", w.plans[idx].gen)})
	}
	p.closing = true
	w.slotPlan[p.slot] = idx // its next incarnation's file: afterTurn starts it once the close ends
	done := false
	w.s.spawn(p.name+"/close", p, false, func(*actor) {
		if err := p.keys.Close(); err != nil {
			w.note("%s: close: %v", p.name, err)
		}
		done = true
	})
	for i := 0; !done; i++ {
		if i > healSteps {
			return fmt.Errorf("%s: its close did not end", p.name)
		}
		runnable := w.s.runnable()
		if len(runnable) == 0 {
			at, ok := w.s.next()
			if !ok {
				return fmt.Errorf("%s: its close waits for nothing", p.name)
			}
			w.s.advanceTo(at)
			continue
		}
		a := runnable[i%len(runnable)]
		if err := w.s.resume(a, true); err != nil {
			return err
		}
		w.afterTurn(a)
	}
	return nil
}

// cutShard cuts one shard off from p for a burst of its keyed calls.
func (w *world) cutShard(p *process) {
	name := shardNames[w.s.rng.IntN(len(shardNames))]
	p.cut, p.cutCalls = name, 4+w.s.rng.IntN(12)
	w.ledger.hit("path:shard cut off")
	w.log(event{kind: evClock, proc: p.name, body: fmt.Sprintf("shard %s cut off for %d calls", name, p.cutCalls)})
}

// cutOff reports whether p's call req is to its cut-off shard (and counts
// it).
func (w *world) cutOff(p *process, req any) bool {
	if p.cutCalls <= 0 {
		return false
	}
	k := reqKey(req)
	if name, _, ok := w.shardOf(k); !ok || name != p.cut {
		return false
	}
	p.cutCalls--
	return true
}

// reqKey returns the first key a request names.
func reqKey(req any) string {
	switch r := req.(type) {
	case *pb.RangeRequest:
		return string(r.Key)
	case *pb.PutRequest:
		return string(r.Key)
	case *pb.DeleteRangeRequest:
		return string(r.Key)
	case *pb.TxnRequest:
		for _, c := range r.Compare {
			return string(c.Key)
		}
		for _, ops := range [][]*pb.RequestOp{r.Success, r.Failure} {
			for _, op := range ops {
				switch {
				case op.GetRequestRange() != nil:
					return string(op.GetRequestRange().Key)
				case op.GetRequestPut() != nil:
					return string(op.GetRequestPut().Key)
				case op.GetRequestDeleteRange() != nil:
					return string(op.GetRequestDeleteRange().Key)
				case op.GetRequestTxn() != nil:
					return reqKey(op.GetRequestTxn())
				}
			}
		}
	}
	return ""
}

// keysReachable is liveness's word for a shard world: once the faults
// stop and every process follows the set in force, every key can be
// read (its record found, or its absence known) through every process.
func (w *world) keysReachable(a *actor) []string {
	var bad []string
	for _, p := range w.procs {
		if p.dead || p.set == nil {
			continue
		}
		for _, key := range w.keys() {
			var err error
			for try := 0; try < 20; try++ {
				if _, err = p.keys.Get(a.ctx, storeKey(key)); err == nil || errors.Is(err, etcdstore.ErrNotFound) {
					err = nil
					break
				}
				clock.Sleep(p.clock, a.ctx, time.Second) // a shard reconnecting, a set being learnt
			}
			if err != nil {
				bad = append(bad, fmt.Sprintf("%s cannot reach %s: %v", p.name, key, err))
			}
		}
	}
	return bad
}
