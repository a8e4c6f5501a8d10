package etcdstore

import (
	"go.opentelemetry.io/otel/trace"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/send"

	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/idem-dev/idem/internal/storeext"
)

// Option configures a Store (New). WithPrefix and WithRequestTimeout are
// AdminOptions too: they configure an Admin (NewAdmin) as well.
type Option interface{ apply(*config) error }

// AdminOption configures an Admin (NewAdmin), and a Store alike.
type AdminOption interface {
	Option
	admin()
}

type option func(*config) error

func (o option) apply(c *config) error { return o(c) }

type adminOption func(*config) error

func (o adminOption) apply(c *config) error { return o(c) }
func (adminOption) admin()                  {}

type config struct {
	prefix         string
	retention      time.Duration
	bucketWidth    time.Duration
	sessionTTL     time.Duration
	maxRecord      int
	retryAfter     time.Duration
	endTimeout     time.Duration
	requestTimeout time.Duration
	cacheBytes     int64
	cacheStaleness time.Duration
	epochs         bool
	claimPath      ClaimPath
	keysPerLease   int64
	format         byte
	log            *slog.Logger
	tracer         trace.Tracer // nil: no spans, no tracing code runs
	traceKeys      bool
	observeTxn     func(time.Duration)
	noBatching     bool
	noSweep        bool
	batchMembers   int
	batchBytes     int
	clock          clock.Clock

	// The sweeper's pace, for tests; zero: by the bucket width.
	sweepMargin, sweepWindow time.Duration
	sweepListed              func(records []string)
	dictRefresh              time.Duration // for tests; zero: a day
}

// WithClock sets the clock the store runs on: its time (record expiry,
// deadlines, buckets), its timers, the deadlines of its etcd requests, its
// background work and its waits (default clock.Real). A simulation hands in
// its own, to decide when each of those happens; production never sets it.
// The store's session and buckets run on it too.
func WithClock(c clock.Clock) AdminOption {
	return adminOption(func(cfg *config) error {
		if c == nil {
			return fmt.Errorf("%w: WithClock(nil)", ErrInvalidArgument)
		}
		cfg.clock = c
		return nil
	})
}

// WithPrefix sets the etcd key prefix under which the store keeps everything
// (default "/idem/"). It must end in "/". Stores with different prefixes are
// independent.
func WithPrefix(p string) AdminOption {
	return adminOption(func(c *config) error {
		if p == "" || !strings.HasSuffix(p, "/") {
			return fmt.Errorf("%w: prefix %q must be non-empty and end in /", ErrInvalidArgument, p)
		}
		c.prefix = p
		return nil
	})
}

// WithRetention sets how long a key is kept after its last write (default
// 24 h). Clients must stop retrying well inside it: after retention the same
// key starts a new operation. Whole seconds, at least 1 s.
func WithRetention(d time.Duration) Option {
	return option(func(c *config) error { c.retention = d; return nil })
}

// WithBucketWidth sets the width of a retention bucket (default 1 h, or the
// retention when that is shorter). Every record written in one bucket shares
// one lease, kept for retention plus at most one bucket width.
func WithBucketWidth(d time.Duration) Option {
	return option(func(c *config) error { c.bucketWidth = d; return nil })
}

// WithSessionTTL sets the TTL of the process's session lease (default 10 s,
// at least 2 s). A process that cannot renew it for this long is considered
// dead and its claims may be taken over: longer survives longer network
// hiccups, shorter recovers crashed work sooner.
func WithSessionTTL(d time.Duration) Option {
	return option(func(c *config) error { c.sessionTTL = d; return nil })
}

// WithMaxRecordSize caps the size of a saved outcome plus checkpoint
// (default 1 MiB, at most 1.25 MiB). Larger writes fail with ErrTooLarge.
func WithMaxRecordSize(n int) Option {
	return option(func(c *config) error {
		if n < 1024 || n > maxRecordSizeLimit {
			return fmt.Errorf("%w: max record size %d must be between 1 KiB and %d", ErrInvalidArgument, n, maxRecordSizeLimit)
		}
		c.maxRecord = n
		return nil
	})
}

// WithRetryAfter sets the retry hint of a ConflictError (default 1 s).
func WithRetryAfter(d time.Duration) Option {
	return option(func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("%w: retry-after %v must be positive", ErrInvalidArgument, d)
		}
		c.retryAfter = d
		return nil
	})
}

