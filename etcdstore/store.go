package etcdstore

import (
	"go.opentelemetry.io/otel/trace"

	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/cache"
	"github.com/idem-dev/idem/etcdstore/internal/dict"
	"github.com/idem-dev/idem/etcdstore/internal/send"
	"github.com/idem-dev/idem/etcdstore/internal/sweep"
	"github.com/idem-dev/idem/lease"
)

// Defaults of the Store's options.
const (
	DefaultPrefix         = "/idem/"
	DefaultRetention      = 24 * time.Hour
	DefaultBucketWidth    = time.Hour
	DefaultSessionTTL     = 10 * time.Second
	DefaultMaxRecordSize  = 1 << 20 // 1 MiB, well under etcd's 1.5 MiB request limit
	DefaultRetryAfter     = time.Second
	DefaultEndTimeout     = 10 * time.Second
	DefaultRequestTimeout = 5 * time.Second

	// maxRecordSizeLimit leaves room under etcd's 1.5 MiB request limit for
	// the key, the Txn framing and the caller's extra ops.
	maxRecordSizeLimit = 1<<20 + 256<<10
)

// Store is an idempotency store on etcd. It is safe for concurrent use.
//
// New starts its background work (the session lease, the expiry sweeper,
// the compression dictionary, the cache's Watch, final writes retried
// after an unknown outcome), on its clock (WithClock); Close stops it.
type Store struct {
	Admin // Get, List, Evict, Stats

	kv         *send.Sender // every conditional write goes through it
	buckets    *lease.Buckets
	retention  time.Duration
	sessionTTL time.Duration
	maxRecord  int
	retryAfter time.Duration
	endTimeout time.Duration
	format     byte // of the records written
	tracer     trace.Tracer
	traceKeys  bool

	full atomic.Bool // etcd refused the last write for lack of space

	epochs bool         // one shard of a set (WithEpochs)
	epoch  atomic.Int64 // the shard epoch last seen (or the one a restore raised)
	// restored is what the store knows of its cluster, to see a restore;
	// restores counts those seen (a claim made before one never writes).
	restored restoreGuard
	restores atomic.Int64
	epochAt  atomic.Int64               // the revision of the answer that taught epoch
	set      atomic.Pointer[namedValue] // the shard set last seen (WithEpochs); nil: none read yet

	cache     *cache.Cache[*Record] // nil without WithCache
	claimPath ClaimPath
	hitRate   atomic.Int64 // recent share of claims that found a record, in 1/65536

	sweep  *sweep.Sweeper // nil without
	bg     *background    // retried writes that outlive their call
	reaped atomic.Int64   // claims of unknown outcome given up in the background

	life context.Context // the store's background work ends with it (Close)
	stop context.CancelFunc
	work clock.Group

	mu      sync.Mutex
	sess    *lease.Session // nil while a lost session is being replaced
	running map[runKey]*Claim
	closed  bool
}

// CheckOptions reports whether opts would be refused by New, without an
// etcd client: a program checks its configuration with it before it talks
// to etcd (idem serve exits 2 on a refused value).
func CheckOptions(opts ...Option) error {
	_, err := newConfig(opts)
	return err
}

