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

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/internal/sim"
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
// New starts goroutines, all stopped by Close: one that keeps the process's
// session lease alive, one that replaces the session when it is lost, and,
// WithCache, one that feeds the cache from a Watch. A claim whose final
// write failed with an unknown outcome also runs a goroutine that retries
// that write until it lands or is fenced out; Close waits for those (up to
// WithEndTimeout) before it revokes the session.
type Store struct {
	Admin // Get, List, Evict, Stats

	client     *clientv3.Client
	kv         pb.KVClient // the client's raw KV API, for hot-path Txns
	buckets    *lease.Buckets
	retention  time.Duration
	sessionTTL time.Duration
	maxRecord  int
	retryAfter time.Duration
	endTimeout time.Duration
	format     byte // of the records written
	log        *slog.Logger
	tracer     trace.Tracer
	observeTxn func(time.Duration)
	traceKeys  bool

	full atomic.Bool // etcd refused the last write for lack of space

	epochs bool         // one shard of a set (WithEpochs)
	epoch  atomic.Int64 // the shard epoch last seen

	cache     *doneCache // nil without WithCache
	claimPath ClaimPath
	hitRate   atomic.Int64 // recent share of claims that found a record, in 1/65536

	batch *batcher // group commit; nil without
	sweep *sweeper // expiry without stalls; nil without
	// Pace of the sweeper, for tests; zero: by the bucket width.
	sweepMargin, sweepWindow time.Duration
	// sweepListed, when a test sets it before the sweeper runs, is called
	// with the records a sweep listed, before it deletes any.
	sweepListed func(records []string)
	bg          *background                                    // retried writes that outlive their call
	afterFunc   func(time.Duration, func()) (stop func() bool) // deadline timers

	mu      sync.Mutex
	sess    *lease.Session // nil while a lost session is being replaced
	running map[runKey]*Claim
	closed  bool

	closing chan struct{}
	wg      sync.WaitGroup
}

// New returns a Store on client and starts its session: it grants the
// session lease and writes the owner key, so ctx bounds those two calls.
// The Store does not close client.
func New(ctx context.Context, client *clientv3.Client, opts ...Option) (*Store, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil etcd client", ErrInvalidArgument)
	}
	c := config{
		prefix:     DefaultPrefix,
		retention:  DefaultRetention,
		sessionTTL: DefaultSessionTTL,
		maxRecord:  DefaultMaxRecordSize,
		retryAfter: DefaultRetryAfter,
		endTimeout: DefaultEndTimeout,

		requestTimeout: DefaultRequestTimeout,
		cacheStaleness: DefaultCacheStaleness,
		format:         recordVersion,
		batchMembers:   DefaultBatchMembers,
		batchBytes:     DefaultBatchBytes,
	}
	for _, o := range opts {
		if err := o.apply(&c); err != nil {
			return nil, fmt.Errorf("new store: %w", err)
		}
	}
	if c.bucketWidth == 0 {
		c.bucketWidth = min(DefaultBucketWidth, c.retention)
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	ks := keyspace{prefix: c.prefix}
	b, err := lease.NewBuckets(client, ks.buckets(), c.retention, c.bucketWidth)
	if err != nil {
		return nil, fmt.Errorf("new store: %w: %w", ErrInvalidArgument, err)
	}
	if c.keysPerLease > 0 {
		b.SetMaxUses(c.keysPerLease)
	}
	hooks := sim.Lookup(client)
	sweeping := !c.noSweep && hooks == nil // (a simulation's clock is not the sweeper's)
	if sweeping {
		b.SetGrace(2 * c.bucketWidth)
	}
	if c.sessionTTL < lease.MinTTL || c.sessionTTL%time.Second != 0 {
		return nil, fmt.Errorf("new store: %w: session ttl %v must be whole seconds, at least %v", ErrInvalidArgument, c.sessionTTL, lease.MinTTL)
	}
	sess, err := lease.NewSession(ctx, client, ks.owners(), c.sessionTTL)
	if err != nil {
		return nil, fmt.Errorf("new store: %w: %w", ErrUnavailable, err)
	}
	now, afterFunc := time.Now, func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }
	if hooks != nil {
		now, afterFunc = hooks.Now, hooks.AfterFunc
	}
	s := &Store{
		Admin:      Admin{client: client, ks: ks, now: now, timeout: c.requestTimeout, log: c.log},
		client:     client,
		kv:         clientv3.RetryKVClient(client),
		buckets:    b,
		retention:  c.retention,
		sessionTTL: c.sessionTTL,
		maxRecord:  c.maxRecord,
		retryAfter: c.retryAfter,
		endTimeout: c.endTimeout,
		format:     c.format,
		log:        c.log,
		tracer:     c.tracer,
		observeTxn: c.observeTxn,
		traceKeys:  c.traceKeys,
		claimPath:  c.claimPath,
		sess:       sess,
		running:    make(map[runKey]*Claim),
		closing:    make(chan struct{}),
		bg:         newBackground(hooks, c.log),
		afterFunc:  afterFunc,
	}
	b.Request = s.try
	if !c.noBatching && hooks == nil {
		// (A simulation runs one caller at a time: nothing to batch.)
		s.batch = newBatcher(s.kv, s.try, c.batchMembers, c.batchBytes)
		s.batch.observe = c.observeTxn
	}
	if c.epochs {
		s.epochs = true
		if _, err := s.loadEpoch(ctx); err != nil {
			sess.Close()
			return nil, fmt.Errorf("new store: %w", err)
		}
	}
	if c.format == recordV3 {
		d := s.dictionaries()
		d.retention = c.retention
		if err := d.load(ctx); err != nil {
			s.log.Warn("idem: reading the current compression dictionary; records are written uncompressed until it is read", "err", err)
		}
		s.wg.Add(1)
		go s.followDictionary()
	}
	s.wg.Add(1)
	go s.superviseSession(sess)
	if sweeping {
		s.sweep = &sweeper{}
		s.wg.Add(1)
		go s.runSweeper()
	}
	if c.cacheBytes > 0 {
		s.cache = newDoneCache(c.cacheBytes, c.cacheStaleness)
		s.cache.decode = s.decode
		s.wg.Add(1)
		go s.feedCache()
	}
	return s, nil
}

