package etcdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/kernel"
)

// Restores. A fencing token is epoch<<EpochShift | revision, and an etcd
// cluster restored from a snapshot (etcdutl snapshot restore) comes back
// with the snapshot's revision and the snapshot's epoch key: without
// --bump-revision, or once an epoch was raised since the snapshot, the
// tokens handed out after it would be lower than those handed out before,
// and a downstream fencing.Checker would refuse new work while a stale
// worker's older tokens passed. An operator is told to run idem snapshot
// bump-epoch; a store also sees a restore for itself and raises the epoch
// on its own:
//
//   - A running store: every answer to a claim's (or any kernel) Txn
//     carries etcd's revision and cluster ID. A revision lower than one an
//     answer carried before the Txn was sent (linearizable: never, but for
//     a restore), or another cluster ID, is a restore (or the data moved
//     to another cluster). So is a shard epoch lower than the one the
//     store claimed under.
//   - A store that starts: <prefix>cluster names the cluster ID the
//     prefix's data was last served from. Another ID is a restore that
//     made a new cluster (etcdutl snapshot restore with a new
//     --initial-cluster-token, as the procedure says).
//
// Once it sees one, the store refuses every write (ErrRestored, with
// ErrUnavailable: the edges answer 503, clients retry) until it has
// raised the epoch above every token it knows of (by
// DefaultRestoreEpochBump: keys may have moved in from shards of greater
// epochs, and tokens from processes that are gone) and recorded the
// cluster's ID; another process that raised it first is enough. The write
// whose answer showed the restore may have landed with a token from
// before the raise: it fails (may have landed), and the reaper abandons a
// claim it made, once the epoch is raised. A restore that keeps the
// cluster ID and takes the revision back while no process runs is not
// seen: restore with a new cluster token, or --bump-revision.

// restoreGuard is what a store knows of the cluster it serves from.
type restoreGuard struct {
	// Read and written on every Txn without a lock.
	cluster atomic.Uint64 // the cluster ID answers carried (0: none yet)
	maxRev  atomic.Int64  // the highest revision an answer carried
	refuses atomic.Bool   // refusing is set

	mu sync.Mutex
	// refusing is the error writes fail with while a restore's epoch is
	// not raised yet (nil: none).
	refusing error
	raising  bool
}

func (s *Store) clusterKey() string { return s.ks.prefix + "cluster" }

// clusterValue is <prefix>cluster: the etcd cluster the prefix is served
// from, in hex.
type clusterValue struct {
	ClusterID string `json:"cluster_id"`
}

// floor is the highest revision of the answers the store has had: a
// linearizable request sent now is answered at that revision or later,
// whatever order concurrent answers arrive in.
func (s *Store) floor() int64 { return s.restored.maxRev.Load() }

