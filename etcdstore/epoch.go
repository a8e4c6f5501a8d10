package etcdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/kpb"
	"github.com/idem-dev/idem/internal/kernel"
)

// Shard epochs and hand-overs: what package shard builds a set of etcd
// clusters on. A store with WithEpochs is one shard of a set. Its fencing
// tokens are epoch<<EpochShift | revision, where the epoch is a number kept
// in the shard's own etcd (<prefix>epoch) that only grows. Every claim
// compares it in its Txn and writes it into the record, so a record's
// token is the same to every process, and a key that moves to a shard of a
// greater epoch keeps strictly increasing tokens although that cluster's
// revisions may be lower. A key moves by a Moved record that Forward writes
// on its old shard: from then on that shard refuses to claim it
// (ErrMoved), and the key lives where the record says.

// withEpochs makes the store one shard of a set (package shard): tokens
// carry the shard's epoch, and keys can be handed over (Forward). Every
// claim's Txn then compares the epoch key too. Without it (one etcd
// cluster) tokens are revisions, as always.
func withEpochs() Option {
	return option(func(c *config) error {
		c.epochs = true
		return nil
	})
}

func (s *Store) epochKey() string { return s.ks.prefix + "epoch" }

// currentEpoch returns the epoch this store last saw (0: none).
func (s *Store) currentEpoch() int64 { return s.epoch.Load() }

// noteEpoch believes in epoch e, taught by an answer at revision rev.
func (s *Store) noteEpoch(e, rev int64) {
	s.epoch.Store(e)
	s.epochAt.Store(rev)
}

// shardSetValue is the name of the Value (SetValue) that holds the shard
// set in force (package shard's placement and its generation) in each
// shard. A store WithEpochs guards every claim, enqueue and Forward with
// it: the Txn compares the value's revision with the one the store last
// read, so that a process that routed a key by an older shard set is
// refused (ErrSetChanged) and routes it again, whatever order processes
// learn a change in.
const shardSetValue = "shard/set"

func (s *Store) setKey() string { return s.ks.values() + shardSetValue }

// shardSet returns the shard set value this store last read from its etcd
// (Revision 0: none there). It is read by New, and again whenever a
// guarded write finds it changed.
func (s *Store) shardSet() namedValue {
	if v := s.set.Load(); v != nil {
		return *v
	}
	return namedValue{Name: shardSetValue}
}

func (s *Store) noteSet(v namedValue) { s.set.Store(&v) }

func parseEpoch(v []byte) (int64, error) {
	e, err := kernel.ParseEpoch(v)
	if err != nil {
		return 0, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	return e, nil
}

// loadEpoch reads the shard's epoch and shard set from etcd, in one
// linearizable read.
func (s *Store) loadEpoch(ctx context.Context) (int64, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var resp *clientv3.TxnResponse
	if err := s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = s.client.Txn(ctx).Then(clientv3.OpGet(s.epochKey()), clientv3.OpGet(s.setKey())).Commit()
		return err
	}); err != nil {
		return 0, fmt.Errorf("read the shard epoch and set: %w: %w", ErrUnavailable, err)
	}
	set := namedValue{Name: shardSetValue}
	if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
		set.Value, set.Revision = kvs[0].Value, kvs[0].ModRevision
	}
	s.noteSet(set)
	e := int64(0)
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		var err error
		if e, err = parseEpoch(kvs[0].Value); err != nil {
			return 0, err
		}
	}
	s.noteEpoch(e, resp.Header.Revision)
	return e, nil
}

// loadShardSet reads the shard set (ShardSetValue) and the epoch from etcd
// again, and returns the set.
func (s *Store) loadShardSet(ctx context.Context) (namedValue, error) {
	if !s.epochs {
		return namedValue{}, fmt.Errorf("%w: load shard set: the store has no epochs (WithEpochs)", ErrInvalidArgument)
	}
	if _, err := s.loadEpoch(ctx); err != nil {
		return namedValue{}, err
	}
	return s.shardSet(), nil
}

