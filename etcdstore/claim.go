package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/lease"
)

// Claim is a claim on a key: the right, fenced by Token, to run its work and
// save its outcome. Every Claim must end with Complete, Release or Abandon;
// until then the process holds the key and other callers get ErrConflict.
// A Claim's methods are safe for concurrent use; its writes are serialised.
type Claim struct {
	s         *Store
	key       Key
	fp        Fingerprint
	attempt   string
	owner     string
	token     fencing.Token
	created   time.Time
	deadline  time.Time
	takeovers int     // how often the key was taken over before this claim
	previous  *Record // the stale record this claim replaced, or nil

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu         sync.Mutex
	timer      func() bool // stops the timer that cancels ctx with ErrDeadline at the deadline
	watching   bool        // the deadline timer is armed: always for claims made here, on first use for attached ones
	rev        int64       // ModRevision of this claim's last write: the fence
	checkpoint []byte
	ended      bool
}

// Key returns the claimed key.
func (c *Claim) Key() Key { return c.key }

// Token returns the claim's fencing token: the etcd revision of the claim.
// Send it with every downstream write (fencing.SetHeader) so a stale worker
// is refused there too.
func (c *Claim) Token() fencing.Token { return c.token }

// Fingerprint returns the fingerprint the key was claimed with.
func (c *Claim) Fingerprint() Fingerprint { return c.fp }

// Attempt returns the claim's attempt id.
func (c *Claim) Attempt() string { return c.attempt }

// Deadline returns the claim's deadline, or the zero time.
func (c *Claim) Deadline() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deadline
}

// TookOver reports whether the key was taken over from a stale owner (dead,
// past its deadline, or abandoned) at least once. The work may then have run,
// in part or in full, before: resume from LastCheckpoint and rely on
// downstream idempotency or fencing for the rest.
func (c *Claim) TookOver() bool { return c.takeovers > 0 }

// Previous returns the stale record this claim replaced, or nil when it did
// not replace one (including when it recognised its own earlier takeover).
func (c *Claim) Previous() *Record { return c.previous }

// LastCheckpoint returns the most recent checkpoint: the one inherited on a
// takeover, or the last one this claim saved.
func (c *Claim) LastCheckpoint() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.checkpoint
}

// Done returns a channel that is closed when the claim is lost (session
// lost, deadline passed, store closed) or ended.
func (c *Claim) Done() <-chan struct{} {
	c.mu.Lock()
	c.watchLocked()
	c.mu.Unlock()
	return c.ctx.Done()
}