// WithEndTimeout bounds the final write of Do and Run (complete, release or
// abandon), which is made even if the caller's context has ended (default
// 10 s): a finished work's outcome is saved even if its caller gave up. It
// also bounds each background retry of such a write, and how long Close
// waits for those.
func WithEndTimeout(d time.Duration) Option {
	return option(func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("%w: end timeout %v must be positive", ErrInvalidArgument, d)
		}
		c.endTimeout = d
		return nil
	})
}

// WithRequestTimeout bounds every etcd request the store makes (default
// 5 s; 0 means none, only the caller's context): when etcd cannot be
// reached, calls fail with ErrUnavailable instead of waiting as long as the
// caller does. Waiting on a Watch (Wait, WithWait) is not bounded by it.
// Across data centres, set it above a few round trips plus an election.
func WithRequestTimeout(d time.Duration) AdminOption {
	return adminOption(func(c *config) error {
		if d < 0 {
			return fmt.Errorf("%w: request timeout %v must not be negative", ErrInvalidArgument, d)
		}
		c.requestTimeout = d
		return nil
	})
}

// WithKeysPerLease sets how many writes (claims, checkpoints, completes...)
// this process attaches to one retention lease before its bucket moves on
// to a fresh lease (default lease.DefaultMaxUses, 20000). Processes count
// apart, so one lease holds the records of at most that many writes per
// process: etcd deletes a lease's keys in one raft entry, applying nothing
// else meanwhile (docs/OPERATIONS.md).
func WithKeysPerLease(n int64) Option {
	return option(func(c *config) error {
		if n < 1 {
			return fmt.Errorf("%w: keys per lease %d must be at least 1", ErrInvalidArgument, n)
		}
		c.keysPerLease = n
		return nil
	})
}

// WithCache keeps up to bytes of done records in memory, fed and
// invalidated by an etcd Watch of every record, so that a replay needs no
// etcd round trip at all (default: no cache). It is the one read that may
// replay a record deleted elsewhere (until the deletion reaches its watch,
// typically milliseconds; Evict through this store invalidates it at once),
// and it answers only while it can prove that it lags etcd by less than
// WithCacheStaleness: a process cut off stops replaying within that bound.
func WithCache(bytes int64) Option {
	return option(func(c *config) error {
		if bytes < 0 {
			return fmt.Errorf("%w: cache size %d must not be negative", ErrInvalidArgument, bytes)
		}
		c.cacheBytes = bytes
		return nil
	})
}

// DefaultCacheStaleness is how far behind etcd the cache may be and still
// answer.
const DefaultCacheStaleness = 2 * time.Second

// WithCacheStaleness bounds how far behind etcd the cache may be and still
// answer (default DefaultCacheStaleness, at least 100 ms): the longest a
// record evicted elsewhere, or replaced after its retention, can still be
// replayed from this process's memory, partitions included. The cache
// proves itself current with an etcd progress request every quarter of the
// bound.
func WithCacheStaleness(d time.Duration) Option {
	return option(func(c *config) error {
		if d < 100*time.Millisecond {
			return fmt.Errorf("%w: cache staleness %v must be at least 100ms", ErrInvalidArgument, d)
		}
		c.cacheStaleness = d
		return nil
	})
}

// ClaimPath says how Claim looks for an existing record.
type ClaimPath int

const (
	// ClaimPathAdaptive (the default) reads first while a noticeable share
	// of recent claims found a record, and writes first otherwise.
	ClaimPathAdaptive ClaimPath = iota
	// ClaimPathWriteFirst always sends the claim Txn first: one round trip
	// for a new key, but a replay then costs a raft write (a Txn with a Put
	// in either branch is a write even when its Else runs).
	ClaimPathWriteFirst
	// ClaimPathReadFirst always reads first, with a linearizable Get: a
	// replay is never a raft write, and a new key costs that read more.
	ClaimPathReadFirst
)