// newConfig applies opts to the defaults and checks what needs no etcd.
func newConfig(opts []Option) (config, error) {
	c := config{
		prefix:     DefaultPrefix,
		retention:  DefaultRetention,
		sessionTTL: DefaultSessionTTL,
		maxRecord:  DefaultMaxRecordSize,
		retryAfter: DefaultRetryAfter,
		endTimeout: DefaultEndTimeout,
		clock:      clock.Real,

		requestTimeout: DefaultRequestTimeout,
		cacheStaleness: DefaultCacheStaleness,
		format:         recordVersion,
		batchMembers:   DefaultBatchMembers,
		batchBytes:     DefaultBatchBytes,
	}
	for _, o := range opts {
		if err := o.apply(&c); err != nil {
			return c, fmt.Errorf("new store: %w", err)
		}
	}
	if c.bucketWidth == 0 {
		c.bucketWidth = min(DefaultBucketWidth, c.retention)
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	if c.sessionTTL < lease.MinTTL || c.sessionTTL%time.Second != 0 {
		return c, fmt.Errorf("new store: %w: session ttl %v must be whole seconds, at least %v", ErrInvalidArgument, c.sessionTTL, lease.MinTTL)
	}
	if err := lease.CheckBuckets(c.retention, c.bucketWidth); err != nil {
		return c, fmt.Errorf("new store: %w: %w", ErrInvalidArgument, err)
	}
	return c, nil
}

// New returns a Store on client and starts its session: it grants the
// session lease and writes the owner key. ctx, bounded by the request
// timeout (WithRequestTimeout), bounds those calls and every read New
// makes: with no etcd to answer, New fails with ErrUnavailable within the
// timeout. On a cluster restored from a snapshot, it raises the epoch
// first (ErrRestored). The Store does not close client.
func New(ctx context.Context, client *clientv3.Client, opts ...Option) (*Store, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil etcd client", ErrInvalidArgument)
	}
	c, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	ks := keyspace{prefix: c.prefix}
	b, err := lease.NewBuckets(client, ks.buckets(), c.retention, c.bucketWidth, lease.WithClock(c.clock))
	if err != nil {
		return nil, fmt.Errorf("new store: %w: %w", ErrInvalidArgument, err)
	}
	if c.keysPerLease > 0 {
		b.SetMaxUses(c.keysPerLease)
	}
	if !c.noSweep {
		b.SetGrace(2 * c.bucketWidth)
	}
	if c.requestTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = c.clock.WithTimeout(ctx, c.requestTimeout)
		defer cancel()
	}
	sess, err := lease.NewSession(ctx, client, ks.owners(), c.sessionTTL, lease.WithClock(c.clock))
	if err != nil {
		return nil, fmt.Errorf("new store: %w: %w", ErrUnavailable, err)
	}
	s := &Store{
		Admin:      Admin{client: client, ks: ks, clock: c.clock, timeout: c.requestTimeout, log: c.log},
		buckets:    b,
		retention:  c.retention,
		sessionTTL: c.sessionTTL,
		maxRecord:  c.maxRecord,
		retryAfter: c.retryAfter,
		endTimeout: c.endTimeout,
		format:     c.format,
		tracer:     c.tracer,
		traceKeys:  c.traceKeys,
		claimPath:  c.claimPath,
		epochs:     c.epochs,
		sess:       sess,
		running:    make(map[runKey]*Claim),
	}
	if err := s.start(ctx, client, c, b); err != nil {
		sess.CloseContext(ctx)
		return nil, fmt.Errorf("new store: %w", err)
	}
	return s, nil
}