// noteHeader checks the answer to a Txn sent when floor was the highest
// revision the store had seen against what it knew of its cluster: nil, or
// the error of a restore it shows (the write it answers may have landed).
func (s *Store) noteHeader(h *pb.ResponseHeader, floor int64) error {
	if h == nil {
		return nil
	}
	g := &s.restored
	if c := g.cluster.Load(); !g.refuses.Load() && (c == 0 || c == h.ClusterId) && h.Revision >= floor {
		g.cluster.CompareAndSwap(0, h.ClusterId)
		for m := g.maxRev.Load(); h.Revision > m && !g.maxRev.CompareAndSwap(m, h.Revision); m = g.maxRev.Load() {
		}
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var why string
	switch c := g.cluster.Load(); {
	case g.refusing != nil:
		return g.refusing
	case c != 0 && h.ClusterId != c:
		why = fmt.Sprintf("etcd's cluster ID is %x, was %x", h.ClusterId, c)
	default:
		why = fmt.Sprintf("etcd's revision went back to %d, after %d", h.Revision, floor)
	}
	return s.sawRestoreLocked(why)
}

// sawEpochBack notes a shard epoch lower than the one the store claimed
// under: a restore took the epoch key back.
func (s *Store) sawEpochBack(was, now int64) {
	s.restored.mu.Lock()
	defer s.restored.mu.Unlock()
	if s.restored.refusing == nil {
		s.sawRestoreLocked(fmt.Sprintf("the shard epoch went back to %d, after %d", now, was))
	}
}

// sawRestoreLocked starts refusing writes and raising the epoch.
func (s *Store) sawRestoreLocked(why string) error {
	g := &s.restored
	if g.refusing == nil {
		s.restores.Add(1) // claims made before never write again
		g.refuses.Store(true)
		g.refusing = fmt.Errorf("%w: %w: %s; writes wait until the epoch is raised above every token handed out before", ErrUnavailable, ErrRestored, why)
		s.log.Error("idem: etcd was restored from a snapshot: raising the epoch before writing again", "seen", why)
	}
	if !g.raising && s.life != nil {
		g.raising = true
		s.work.Go(s.clock, s.life, "epoch raise after a restore", s.raiseAfterRestore)
	}
	return g.refusing
}

// refusal returns the error writes fail with (without being sent) while a
// restore's epoch is not raised yet.
func (s *Store) refusal() error {
	if !s.restored.refuses.Load() {
		return nil
	}
	s.restored.mu.Lock()
	defer s.restored.mu.Unlock()
	if s.restored.refusing == nil {
		return nil
	}
	return fmt.Errorf("%w (%w)", ErrNotSent, s.restored.refusing)
}

// raiseAfterRestore raises the epoch, with backoff, until it is raised or
// the store closes.
func (s *Store) raiseAfterRestore(ctx context.Context) {
	for try := 0; ; try++ {
		err := s.raiseOnce(ctx)
		if err == nil {
			return
		}
		s.log.Warn("idem: raising the epoch after a restore; writes are refused until it is", "err", err)
		if clock.Sleep(s.clock, ctx, min(100*time.Millisecond<<min(try, 6), 5*time.Second)) != nil {
			s.restored.mu.Lock()
			s.restored.raising = false
			s.restored.mu.Unlock()
			return
		}
	}
}

// raiseOnce raises the epoch above the one this store claimed under, unless
// another process raised it above that already, and records the cluster's
// ID; then writes resume. Revisions say nothing here: the restored cluster
// hands out again revisions that other processes (gone, maybe) used.
func (s *Store) raiseOnce(ctx context.Context) error {
	e, err := s.raiseEpochAbove(ctx, s.epoch.Load(), false)
	if err != nil {
		return err
	}
	s.log.Warn("idem: epoch raised after a restore: writes resume", "epoch", e)
	// The claims this process held were made before the restore: they
	// never write again (restores), and a new session lets other
	// processes take their keys over at once, with greater tokens.
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess != nil {
		s.work.Go(s.clock, s.life, "end the session of before a restore", func(ctx context.Context) { sess.CloseContext(ctx) })
	}
	return nil
}

// raiseEpochAbove raises the epoch by DefaultRestoreEpochBump above
// believed, the epoch this store claimed under (every claim compares it,
// so a store that claims learns a raise), unless etcd's is above it
// already (another process raised it for this restore), records the
// cluster's ID in <prefix>cluster, and takes both as the store's own.
// force: raise whatever etcd holds (the store starts on a restored
// cluster, and knows no epoch it claimed under).
func (s *Store) raiseEpochAbove(ctx context.Context, believed int64, force bool) (int64, error) {
	for {
		ctx2, cancel := s.bound(ctx)
		resp, err := s.client.Txn(ctx2).Then(clientv3.OpGet(s.epochKey()), clientv3.OpGet(s.clusterKey())).Commit()
		cancel()
		if err != nil {
			return 0, fmt.Errorf("read the epoch: %w: %w", ErrUnavailable, err)
		}
		cur, epochRev := int64(0), int64(0)
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			if cur, err = parseEpoch(kvs[0].Value); err != nil {
				return 0, err
			}
			epochRev = kvs[0].ModRevision
		}
		clusterRev := int64(0)
		if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
			clusterRev = kvs[0].ModRevision
		}
		next := cur
		if force || cur <= believed {
			next = max(cur, believed) + defaultRestoreEpochBump
			if next >= 1<<(63-kernel.EpochShift) {
				return 0, fmt.Errorf("%w: the epoch cannot be raised past %d", ErrRestored, next)
			}
		}
		id, _ := json.Marshal(clusterValue{ClusterID: strconv.FormatUint(resp.Header.ClusterId, 16)})
		ops := []clientv3.Op{clientv3.OpPut(s.clusterKey(), string(id))}
		if next != cur {
			ops = append(ops, clientv3.OpPut(s.epochKey(), strconv.FormatInt(next, 10)))
		}
		ctx2, cancel = s.bound(ctx)
		tr, err := s.client.Txn(ctx2).If(clientv3.Compare(clientv3.ModRevision(s.epochKey()), "=", epochRev),
			clientv3.Compare(clientv3.ModRevision(s.clusterKey()), "=", clusterRev)).Then(ops...).Commit()
		cancel()
		if err != nil {
			return 0, fmt.Errorf("raise the epoch: %w: %w", ErrUnavailable, err)
		}
		if !tr.Succeeded {
			continue // another process wrote either meanwhile: read again
		}
		s.noteEpoch(next, tr.Header.Revision)
		g := &s.restored
		g.mu.Lock()
		g.cluster.Store(tr.Header.ClusterId)
		g.maxRev.Store(tr.Header.Revision)
		g.refusing, g.raising = nil, false
		g.refuses.Store(false)
		g.mu.Unlock()
		return next, nil
	}
}