// Evict deletes key's record (see Admin.Evict), and drops it from this
// store's cache at once: a watch event older than the deletion, still on
// its way, does not put it back.
func (s *Store) Evict(ctx context.Context, key Key) error {
	rev, err := s.Admin.evict(ctx, key)
	if s.cache != nil {
		s.cache.invalidate(s.ks.record(key), rev)
	}
	return err
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

// Live reports whether the store has a live session: claims can be made.
func (s *Store) Live() bool { return s.Owner() != "" }

// Full reports whether etcd refused this store's last write for lack of
// space (the NOSPACE alarm: the database reached its quota), and no write
// has been accepted since. While it is full, new keys and takeovers fail
// with ErrStoreFull; done keys are still replayed, and in-flight keys still
// conflict.
func (s *Store) Full() bool { return s.full.Load() }

// CheckFull asks etcd whether it still refuses writes for lack of space,
// when Full says it did, and returns the answer: a Txn whose Put can never
// run (its compare is never true), which etcd refuses while its NOSPACE
// alarm is raised and otherwise answers writing nothing. A store that
// writes nothing while etcd is full would otherwise never learn that an
// operator freed space.
func (s *Store) CheckFull(ctx context.Context) (bool, error) {
	if !s.Full() {
		return false, nil
	}
	ctx, cancel := s.try(ctx)
	defer cancel()
	probe := s.ks.prefix + "full-probe"
	_, err := s.client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(probe), "<", 0)).Then(clientv3.OpPut(probe, "")).Commit()
	switch {
	case errors.Is(err, rpctypes.ErrNoSpace):
		return true, nil
	case err != nil:
		return s.Full(), err
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

// Running returns how many claims this process holds and has not ended.
func (s *Store) Running() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.running)
}

// Close ends the store. It cancels the context of every claim still
// running (cause ErrClosed), then waits, up to WithEndTimeout, for the
// final writes still pending in the background (outcomes of finished work
// that etcd did not acknowledge) to land, stops the background goroutines,
// and revokes the session lease, which lets other processes take over
// unfinished claims at once. An outcome that could not be saved within the
// bound is lost: its key is taken over later with a greater token, so the
// work must be fenced downstream. Wait for running work to finish before
// calling Close when that matters. Close does not close the etcd client.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	running := s.running
	s.running = make(map[runKey]*Claim)
	s.mu.Unlock()
	for _, c := range running {
		c.cancel(ErrClosed)
	}
	if left := s.bg.close(s.endTimeout); left > 0 {
		s.log.Error("idem: closing with final writes that etcd has not acknowledged; their keys will be taken over",
			"writes", left, "waited", s.endTimeout.String())
	}
	s.mu.Lock()
	sess := s.sess
	s.sess = nil
	s.mu.Unlock()
	close(s.closing)
	s.wg.Wait()
	if s.dicts != nil {
		s.dicts.close()
	}
	if sess != nil {
		return sess.Close()
	}
	return nil
}