// Err returns why the claim is no longer held: ErrSessionLost, ErrDeadline,
// ErrClosed, ErrFenced or ErrClaimEnded; nil while it is.
func (c *Claim) Err() error {
	if c.ctx.Err() != nil {
		return context.Cause(c.ctx)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.deadline.IsZero() && !c.s.now().Before(c.deadline) {
		return ErrDeadline
	}
	return nil
}

// Context returns a context derived from parent that is also cancelled when
// the claim is lost or ends, with the claim's cause, and that carries the
// fencing token (fencing.FromContext). Call the cancel function when done.
func (c *Claim) Context(parent context.Context) (context.Context, context.CancelFunc) {
	c.mu.Lock()
	c.watchLocked()
	c.mu.Unlock()
	ctx, cancel := context.WithCancelCause(fencing.NewContext(parent, c.token))
	stop := context.AfterFunc(c.ctx, func() { cancel(context.Cause(c.ctx)) })
	return ctx, func() {
		stop()
		cancel(context.Canceled)
	}
}

// IsOwner returns a comparison that holds while this claim's last write is
// still the record's last write: put it in your own etcd Txns to fence
// them, as etcd's concurrency.Mutex.IsOwner does. It changes after each
// Checkpoint.
func (c *Claim) IsOwner() clientv3.Cmp {
	c.mu.Lock()
	defer c.mu.Unlock()
	return clientv3.Compare(clientv3.ModRevision(c.s.ks.record(c.key)), "=", c.rev)
}

// Claim claims key for a request whose parameters have fingerprint fp. It
// returns exactly one of:
//
//   - a *Claim, when the caller must run the work: a new claim, a takeover
//     of a stale one, or the caller's own claim whose reply was lost;
//   - the done *Record, when the key's work already finished with the same
//     fingerprint: replay its Outcome, do not run the work;
//   - an error: *MismatchError (different fingerprint: never run, never
//     replay), *ConflictError (in flight under a live owner: retry later),
//     bad input (nothing was sent to etcd), or ErrUnavailable.
//
// A new key costs one etcd Txn: If(CreateRevision == 0) Then(Put) Else(Get).
// An in-flight key costs a second, read-only round trip to check its owner's
// liveness, and a takeover a third: a compare-and-set on the record's
// ModRevision, which only one claimant can win.
func (s *Store) Claim(ctx context.Context, key Key, fp Fingerprint, opts ...ClaimOption) (*Claim, *Record, error) {
	var cfg claimConfig
	for _, o := range opts {
		if err := o.applyRun(&cfg); err != nil {
			return nil, nil, fmt.Errorf("claim %s: %w", key, err)
		}
	}
	return s.claim(ctx, key, fp, &cfg)
}

// claim is Claim with its options applied.
func (s *Store) claim(ctx context.Context, key Key, fp Fingerprint, cfg *claimConfig) (*Claim, *Record, error) {
	if err := key.Validate(); err != nil {
		return nil, nil, fmt.Errorf("claim: %w", err)
	}
	if done, err := s.findDone(ctx, key, fp); done != nil || err != nil {
		return nil, done, err // a replay needs no claim, no session, no write
	}
	sess, err := s.session()
	if err != nil {
		return nil, nil, fmt.Errorf("claim %s: %w", key, err)
	}
	if cfg.attempt == "" {
		cfg.attempt = s.attemptPrefix + strconv.FormatInt(s.attempts.Add(1), 36)
	}
	owner := sess.Owner()
	if cfg.noSession {
		if cfg.deadline <= 0 {
			return nil, nil, fmt.Errorf("claim %s: %w: WithoutSession needs WithDeadline", key, ErrInvalidArgument)
		}
		owner = deadlineOwner
	}
	c := &Claim{s: s, key: key, fp: fp, attempt: cfg.attempt, owner: owner}
	c.ctx, c.cancel = context.WithCancelCause(context.Background())
	if err := s.register(c); err != nil {
		c.cancel(ErrClaimEnded)
		return nil, nil, fmt.Errorf("claim %s: %w", key, err)
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	done, uncertain, err := s.acquire(ctx, c, sess, cfg)
	if err != nil || done != nil {
		s.unregister(c)
		c.cancel(ErrClaimEnded)
		if uncertain {
			// A claim write of ours may have landed although we could not
			// learn it: nobody here will run it, and other processes would
			// see a live owner until this one dies. Give it up if it is ours.
			s.abandonIfOurs(key, c.owner, c.attempt)
		}
		return nil, done, err
	}
	c.mu.Lock()
	c.watchLocked()
	c.mu.Unlock()
	if err := c.Err(); err != nil {
		// Lost while its claim Txn was on its way (the session ended, the
		// store closed): never hand out a claim that is already stale to
		// everyone else. Its record is taken over by the next claimant.
		s.unregister(c)
		return nil, nil, fmt.Errorf("claim %s: %w: %w", key, ErrUnavailable, err)
	}
	return c, nil, nil
}

// armDeadlineLocked (re)starts the timer that ends the claim's context at
// its deadline. A claim past its deadline is no longer held by this
// process: it is unregistered, so the next request here may take it over as
// any other process may.
func (c *Claim) armDeadlineLocked() {
	if c.timer != nil {
		c.timer()
		c.timer = nil
	}
	if c.deadline.IsZero() {
		return
	}
	// The timer holds the context's cancel function and the store, not the
	// claim: an attached claim dropped by its caller keeps no checkpoint
	// alive until its deadline.
	if !c.watching {
		return // armed on first use of Done or Context
	}
	cancel, s, rk, ctx := c.cancel, c.s, runKey{c.key, c.attempt}, c.ctx
	c.timer = s.afterFunc(c.deadline.Sub(s.now()), func() {
		cancel(ErrDeadline)
		s.unregisterIf(rk, ctx)
	})
}

// watchLocked arms the deadline timer on first use.
func (c *Claim) watchLocked() {
	if !c.watching {
		c.watching = true
		c.armDeadlineLocked()
	}
}

// acquire runs the decision table until the claim is won, the key is found
// done, or a definite refusal. It returns the done record for a replay, and
// whether a claim write of its own had an unknown outcome (it may have
// landed) when the claim was not won.
func (s *Store) acquire(ctx context.Context, c *Claim, sess *lease.Session, cfg *claimConfig) (done *Record, uncertain bool, err error) {
	done, err = s.decide(ctx, c, sess, cfg, &uncertain)
	return done, uncertain, err
}

// decide is acquire's loop; it sets *uncertain when a claim write's outcome
// is unknown.
func (s *Store) decide(ctx context.Context, c *Claim, sess *lease.Session, cfg *claimConfig, uncertain *bool) (*Record, error) {
	ekey := s.ks.record(c.key)
	// A claim under a session is written only while the session's owner key
	// exists, so a claim can never be made under a session that has ended.
	checkOwner := sess.Owner()
	if c.owner == deadlineOwner {
		checkOwner = ""
	}
	var cur *Record   // nil: not read yet, or absent
	var seenRev int64 // the revision at which cur was read
	known := false    // whether cur reflects a read
	tries := 0
	for round := 0; round < 8; {
		now := s.now()
		var cmps []cond
		var taken *Record // the record being replaced, for a takeover
		if !known || cur == nil {
			cmps = []cond{created(ekey, pb.Compare_EQUAL, 0)}
		} else {
			switch {
			case cur.expired(now):
				// Retention has passed: the key names a new operation. Replace
				// the old record; the new token is still greater.
			case cur.Fingerprint != c.fp:
				return nil, &MismatchError{Key: c.key}
			case cur.State == Done:
				return cur, nil
			case cur.Owner == "", // abandoned for the next claimant
				cur.pastDeadline(now), // even our own: its holder may be gone
				// Our orphan: nobody here runs it, and without a deadline it
				// would hold the key until this process dies. A claim with a
				// deadline may be renewed through another process (Attach),
				// so only its deadline makes it stale.
				cur.Owner == c.owner && cur.Deadline.IsZero() && !s.runningHere(c.key, cur.Attempt):
				taken = cur
			case cur.Owner == c.owner && cur.Attempt == c.attempt:
				// Our own claim, written by an earlier try whose reply was lost.
				c.won(cur, nil)
				return nil, nil
			default:
				alive, ownerRev, err := s.ownerAlive(ctx, cur.Owner)
				if err != nil {
					return nil, unavailable("claim", c.key, err)
				}
				if alive {
					if !cfg.wait {
						return nil, s.conflict(c.key, cur, now)
					}
					next, rev, err := s.awaitChange(ctx, c.key, cur, seenRev, ownerRev)
					if err != nil {
						return nil, err
					}
					cur, seenRev = next, rev
					continue
				}
				taken = cur
				cmps = append(cmps, created(s.ks.owner(cur.Owner), pb.Compare_EQUAL, 0))
			}
			cmps = append(cmps, modified(ekey, cur.Revision))
		}
		round++

		rec := &Record{
			State:       InFlight,
			Fingerprint: c.fp,
			Owner:       c.owner,
			Attempt:     c.attempt,
			Created:     now,
			Expires:     now.Add(s.retention),
		}
		if cfg.deadline > 0 {
			rec.Deadline = toMillis(now.Add(cfg.deadline))
		}
		if taken != nil {
			rec.Created = taken.Created
			rec.Checkpoint = taken.Checkpoint
			rec.Takeovers = taken.Takeovers + 1
		}
		res, err := s.writeRecord(ctx, c.key, checkOwner, cmps, rec, 0)
		if errors.Is(err, rpctypes.ErrNoSpace) {
			// etcd is over its quota and refuses any Txn with a Put, even
			// when its Else would run. A done key can still be replayed.
			return s.readOnly(ctx, c, err)
		}
		if err != nil {
			if mayHaveLanded(err) {
				*uncertain = true
			}
			if errors.Is(err, ErrCorrupt) || !retryable(ctx, err) || tries >= maxTries {
				return nil, wrapEtcd("claim", c.key, err)
			}
			// Unknown outcome: read what is there and decide again. Our own
			// claim is recognised by its owner and attempt id.
			tries++
			if !backoff(ctx, tries) {
				return nil, wrapEtcd("claim", c.key, err)
			}
			known = false
			continue
		}
		if res.ok {
			rec.Revision, rec.Token = res.rev, fencing.Token(res.rev)
			c.won(rec, taken)
			s.observe(taken != nil)
			return nil, nil
		}
		if res.ownerGone {
			return nil, fmt.Errorf("claim %s: %w: %w", c.key, ErrUnavailable, ErrSessionLost)
		}
		cur, seenRev, known = res.cur, res.rev, true
		if cur != nil && round == 1 {
			s.observe(true)
		}
	}
	return nil, s.conflict(c.key, cur, s.now())
}

// findDone looks for key's done record without a write: in the cache, or
// with a serializable read when recent claims keep finding records. Done
// records never change until deleted, so these can only be as old as the
// cache's watch or the member's apply lag; anything else is decided by the
// linearizable claim Txn. It returns the record to replay, a mismatch, or
// nothing (and no error: the claim Txn decides then).
func (s *Store) findDone(ctx context.Context, k Key, fp Fingerprint) (*Record, error) {
	var rec *Record
	if s.cache != nil {
		if r := s.cache.get(s.ks.record(k), k); r != nil && !r.expired(s.now()) {
			rec = r
		}
	}
	if rec == nil && s.readFirst() {
		if r, err := s.readDone(ctx, k); err == nil && r != nil {
			s.observe(true)
			rec = r
		}
	}
	switch {
	case rec == nil:
		return nil, nil
	case rec.Fingerprint != fp:
		return nil, &MismatchError{Key: k}
	}
	return rec, nil
}

// readDone returns key's record when a serializable read finds it done and
// retained, and nil otherwise.
func (s *Store) readDone(ctx context.Context, k Key) (*Record, error) {
	rctx, cancel := s.try(ctx)
	defer cancel()
	resp, err := s.client.Get(rctx, s.ks.record(k), clientv3.WithSerializable())
	if err != nil || len(resp.Kvs) == 0 {
		return nil, err
	}
	rec, err := decode(k, resp.Kvs[0])
	if err != nil || rec.State != Done || rec.expired(s.now()) {
		return nil, err
	}
	return rec, nil
}

// readOnly answers a claim from a read when etcd refuses writes: the saved
// outcome of a done key, a mismatch, or the write's error.
func (s *Store) readOnly(ctx context.Context, c *Claim, werr error) (*Record, error) {
	cur, _, err := s.get(ctx, c.key)
	switch {
	case err != nil:
		return nil, err
	case cur == nil || cur.expired(s.now()):
	case cur.Fingerprint != c.fp:
		return nil, &MismatchError{Key: c.key}
	case cur.State == Done:
		return cur, nil
	}
	return nil, wrapEtcd("claim", c.key, werr)
}

// writeRecord puts rec on the current retention lease under cmps (and, when
// owner is set, only while owner's key exists), with token (0: the revision
// of this write), refreshing the lease once if etcd no longer knows it.
func (s *Store) writeRecord(ctx context.Context, k Key, owner string, cmps []cond, rec *Record, token fencing.Token, extra ...clientv3.Op) (casResult, error) {
	val := encode(rec, token)
	if s.format == recordV1 {
		val = encodeV1(rec, token)
	}
	for refreshed := false; ; refreshed = true {
		id, err := s.buckets.For(ctx, s.now())
		if err != nil {
			return casResult{}, err
		}
		res, err := s.cas(ctx, k, owner, cmps, write{key: s.ks.record(k), value: val, lease: id}, extra)
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && !refreshed {
			s.buckets.Invalidate(id)
			continue
		}
		return res, err
	}
}

// won records a successful claim: rec is the record as this claim wrote it.
func (c *Claim) won(rec *Record, previous *Record) {
	c.rev = rec.Revision
	c.token = rec.Token
	c.created = rec.Created
	c.deadline = rec.Deadline
	c.takeovers = rec.Takeovers
	c.previous = previous
	c.checkpoint = rec.Checkpoint
}

// ownerAlive reports whether owner's liveness key exists, with a
// linearizable read, and the revision of that read. A claim made
// WithoutSession has no owner key and counts as alive.
func (s *Store) ownerAlive(ctx context.Context, owner string) (bool, int64, error) {
	if owner == deadlineOwner {
		return true, 0, nil // only its deadline makes it stale
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var resp *clientv3.GetResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = s.client.Get(ctx, s.ks.owner(owner), clientv3.WithCountOnly())
		return err
	})
	if err != nil {
		return false, 0, err
	}
	return resp.Count > 0, resp.Header.Revision, nil
}

func (s *Store) conflict(k Key, cur *Record, now time.Time) error {
	e := &ConflictError{Key: k, RetryAfter: s.retryAfter}
	if cur != nil {
		e.Token = cur.Token
		if !cur.Deadline.IsZero() {
			if d := cur.Deadline.Sub(now); d > 0 && d < e.RetryAfter {
				e.RetryAfter = d
			}
		}
	}
	return e
}

// wrapEtcd adds context to an error from etcd, marking it ErrUnavailable
// unless it is the store's own.
func wrapEtcd(op string, k Key, err error) error {
	if errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("%s %s: %w", op, k, err)
	}
	if errors.Is(err, rpctypes.ErrRequestTooLarge) || errors.Is(err, rpctypes.ErrTooManyOps) {
		return fmt.Errorf("%s %s: %w: %w", op, k, ErrTooLarge, err)
	}
	return unavailable(op, k, err)
}