// WithClaimPath sets the claim path (default ClaimPathAdaptive). The read
// is used only to find a done record; every other decision is made by the
// claim Txn. It is linearizable (a read-index round at the leader, no raft
// write): a serializable read on a member that lags would replay a record
// deleted before the request began.
func WithClaimPath(p ClaimPath) Option {
	return option(func(c *config) error {
		if p < ClaimPathAdaptive || p > ClaimPathReadFirst {
			return fmt.Errorf("%w: unknown claim path %d", ErrInvalidArgument, p)
		}
		c.claimPath = p
		return nil
	})
}

// WithRecordFormat sets the format of the records the store writes
// (default 3; every format is read). Format 1 is what idem 0.1 reads, 2
// what idem 0.2 reads; 3 compresses done records against a shared
// dictionary where that saves space. While a deployment upgrades, run the
// new processes with the format the oldest process reads, and switch to 3
// once no older process is left.
func WithRecordFormat(n int) Option {
	return option(func(c *config) error {
		if n != recordV1 && n != recordV2 && n != recordV3 {
			return fmt.Errorf("%w: record format %d: must be 1, 2 or 3", ErrInvalidArgument, n)
		}
		c.format = byte(n)
		return nil
	})
}

// WithBatching turns group commit on (the default) or off. On, the store's
// conditional writes issued at the same time by different callers go to
// etcd together, as the inner Txns of one outer Txn, applied in one raft
// entry at one revision: under load, many claims cost about one raft round
// and one fsync; an idle store never waits for a batch. Claims of different
// keys in one batch may share a fencing token; a key's tokens still only
// grow. Turn it off for an etcd older than 3.3 (no nested Txns), or to make
// every write its own etcd request.
func WithBatching(on bool) Option {
	return option(func(c *config) error { c.noBatching = !on; return nil })
}

// WithBatchLimits bounds a batch: at most members writes (default
// DefaultBatchMembers; at most 127, under etcd's default --max-txn-ops of
// 128) and at most bytes of request (default DefaultBatchBytes, under
// etcd's default --max-request-bytes of 1.5 MiB). Lower them for an etcd
// run with lower limits. A write larger than bytes goes alone.
func WithBatchLimits(members, bytes int) Option {
	return option(func(c *config) error {
		if members < 1 || members > 127 {
			return fmt.Errorf("%w: batch members %d must be between 1 and 127", ErrInvalidArgument, members)
		}
		if bytes < 4096 {
			return fmt.Errorf("%w: batch bytes %d must be at least 4096", ErrInvalidArgument, bytes)
		}
		c.batchMembers, c.batchBytes = members, bytes
		return nil
	})
}

// WithExpirySweep turns the expiry sweeper on (the default) or off. On, the
// store deletes the records of a retention bucket a few at a time once they
// have all expired, at about the rate they were written (each lease by one
// process), and its leases live two bucket widths longer as a backstop;
// off, etcd deletes them when their lease expires, all of a lease's
// records in one raft entry (docs/PERFORMANCE.md). Turn it off only to
// compare, or where no store process runs long enough to sweep.
func WithExpirySweep(on bool) Option {
	return option(func(c *config) error { c.noSweep = !on; return nil })
}

// WithTracerProvider makes the store record OpenTelemetry spans: idem.claim
// (renamed idem.replay or idem.takeover by what the claim found), idem.wait,
// and idem.complete, idem.checkpoint, idem.release, idem.abandon for the
// claim's writes, with attributes idem.tenant, idem.outcome,
// idem.fencing_token, idem.takeovers and idem.key.digest (a hash of the key;
// WithTraceKeys puts the key itself). Without it the store runs no tracing
// code at all.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return option(func(c *config) error {
		if tp == nil {
			return fmt.Errorf("%w: WithTracerProvider(nil)", ErrInvalidArgument)
		}
		c.tracer = tp.Tracer(tracerName)
		return nil
	})
}

// withTxnObserver has f told how long each of the store's conditional
// write transactions took (claims, completes, checkpoints...; one call per
// etcd Txn, batched or not): etcd's latency as the store sees it, without
// the work or any wait. idem serve exports it as
// idem_etcd_txn_duration_seconds. f must be quick and safe for concurrent
// use.
func withTxnObserver(f func(time.Duration)) Option {
	return option(func(c *config) error { c.observeTxn = f; return nil })
}

// WithTraceKeys records keys themselves in spans (idem.key) rather than
// their digest. Keys can be personal or secret data (an email, an order
// number): only where traces are as protected as the data.
func WithTraceKeys(on bool) Option {
	return option(func(c *config) error { c.traceKeys = on; return nil })
}

