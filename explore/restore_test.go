package explore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/internal/storex"
)

func leaseID(id int64) clientv3.LeaseID { return clientv3.LeaseID(id) }

// restore is a snapshot of the world's prefix, and whether it was restored.
type restore struct {
	rev      int64 // etcd's revision at the snapshot
	from, to int64 // the revisions the restore's own writes lie in: (from, to]
	at       time.Time
	kvs      []*mvccpb.KeyValue
	leases   map[clientv3.LeaseID]time.Duration // the leases the keys were on, and their TTLs then
	done     bool
	// scope is the prefix snapshotted and restored: the world's, or, in
	// a shard world, now and then one shard's (one cluster of the set).
	scope string
}

// snapshotOrRestore takes a snapshot of the world's prefix, or restores
// the last one: what an operator does with idem snapshot save and idem
// snapshot restore (or etcdutl and idem's BumpEpoch), one etcd cluster
// emulated by one prefix of the shared one. A restore happens with every
// idem process stopped, as the restore procedure says: they are crashed
// first, and new ones start on the restored data.
//
// etcd restores every key of the snapshot with the lease it was on (the
// leases come back with their TTLs restarted), and nothing written after
// it; its revision jumps ahead (--bump-revision), while every restored
// key keeps its own revisions: here, the keys changed since the snapshot
// are written again (or deleted), the others are left as they are. Then the shard epoch is bumped (Admin.BumpEpoch, as idem
// serve does on its first start after idem snapshot restore): without it,
// tokens would go backwards after a restore in a world whose epoch was
// raised since the snapshot.
func (w *world) snapshotOrRestore() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if n := len(w.restores); n == 0 || w.restores[n-1].done {
		// At the world's latest write (etcd's revision now is other
		// worlds' too).
		w.mu.Lock()
		rev := w.lastWrite
		w.mu.Unlock()
		scope := w.prefix
		if w.cfg.shards && w.s.rng.IntN(2) == 0 {
			scope = w.shardPrefix(shardNames[w.s.rng.IntN(len(shardNames))])
			w.ledger.hit("path:one shard snapshotted")
		}
		resp, err := w.admin.Get(ctx, scope, clientv3.WithPrefix(), clientv3.WithRev(rev))
		if err != nil {
			return err
		}
		kvs := resp.Kvs
		if scope == w.prefix {
			// The jobs' effects are in the same etcd: they come back as they were too.
			effects, err := w.admin.Get(ctx, w.effectsPrefix(), clientv3.WithPrefix(), clientv3.WithRev(rev))
			if err != nil {
				return err
			}
			kvs = append(kvs, effects.Kvs...)
		}
		r := restore{rev: rev, at: w.s.Now(), kvs: kvs, leases: map[clientv3.LeaseID]time.Duration{}, scope: scope}
		w.mu.Lock()
		for _, kv := range resp.Kvs {
			if ls := w.leases[clientv3.LeaseID(kv.Lease)]; kv.Lease != 0 && ls != nil {
				r.leases[ls.id] = max(ls.expires.Sub(w.s.Now()), time.Second)
			}
		}
		w.mu.Unlock()
		w.restores = append(w.restores, r)
		w.ledger.hit("path:snapshot")
		w.log(event{kind: evSnapshot, body: fmt.Sprintf("revision %d, %d keys", r.rev, len(r.kvs))})
		return nil
	}
	r := &w.restores[len(w.restores)-1]
	w.mu.Lock()
	r.from = w.lastWrite
	w.mu.Unlock()
	for _, p := range w.procs {
		if !p.dead {
			for _, o := range w.ownersOf(p) {
				w.log(event{kind: evCrash, proc: p.name, owner: o, body: "stopped for the restore"})
			}
			p.dead = true
			w.mu.Lock()
			w.metrics = append(w.metrics, p.keys.Metrics())
			w.mu.Unlock()
			if err := w.killActors(p); err != nil {
				return err
			}
			p.watcher.Close()
			p.cli.Close()
		}
	}
	// Leases: those of the snapshot come back (a gone one as a new lease
	// with the TTL it had), the others of the cluster are gone (with one
	// shard restored, those that keys of that shard are on).
	mapped := map[clientv3.LeaseID]clientv3.LeaseID{}
	ours := map[clientv3.LeaseID]bool{}
	if r.scope != w.prefix {
		now, err := w.admin.Get(ctx, r.scope, clientv3.WithPrefix())
		if err != nil {
			return err
		}
		for _, kv := range now.Kvs {
			ours[clientv3.LeaseID(kv.Lease)] = true
		}
	}
	w.mu.Lock()
	var gone []clientv3.LeaseID
	for id := range w.leases {
		if _, ok := r.leases[id]; !ok && (r.scope == w.prefix || ours[id]) {
			gone = append(gone, id)
		}
	}
	w.mu.Unlock()
	for _, id := range gone {
		w.admin.Revoke(ctx, id)
		w.leaseGone(id, "lost in a restore")
	}
	for id, ttl := range r.leases {
		w.mu.Lock()
		ls := w.leases[id]
		w.mu.Unlock()
		if ls != nil {
			mapped[id] = id
			continue
		}
		g, err := w.admin.Grant(ctx, int64((ttl+time.Second-1)/time.Second))
		if err != nil {
			return err
		}
		w.trackLease(g.ID, time.Duration(g.TTL)*time.Second)
		mapped[id] = g.ID
	}
	// etcd's restore keeps every key's revisions (--bump-revision raises
	// only the store's): a key unchanged since the snapshot keeps its
	// ModRevision, and so a claim record its token. Only what changed since
	// is written again (at new revisions) or deleted.
	snap := map[string]*mvccpb.KeyValue{}
	for _, kv := range r.kvs {
		snap[string(kv.Key)] = kv
	}
	unchanged := map[string]bool{}
	scopes := []string{r.scope}
	if r.scope == w.prefix {
		scopes = append(scopes, w.effectsPrefix())
	}
	for _, prefix := range scopes {
		now, err := w.admin.Get(ctx, prefix, clientv3.WithPrefix())
		if err != nil {
			return err
		}
		for _, kv := range now.Kvs {
			old := snap[string(kv.Key)]
			if old != nil && old.ModRevision == kv.ModRevision && (kv.Lease == 0 || mapped[clientv3.LeaseID(kv.Lease)] == clientv3.LeaseID(kv.Lease)) {
				unchanged[string(kv.Key)] = true
				continue
			}
			if _, err := w.admin.Delete(ctx, string(kv.Key)); err != nil {
				return err
			}
		}
	}
	owners := map[clientv3.LeaseID]string{}
	for _, kv := range r.kvs {
		if unchanged[string(kv.Key)] {
			continue
		}
		val := string(kv.Value)
		if rest, _ := w.storeRest(string(kv.Key)); strings.HasPrefix(rest, "l/") {
			// A bucket key names its lease.
			if old, err := strconv.ParseInt(val, 16, 64); err == nil {
				if n, ok := mapped[clientv3.LeaseID(old)]; ok {
					val = strconv.FormatInt(int64(n), 16)
				}
			}
		}
		var opts []clientv3.OpOption
		if kv.Lease != 0 {
			n, ok := mapped[clientv3.LeaseID(kv.Lease)]
			if !ok {
				continue // its lease was not tracked: it expired before the snapshot
			}
			opts = append(opts, clientv3.WithLease(n))
			rest, _ := w.storeRest(string(kv.Key))
			if owner, ok := strings.CutPrefix(rest, "o/"); ok {
				owners[n] = owner
			}
		}
		if _, err := w.admin.Put(ctx, string(kv.Key), val, opts...); err != nil {
			return err
		}
	}
	w.mu.Lock()
	for id, owner := range owners {
		if ls := w.leases[id]; ls != nil {
			ls.owner = owner
		}
	}
	w.mu.Unlock()
	e, err := w.bumpRestored(ctx, r.scope)
	if err != nil {
		return err
	}
	w.syncLast()
	w.mu.Lock()
	r.to, r.done = w.lastWrite, true
	w.mu.Unlock()
	w.ledger.hit("path:restore")
	w.log(event{kind: evRestore, body: fmt.Sprintf("%s to revision %d, epoch now %d", strings.TrimPrefix(r.scope, w.prefix), r.rev, e)})
	for i, p := range w.procs {
		n, err := w.newProcess(p.slot, p.gen+1)
		if err != nil {
			return err
		}
		w.procs[i] = n
	}
	return nil
}

// bumpRestored raises the epoch of what scope restored as idem serve (or
// idem snapshot bump-epoch) does after a restore: by 1024 without shards;
// in a shard world, each restored shard's to 1024 above the greatest epoch
// of the set, as it stands (a key may have moved onto the restored shard
// from one of a greater epoch since the snapshot).
func (w *world) bumpRestored(ctx context.Context, scope string) (int64, error) {
	if !w.cfg.shards {
		return storex.BumpEpoch(w.decoder, ctx, storex.DefaultRestoreEpochBump)
	}
	epochs := map[string]int64{}
	high := int64(0)
	for n, adm := range w.admins() {
		e, err := storex.BumpEpoch(adm, ctx, 1) // the smallest raise reads it too
		if err != nil {
			return 0, err
		}
		epochs[n], high = e, max(high, e)
	}
	var last int64
	for n, adm := range w.admins() {
		if scope != w.prefix && scope != w.shardPrefix(n) {
			continue
		}
		e, err := storex.BumpEpoch(adm, ctx, high+storex.DefaultRestoreEpochBump-epochs[n])
		if err != nil {
			return 0, err
		}
		last = e
	}
	return last, nil
}