// start builds the store's parts (the sender, dictionaries, sweeper and
// cache) and starts its background work.
func (s *Store) start(ctx context.Context, client *clientv3.Client, c config, b *lease.Buckets) error {
	ks := s.ks
	s.life, s.stop = context.WithCancel(context.Background())
	s.bg = newBackground(c.clock, c.log)
	b.Request = s.try
	s.kv = send.New(send.Config{KV: clientv3.RetryKVClient(client), Clock: c.clock, Try: s.tryWrite,
		Batching: !c.noBatching, MaxMembers: c.batchMembers, MaxBytes: c.batchBytes, Observe: c.observeTxn})
	s.dicts = dict.New(dict.Config{Client: client, Clock: c.clock, Log: c.log, Send: s.kv, Try: s.try,
		Prefix: ks.dictionaries(), Refresh: c.dictRefresh, Lease: func(ctx context.Context) (clientv3.LeaseID, error) { return b.For(ctx, s.clock.Now()) }})
	if err := s.checkCluster(ctx); err != nil {
		return err
	}
	if s.epochs {
		if _, err := s.loadEpoch(ctx); err != nil {
			return err
		}
	}
	if c.format == recordV3 {
		if _, err := s.dicts.Load(ctx); err != nil {
			s.log.Warn("idem: reading the current compression dictionary; records are compressed without it until it is read", "err", err)
		}
		s.work.Go(s.clock, s.life, "dictionary follower", s.dicts.Follow)
	}
	sess := s.sess
	s.work.Go(s.clock, s.life, "session supervisor", func(ctx context.Context) { s.superviseSession(ctx, sess) })
	if !c.noSweep {
		s.sweep = sweep.New(sweep.Config{Client: client, Clock: c.clock, Send: s.kv, Try: s.try,
			Buckets: ks.buckets(), Records: ks.records(), Locks: ks.sweeps(), Width: c.bucketWidth,
			Session: s.sessionLease, Margin: c.sweepMargin, Window: c.sweepWindow, Listed: c.sweepListed})
		s.work.Go(s.clock, s.life, "sweeper", s.sweep.Run)
	}
	if c.cacheBytes > 0 {
		s.cache = cache.New(cache.Config[*Record]{Client: client, Clock: c.clock, Log: c.log, Prefix: ks.records(),
			Bytes: c.cacheBytes, Bound: c.cacheStaleness, Timeout: c.requestTimeout,
			Decode: func(kv *mvccpb.KeyValue) (*Record, error) { return s.decodeKV(s.life, kv) },
			IsDone: isDone, Applied: testHookCacheApplied})
		s.work.Go(s.clock, s.life, "cache feed", s.cache.Run)
	}
	return nil
}

// testHookCacheApplied, when set by a test before New, is called after the
// cache has applied each watch event.
var testHookCacheApplied func(rev int64)

// tryWrite prepares the context of one write: like try, but always with
// a timeout, since a write that has left is waited for until it answers.
func (s *Store) tryWrite(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.timeout > 0 {
		return s.try(ctx)
	}
	return s.clock.WithTimeout(clientv3.WithRequireLeader(ctx), 30*time.Second)
}

// sessionLease returns the current session's owner and lease, for the
// sweeper's locks.
func (s *Store) sessionLease() (string, clientv3.LeaseID, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sess == nil {
		return "", clientv3.NoLease, false
	}
	return s.sess.Owner(), s.sess.Lease(), true
}

// Evict deletes key's record (see Admin.Evict), and drops it from this
// store's cache at once: a watch event older than the deletion, still on
// its way, does not put it back.
func (s *Store) Evict(ctx context.Context, key Key) error {
	rev, err := s.Admin.evict(ctx, key)
	if s.cache != nil {
		s.cache.Invalidate(s.ks.record(key), rev)
	}
	return err
}

// EvictIf is Admin.EvictIf, and drops the record from this store's cache.
func (s *Store) EvictIf(ctx context.Context, key Key, rev int64) (bool, error) {
	gone, at, err := s.Admin.evictIf(ctx, key, rev)
	if gone && s.cache != nil {
		s.cache.Invalidate(s.ks.record(key), at)
	}
	return gone, err
}

// readFirst reports whether the next claim should look for a record before
// writing.
func (s *Store) readFirst() bool {
	switch s.claimPath {
	case ClaimPathReadFirst:
		return true
	case ClaimPathWriteFirst:
		return false
	}
	return s.hitRate.Load() > hitRateThreshold
}

// hitRateThreshold: read first once a fifth of recent claims found a
// record. A read costs far less than the raft write a replay through the
// claim Txn costs, so reading first pays off well below half.
const hitRateThreshold = 65536 / 5

// observe records whether a claim found a record already there, in a moving
// average over about the last 64 claims.
func (s *Store) observe(found bool) {
	target := int64(0)
	if found {
		target = 65536
	}
	for {
		old := s.hitRate.Load()
		if s.hitRate.CompareAndSwap(old, old+(target-old)/64) {
			return
		}
	}
}