// WithLogger sets the logger for session events (default: discard).
func WithLogger(l *slog.Logger) Option {
	return option(func(c *config) error { c.log = l; return nil })
}

// RunOption configures Do and Run. Every ClaimOption is one; OnError is
// one only.
type RunOption interface{ applyRun(*claimConfig) error }

// ClaimOption configures Claim, and Do and Run alike.
type ClaimOption interface {
	RunOption
	claim()
}

type claimOption func(*claimConfig) error

func (o claimOption) applyRun(c *claimConfig) error { return o(c) }
func (claimOption) claim()                          {}

type runOption func(*claimConfig) error

func (o runOption) applyRun(c *claimConfig) error { return o(c) }

type claimConfig struct {
	attempt   string
	deadline  time.Duration
	wait      bool
	onError   End
	noSession bool
	fence     bool  // write the claim abandoned (reap)
	existing  bool  // WithoutCreate
	overMoved bool  // ReplaceMoved
	setRev    int64 // UnderShardSet (0: the store's own)
	run       bool  // made by Run, which calls the work and ends the claim
}

// underShardSet guards a claim (or Forward) with the shard set recorded at
// revision rev (ShardSetValue, as ShardSet returned it), instead of the one
// the store last read: package shard routes a key by a set, and the claim
// must be refused if that is no longer the set in force, even when the
// store has learnt of a newer one meanwhile.
func underShardSet(rev int64) ClaimOption {
	return claimOption(func(c *claimConfig) error {
		if rev <= 0 {
			return fmt.Errorf("%w: shard set revision %d", ErrInvalidArgument, rev)
		}
		c.setRev = rev
		return nil
	})
}

// withoutCreate makes a claim take only a key that has a live record in
// this store (in flight: recognised or taken over as usual; done:
// replayed): when the key has none (absent, past its retention, or Moved),
// the claim writes nothing and fails with an error wrapping ErrNotFound.
// Package shard claims a key this way on the shard it is moving away from,
// where it may stay only while its operation lives.
func withoutCreate() ClaimOption {
	return claimOption(func(c *claimConfig) error {
		c.existing = true
		return nil
	})
}

// replaceMoved makes a claim treat a Moved record of the key in this store
// as stale: the key is claimed here as a new operation, replacing the
// record (compared by its revision), instead of failing with a
// *MovedError. Package shard claims a key this way on the shard the set in
// force places it on, where a Moved record can only have been left by an
// older shard set.
func replaceMoved() ClaimOption {
	return claimOption(func(c *claimConfig) error {
		c.overMoved = true
		return nil
	})
}

// MaxAttemptLen is the longest attempt id.
const MaxAttemptLen = 64

// WithAttempt sets the attempt id of a claim (default: 26 random base32
// characters, 130 bits, from crypto/rand).
// A caller that got an error from Claim (a timeout, a reset connection: the
// claim may or may not have been written) and retries with the same attempt
// id is recognised as the owner of the claim it may have made, instead of
// conflicting with itself. Never share an attempt id between two attempts
// that may run at once. 1 to 64 bytes of visible ASCII.
//
// The attempt id is also the claim's capability: whoever knows the key, the
// token and the attempt id can Attach to the claim and complete, checkpoint,
// release or abandon it. An attempt id that crosses a trust boundary (a
// worker of the HTTP API chooses its own) must be random and long enough
// not to be guessed: at least 128 random bits.
func WithAttempt(id string) ClaimOption {
	return claimOption(func(c *claimConfig) error {
		if err := validateID(id); err != nil || len(id) > MaxAttemptLen {
			return fmt.Errorf("%w: attempt id %q must be 1 to %d bytes of visible ASCII", ErrInvalidArgument, id, MaxAttemptLen)
		}
		c.attempt = id
		return nil
	})
}

// WithDeadline gives the claim a deadline d from now: past it, the claim is
// stale even if its owner is alive, another caller may take it over, and the
// claim's context is cancelled with cause ErrDeadline. The deadline must
// outlast any honest run of the work (at least the request deadline plus the
// downstream timeout), or live work is taken over by
// design. Deadlines compare wall clocks of different machines: allow for
// skew. Without a deadline only the owner's death makes a claim stale.
func WithDeadline(d time.Duration) ClaimOption {
	return claimOption(func(c *claimConfig) error {
		if d <= 0 {
			return fmt.Errorf("%w: deadline %v must be positive", ErrInvalidArgument, d)
		}
		c.deadline = d
		return nil
	})
}