// raiseEpoch makes the shard's epoch greater than above (if it is not
// already) and returns it: before a key moves here from a shard whose
// epoch was above, so that its tokens keep growing. Every token this shard
// hands out afterwards is greater than every token of the old shard. The
// claims of other processes that still believe in the older epoch fail
// their compare, read the new one, and try again.
func (s *Store) raiseEpoch(ctx context.Context, above int64) (int64, error) {
	if !s.epochs {
		return 0, fmt.Errorf("%w: raise epoch: the store has no epochs (WithEpochs)", ErrInvalidArgument)
	}
	for try := 0; ; try++ {
		cur, err := s.loadEpoch(ctx)
		if err != nil || cur > above {
			return cur, err
		}
		next := above + 1
		tctx, cancel := s.try(ctx)
		t := s.kcfg().Keys.RaiseEpoch(cur, next)
		resp, err := s.client.Txn(tctx).If(kpb.Cmps(t.If)...).Then(clientv3.OpPut(s.epochKey(), strconv.FormatInt(next, 10))).Commit()
		cancel()
		switch {
		case err == nil && resp.Succeeded:
			s.noteEpoch(next, resp.Header.Revision)
			s.log.Info("idem: shard epoch raised", "epoch", next)
			return next, nil
		case err != nil && (!retryable(ctx, err) || !s.backoff(ctx, try)):
			return 0, fmt.Errorf("raise the shard epoch: %w: %w", ErrUnavailable, err)
		}
		// Another process moved it, or the reply was lost: read again.
	}
}

// forwardKey hands key over to the shard named to, unless this shard holds it:
// when a live record of key is here (in flight or done), forwardKey returns
// it, and the key stays here, where every retry finds it. When the key is
// absent or its retention passed, forwardKey writes a Moved record naming to
// (on a retention lease, like any record), so that from then on this shard
// refuses to claim it. A Moved record naming to is returned as it is; one
// naming another shard (written under an older shard set) is replaced. The
// write is guarded by the shard's epoch and shard set (ShardSetValue):
// ErrSetChanged says the set changed since this store read it (or since
// the revision UnderShardSet names).
// The returned record says which: State Moved (go to MovedTo; its Epoch is
// this shard's at the move), or a live record of this shard.
func (s *Store) forwardKey(ctx context.Context, key Key, to string, opts ...ClaimOption) (*Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("forward: %w", err)
	}
	var cfg claimConfig
	for _, o := range opts {
		if err := o.applyRun(&cfg); err != nil {
			return nil, fmt.Errorf("forward %s: %w", key, err)
		}
	}
	if to == "" {
		return nil, fmt.Errorf("forward %s: %w: no shard named", key, ErrInvalidArgument)
	}
	if !s.epochs {
		return nil, fmt.Errorf("forward %s: %w: the store has no epochs (WithEpochs)", key, ErrInvalidArgument)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	m := kernel.NewForward(s.kcfg(), kernel.ForwardRequest{Key: s.ks.record(key), To: to, SetRev: cfg.setRev})
	for {
		a := m.Next(s.view(key))
		if a.Wait > 0 && clock.Sleep(s.clock, ctx, a.Wait) != nil {
			return nil, wrapEtcd("forward", key, a.Err)
		}
		switch a.Kind {
		case kernel.ActDone:
			return s.forwarded(key, m.Answer())
		case kernel.ActRead:
			rec, _, err := s.get(ctx, key)
			if err != nil {
				return nil, err
			}
			m.Read(kernelRecord(rec))
		case kernel.ActSend:
			s.learn(m.Sent(s.exec(ctx, key, a.Txn, nil)))
		}
	}
}

// forwarded answers a Forward as the kernel decided it.
func (s *Store) forwarded(key Key, a kernel.Answer) (*Record, error) {
	switch a.Verdict {
	case kernel.Landed, kernel.Found:
		return storeRecord(key, a.Record), nil
	case kernel.SetChanged:
		return nil, fmt.Errorf("forward %s: %w", key, errSetChanged)
	case kernel.Error:
		return nil, wrapEtcd("forward", key, a.Err)
	}
	return nil, fmt.Errorf("forward %s: %w: the record kept changing", key, ErrUnavailable)
}