// checkCluster is New's look at the cluster: it reads the epoch and
// <prefix>cluster, and raises the epoch before the store serves if the
// prefix was last served from another cluster (a restore that made a new
// one); it records the cluster's ID if none is recorded yet.
func (s *Store) checkCluster(ctx context.Context) error {
	ctx2, cancel := s.bound(ctx)
	resp, err := s.client.Txn(ctx2).Then(clientv3.OpGet(s.epochKey()), clientv3.OpGet(s.clusterKey())).Commit()
	cancel()
	if err != nil {
		return fmt.Errorf("read the epoch and the cluster's ID: %w: %w", ErrUnavailable, err)
	}
	e := int64(0)
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if e, err = parseEpoch(kvs[0].Value); err != nil {
			return err
		}
	}
	s.noteEpoch(e, resp.Header.Revision)
	id := strconv.FormatUint(resp.Header.ClusterId, 16)
	kvs := resp.Responses[1].GetResponseRange().Kvs
	if len(kvs) == 0 {
		// The first store on this prefix (or one written before idem
		// recorded clusters): record it; a lost race changes nothing.
		b, _ := json.Marshal(clusterValue{ClusterID: id})
		ctx2, cancel := s.bound(ctx)
		_, err := s.client.Txn(ctx2).If(clientv3.Compare(clientv3.CreateRevision(s.clusterKey()), "=", 0)).
			Then(clientv3.OpPut(s.clusterKey(), string(b))).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("record the cluster's ID: %w: %w", ErrUnavailable, err)
		}
		s.restored.cluster.Store(resp.Header.ClusterId)
		s.restored.maxRev.Store(resp.Header.Revision)
		return nil
	}
	var cv clusterValue
	if err := json.Unmarshal(kvs[0].Value, &cv); err != nil || cv.ClusterID == "" {
		return fmt.Errorf("%w: %s holds %q, not a cluster ID", ErrCorrupt, s.clusterKey(), kvs[0].Value)
	}
	s.restored.cluster.Store(resp.Header.ClusterId)
	s.restored.maxRev.Store(resp.Header.Revision)
	if cv.ClusterID == id {
		return nil
	}
	why := fmt.Sprintf("the data under %q was last served from etcd cluster %s, and this is cluster %s", s.ks.prefix, cv.ClusterID, id)
	s.log.Error("idem: etcd was restored from a snapshot: raising the epoch before serving", "seen", why)
	next, err := s.raiseEpochAbove(ctx, e, true)
	if err != nil {
		return fmt.Errorf("%w: %s; raising the epoch: %w", ErrRestored, why, err)
	}
	s.log.Warn("idem: epoch raised after a restore", "epoch", next)
	return nil
}