// untilClosed returns a context that ends when the store closes, for the
// store's own goroutines.
func (s *Store) untilClosed() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		select {
		case <-s.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// followDictionary watches which compression dictionary is current, until
// the store closes: a dictionary another process published becomes this
// one's at once. A broken watch starts again, after a read.
func (s *Store) followDictionary() {
	defer s.wg.Done()
	ctx, cancel := s.untilClosed()
	defer cancel()
	for try := 0; ctx.Err() == nil; try++ {
		if err := s.dicts.load(ctx); err != nil {
			s.log.Debug("idem: reading the current compression dictionary", "err", err)
			if !backoff(ctx, min(try, 6)) {
				return
			}
			continue
		}
		wch := s.client.Watch(clientv3.WithRequireLeader(ctx), s.dicts.currentKey())
		for wr := range wch {
			if wr.Err() != nil {
				break
			}
			if len(wr.Events) > 0 {
				if err := s.dicts.load(ctx); err != nil {
					s.log.Debug("idem: reading the current compression dictionary", "err", err)
				}
			}
		}
		if !backoff(ctx, min(try, 6)) {
			return
		}
	}
}

// Pending returns how many final writes this process still retries in the
// background: outcomes of finished work, or abandons of claims whose write
// had an unknown outcome, that etcd has not acknowledged yet.
func (s *Store) Pending() int { return s.bg.Pending() }

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
func (s *Store) superviseSession(sess *lease.Session) {
	defer s.wg.Done()
	for {
		select {
		case <-s.closing:
			return
		case <-sess.Done():
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return
		}
		s.sess = nil
		var lost []*Claim
		for rk, c := range s.running {
			if c.owner == sess.Owner() {
				lost = append(lost, c)
				delete(s.running, rk)
			}
		}
		s.mu.Unlock()
		s.log.Warn("idem session lost; cancelling its claims and starting a new session",
			"owner", sess.Owner(), "claims", len(lost))
		for _, c := range lost {
			c.cancel(ErrSessionLost)
		}
		// The old lease is gone or unrenewable; revoking it is best effort.
		// The session is passed, not captured: the loop reassigns sess, and
		// a late goroutine would otherwise revoke the new session.
		s.wg.Add(1)
		go func(old *lease.Session) {
			defer s.wg.Done()
			old.Close()
		}(sess)

		next, ok := s.newSession()
		if !ok {
			return
		}
		sess = next
	}
}

// newSession retries until a session is made or the store closes.
func (s *Store) newSession() (*lease.Session, bool) {
	backoff := 50 * time.Millisecond
	for {
		// Each try gets a quarter of the TTL: a member that hangs costs that
		// much, and the next try, new RPCs, goes to another member.
		ctx, cancel := context.WithTimeout(context.Background(), s.sessionTTL/4)
		sess, err := lease.NewSession(ctx, s.client, s.ks.owners(), s.sessionTTL)
		cancel()
		if err == nil {
			s.mu.Lock()
			if s.closed {
				s.mu.Unlock()
				sess.Close()
				return nil, false
			}
			s.sess = sess
			s.mu.Unlock()
			s.log.Info("idem session started", "owner", sess.Owner())
			return sess, true
		}
		s.log.Warn("idem session: cannot start", "err", err, "retry_in", backoff)
		select {
		case <-s.closing:
			return nil, false
		case <-time.After(backoff):
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

// unregisterIf forgets rk if it is still the claim whose context is ctx.
func (s *Store) unregisterIf(rk runKey, ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c := s.running[rk]; c != nil && c.ctx == ctx {
		delete(s.running, rk)
	}
}

// runningHere reports whether this process runs attempt on key.
func (s *Store) runningHere(k Key, attempt string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.running[runKey{k, attempt}]
	return ok
}