// WithoutSession ties the claim's liveness to its deadline alone, not to
// this process's session: the claim is stale only once its deadline passes,
// and it survives this process. It is for claims held on behalf of a remote
// worker (idem's HTTP worker API), whose liveness is its renewals (Renew).
// It requires WithDeadline.
func WithoutSession() ClaimOption {
	return claimOption(func(c *claimConfig) error { c.noSession = true; return nil })
}

// DeadlineOwner is the Owner of the record of a claim made WithoutSession
// (the worker API's): no session, live until its deadline. It is never an
// owner key, and it cannot collide with a session's owner id (a UUID).
const DeadlineOwner = deadlineOwner

const deadlineOwner = "~deadline"

// WithWait makes Claim and Do wait, on an etcd Watch, while a live owner runs
// the key, instead of returning a ConflictError at once. The wait ends when
// the key is done (its outcome is returned), released or stale (the caller
// claims it), or ctx ends.
func WithWait() ClaimOption {
	return claimOption(func(c *claimConfig) error { c.wait = true; return nil })
}

// End says how a claim whose work ran ends: what Run does with a work's
// result, and what Do does when the work fails (OnError). There is no
// choice that is right for every work; pick one deliberately.
type End int

const (
	// EndSave completes the claim with the outcome, replayed to every
	// retry. For a failed work (OnError's default) the error's message is
	// saved, as Stripe's API v1 saves 500s: every retry gets the same error
	// back and the work never runs again for this key. It is the only choice
	// that is safe when the work is not idempotent downstream and may have
	// had an effect before failing. The client needs a new key to try
	// again.
	EndSave End = iota

	// EndRelease deletes the claim, so a retry with the same key runs the
	// work again. Safe only when the work failed before any effect, or is
	// idempotent downstream (it passes its own key on, such as
	// charge:<orderId>); otherwise it brings the double charge back. A claim
	// that took the key over is abandoned instead (Claim.Release).
	EndRelease

	// EndAbandon leaves the claim in flight, with its last checkpoint and
	// no owner: the next request with the key takes it over at once and
	// resumes from the checkpoint, with a greater fencing token (Brandur
	// Leach's recovery points). For multi-step work that saves recovery
	// points with Claim.Checkpoint.
	EndAbandon
)

func (e End) String() string {
	switch e {
	case EndSave:
		return "save"
	case EndRelease:
		return "release"
	case EndAbandon:
		return "abandon"
	}
	return fmt.Sprintf("End(%d)", int(e))
}

// OnError sets how Do and Run end a claim whose work fails (Do: returns an
// error; Run and Do: panics). Default EndSave.
//
// Whatever is set, a Do work whose context was cancelled (the caller gave
// up, the claim was lost) is abandoned, not saved: "context canceled" is not
// the operation's outcome, and the next request resumes it.
func OnError(e End) RunOption {
	return runOption(func(c *claimConfig) error {
		if e < EndSave || e > EndAbandon {
			return fmt.Errorf("%w: unknown end %d", ErrInvalidArgument, e)
		}
		c.onError = e
		return nil
	})
}

// Defaults of the batches (WithBatchLimits). etcd refuses a Txn of more
// than --max-txn-ops (default 128) ops in a branch, counting each inner
// Txn as one, and a request over --max-request-bytes (default 1.5 MiB).
const (
	DefaultBatchMembers = send.DefaultMaxMembers
	DefaultBatchBytes   = send.DefaultMaxBytes
)

// storeSettings are the limits a store opened with some options keeps, known
// before it connects: package shard answers with them for all its shards.
type storeSettings = storeext.Settings

// settingsOf returns the settings a store opened with opts would have, or
// the error New would give for them.
func settingsOf(opts ...Option) (storeSettings, error) {
	c, err := newConfig(opts)
	if err != nil {
		return storeSettings{}, err
	}
	return storeSettings{Retention: c.retention, MaxRecordSize: c.maxRecord}, nil
}