// defaultRestoreEpochBump is how far BumpEpoch raises a shard epoch after
// a restore: more than the epoch can have grown between a backup and its
// restore (it grows by one when a key moves to a shard whose epoch is not
// already above the old shard's).
const defaultRestoreEpochBump = 1024

// readEpoch reads the shard epoch under the Admin's prefix (0: none).
func (a *Admin) readEpoch(ctx context.Context) (int64, error) {
	ctx, cancel := a.bound(ctx)
	defer cancel()
	var resp *clientv3.GetResponse
	if err := a.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = a.client.Get(ctx, a.ks.prefix+"epoch")
		return err
	}); err != nil {
		return 0, fmt.Errorf("read the shard epoch: %w: %w", ErrUnavailable, err)
	}
	if len(resp.Kvs) == 0 {
		return 0, nil
	}
	return parseEpoch(resp.Kvs[0].Value)
}

// bumpEpoch raises the shard epoch under the Admin's prefix by by (at
// least 1), creating it if there is none, and returns it: run it once
// after etcd is restored from a snapshot, before any idem process serves
// from it. A restore brings the epoch key back to its value at the
// backup, and a token is epoch<<EpochShift | revision: raising the
// revision alone (etcdutl snapshot restore --bump-revision) leaves every
// token lower than those handed out before the restore once an epoch was
// raised since the backup. idem serve does it on the first start after
// idem snapshot restore. It records the cluster's ID (<prefix>cluster):
// the restore is handled, and a store that starts raises nothing more. A
// store outside a shard set carries the raised epoch in its tokens too.
func (a *Admin) bumpEpoch(ctx context.Context, by int64) (int64, error) {
	if by < 1 || by >= 1<<(63-epochShift) {
		return 0, fmt.Errorf("%w: epoch bump %d", ErrInvalidArgument, by)
	}
	key := a.ks.prefix + "epoch"
	ctx, cancel := a.bound(ctx)
	defer cancel()
	for try := 0; ; try++ {
		var resp *clientv3.GetResponse
		if err := a.retry(ctx, func(ctx context.Context) (err error) {
			resp, err = a.client.Get(ctx, key)
			return err
		}); err != nil {
			return 0, fmt.Errorf("bump the shard epoch: %w: %w", ErrUnavailable, err)
		}
		cur, cmp := int64(0), clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
		if len(resp.Kvs) > 0 {
			var err error
			if cur, err = parseEpoch(resp.Kvs[0].Value); err != nil {
				return 0, err
			}
			cmp = clientv3.Compare(clientv3.ModRevision(key), "=", resp.Kvs[0].ModRevision)
		}
		next := cur + by
		if next >= 1<<(63-epochShift) {
			return 0, fmt.Errorf("%w: shard epoch %d cannot be raised by %d", ErrInvalidArgument, cur, by)
		}
		tctx, tcancel := a.try(ctx)
		id, _ := json.Marshal(clusterValue{ClusterID: strconv.FormatUint(resp.Header.ClusterId, 16)})
		tr, err := a.client.Txn(tctx).If(cmp).Then(clientv3.OpPut(key, strconv.FormatInt(next, 10)),
			clientv3.OpPut(a.ks.prefix+"cluster", string(id))).Commit()
		tcancel()
		switch {
		case err == nil && tr.Succeeded:
			return next, nil
		case err != nil && (!retryable(ctx, err) || !a.backoff(ctx, try)):
			return 0, fmt.Errorf("bump the shard epoch: %w: %w", ErrUnavailable, err)
		}
		// Moved meanwhile, or the reply was lost: read again. A bump that
		// landed with its reply lost is bumped again: the epoch only grows
		// more, which is as safe.
	}
}