// MaxRecordSize returns the largest outcome plus checkpoint a claim can save.
func (s *Store) MaxRecordSize() int { return s.maxRecord }

// Retention returns how long keys are kept after their last write.
func (s *Store) Retention() time.Duration { return s.retention }

// Clock returns the clock the store runs on (WithClock): packages built on
// the store (jobs) run on it too.
func (s *Store) Clock() clock.Clock { return s.clock }

// Owner returns the owner id of the current session, or "" while a lost
// session is being replaced.
func (s *Store) Owner() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sess == nil {
		return ""
	}
	return s.sess.Owner()
}

// CheckFull asks etcd, when Metrics says it was full, whether it still
// refuses writes for lack of space (a Txn that writes nothing), so that a
// store that writes nothing learns when an operator freed space.
func (s *Store) CheckFull(ctx context.Context) (bool, error) {
	if !s.full.Load() {
		return false, nil
	}
	probe := s.ks.prefix + "full-probe"
	err := s.kv.Do(ctx, func(ctx context.Context) error {
		_, err := s.client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(probe), "<", 0)).Then(clientv3.OpPut(probe, "")).Commit()
		return err
	})
	switch {
	case errors.Is(err, rpctypes.ErrNoSpace):
		return true, nil
	case err != nil:
		return s.full.Load(), err
	}
	s.noteFull(false)
	return false, nil
}

// noteFull records whether etcd has room, and logs each change.
func (s *Store) noteFull(full bool) {
	if s.full.Swap(full) == full {
		return
	}
	if full {
		s.log.Error("idem: etcd is out of space (NOSPACE alarm): new keys are refused, replays still work; compact, defragment and disarm the alarm (docs/OPERATIONS.md)")
	} else {
		s.log.Info("idem: etcd accepts writes again")
	}
}

// Close ends the store. It cancels the context of every claim still
// running (cause ErrClosed), then waits, up to WithEndTimeout, for the
// final writes still pending in the background (outcomes of finished work
// that etcd did not acknowledge) to land, stops the background work, and
// only then revokes the session lease, which lets other processes take over
// unfinished claims at once. An outcome not saved within the bound is lost:
// its key is taken over later with a greater token (fence the work
// downstream). Close does not close the etcd client.
func (s *Store) Close() error {
	ctx := context.Background()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	running := s.running
	s.running = make(map[runKey]*Claim)
	s.mu.Unlock()
	began := s.now()
	s.log.Info("idem: store closing", "claims", len(running), "pending_final_writes", s.bg.Pending())
	for _, c := range running {
		c.cancel(ErrClosed)
	}
	left := s.bg.close(ctx, s.endTimeout)
	if left > 0 {
		s.log.Error("idem: closing with final writes that etcd has not acknowledged; their keys will be taken over",
			"writes", left, "waited", s.endTimeout.String())
	}
	defer func() { s.log.Info("idem: store closed", "left", left, "took", s.now().Sub(began).String()) }()
	s.mu.Lock()
	sess := s.sess
	s.sess = nil
	s.mu.Unlock()
	s.stop()
	s.work.Wait(s.clock, ctx)
	s.dicts.Close()
	if sess != nil {
		return sess.CloseContext(ctx)
	}
	return nil
}

// session returns the live session or an error wrapping ErrUnavailable or
// ErrClosed.
func (s *Store) session() (*lease.Session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return nil, ErrClosed
	case s.sess == nil:
		return nil, fmt.Errorf("%w: no live session (reconnecting)", ErrUnavailable)
	}
	return s.sess, nil
}

// superviseSession waits for the session to end, cancels the claims made
// under it, and replaces it, until the store closes.
//
// A claim whose work Run still runs is cancelled but not forgotten until
// Run has ended it; one whose work has finished and whose final write is
// still pending (finishLater) is neither cancelled nor forgotten: this
// process holds its outcome, so the claim stays registered across the new session, and a
// retry here is answered as in flight (ErrConflict) until the write has
// landed or been fenced out, instead of taking the key over from the dead
// session and running the work again.
func (s *Store) superviseSession(ctx context.Context, sess *lease.Session) {
	for {
		if s.clock.Wait(ctx, sess.Done()) != nil {
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return
		}
		s.sess = nil
		var lost []*Claim
		kept := 0
		for rk, c := range s.running {
			switch {
			case c.owner != sess.Owner():
			case c.pending.Load():
				kept++
			case c.inRun:
				// Its work is told, but the claim stays registered until
				// Run has ended it: the work may still act, and its
				// outcome may yet be saved.
				lost = append(lost, c)
			default:
				lost = append(lost, c)
				delete(s.running, rk)
			}
		}
		s.mu.Unlock()
		s.log.Warn("idem session lost; cancelling its claims and starting a new session",
			"owner", sess.Owner(), "claims", len(lost), "pending_final_writes", kept)
		for _, c := range lost {
			c.cancel(ErrSessionLost)
		}
		// The old lease is gone or unrenewable; revoking it is best effort.
		// The session is copied, not captured: the loop reassigns sess,
		// and a revoke that runs late would end the new one.
		old := sess
		s.work.Go(s.clock, ctx, "revoke lost session", func(ctx context.Context) { old.CloseContext(ctx) })

		next, ok := s.newSession(ctx)
		if !ok {
			return
		}
		sess = next
	}
}

// newSession retries until a session is made or the store closes.
func (s *Store) newSession(ctx context.Context) (*lease.Session, bool) {
	backoff := 50 * time.Millisecond
	for {
		// Each try gets a quarter of the TTL: a member that hangs costs that
		// much, and the next try, new RPCs, goes to another member.
		tctx, cancel := s.clock.WithTimeout(ctx, s.sessionTTL/4)
		sess, err := lease.NewSession(tctx, s.client, s.ks.owners(), s.sessionTTL, lease.WithClock(s.clock))
		cancel()
		if err == nil {
			s.mu.Lock()
			if s.closed {
				s.mu.Unlock()
				sess.CloseContext(ctx)
				return nil, false
			}
			s.sess = sess
			s.mu.Unlock()
			s.log.Info("idem session started", "owner", sess.Owner())
			return sess, true
		}
		s.log.Warn("idem session: cannot start", "err", err, "retry_in", backoff)
		if clock.Sleep(s.clock, ctx, backoff) != nil {
			return nil, false
		}
		backoff = min(2*backoff, s.sessionTTL/4)
	}
}

// runKey identifies a claim this process runs. Attempt ids are chosen by
// callers, so they are only unique per key.
type runKey struct {
	key     Key
	attempt string
}

// register records that c is being claimed or run by this process, before
// its claim Txn is sent, so a concurrent request never mistakes it for an
// orphan. A claim under a session must be registered while that session is
// the current one, or it would escape the sweep when the session is lost.
func (s *Store) register(c *Claim) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return ErrClosed
	case c.owner != deadlineOwner && (s.sess == nil || s.sess.Owner() != c.owner):
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrSessionLost)
	}
	rk := runKey{c.key, c.attempt}
	if _, dup := s.running[rk]; dup {
		return &ConflictError{Key: c.key, RetryAfter: s.retryAfter}
	}
	s.running[rk] = c
	return nil
}

func (s *Store) unregister(c *Claim) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rk := runKey{c.key, c.attempt}
	if s.running[rk] == c {
		delete(s.running, rk)
	}
}

// unregisterIfCurrent forgets the claim of rk at its deadline if it is
// still the one of life, unless its final write is pending: this process
// holds its outcome.
func (s *Store) unregisterIfCurrent(rk runKey, life *lifetime) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c := s.running[rk]; c != nil && c.life == life && !c.pending.Load() {
		delete(s.running, rk)
	}
}

// runningHere reports whether this process runs attempt on key, or holds
// its outcome while the final write is pending.
func (s *Store) runningHere(k Key, attempt string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.running[runKey{k, attempt}]
	return ok
}
