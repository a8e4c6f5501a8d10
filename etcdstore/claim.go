package etcdstore

import (
	"context"
	"crypto/rand"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/fencing"
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
	expires   time.Time // its record's expiry: the claim ends then too (see Err)
	takeovers int       // how often the key was taken over before this claim
	cutShort  bool      // an earlier claim of the operation was cut short (Record.CutShort)
	gen       int64     // the restores the store had seen when the claim was made
	kind      Kind
	previous  *Record // the stale record this claim replaced, or nil
	fenced    bool    // won by writing the record abandoned (reap)

	ctx  context.Context // ends when the claim is lost or ended
	life *lifetime

	// pending is set while the claim's final write is retried in the
	// background (finishLater): its work is over and its outcome exists
	// only in this process, which keeps the claim registered, whatever
	// happens to its session or deadline, until the write is settled.
	pending atomic.Bool
	// inRun is set for a claim whose work Run calls: until that work has
	// returned and the claim has ended, a lost session cancels it but does
	// not unregister it, so a retry here is not mistaken for a takeover of
	// a dead owner while this process may still be acting, or holds the
	// outcome it is about to save.
	inRun bool

	mu         sync.Mutex
	timer      func() bool // stops the timer that cancels ctx with ErrDeadline at the deadline
	watching   bool        // the deadline timer is armed: always for claims made here, on first use for attached ones
	rev        int64       // ModRevision of this claim's last write: the fence
	checkpoint []byte
	ended      bool
}

// lifetime is a claim's context and those derived from it by Context: all
// of them are cancelled, with the claim's cause, in the call that cancels
// the claim (not later, in another goroutine, as context.AfterFunc would),
// so that whoever cancels a claim knows its work has been told.
type lifetime struct {
	ctx    context.Context
	cancel context.CancelCauseFunc

	mu   sync.Mutex
	next int
	kids map[int]context.CancelCauseFunc
}

func newLifetime() *lifetime {
	l := &lifetime{kids: make(map[int]context.CancelCauseFunc)}
	l.ctx, l.cancel = context.WithCancelCause(context.Background())
	return l
}

// end cancels the claim's context and every context derived from it.
func (l *lifetime) end(cause error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cancel(cause)
	cause = context.Cause(l.ctx) // the first cause wins
	for id, k := range l.kids {
		k(cause)
		delete(l.kids, id)
	}
}

// derive returns a context of parent that also ends with the claim.
func (l *lifetime) derive(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	l.mu.Lock()
	if l.ctx.Err() != nil {
		l.mu.Unlock()
		cancel(context.Cause(l.ctx))
		return ctx, func() { cancel(context.Canceled) }
	}
	id := l.next
	l.next++
	l.kids[id] = cancel
	l.mu.Unlock()
	return ctx, func() {
		l.mu.Lock()
		delete(l.kids, id)
		l.mu.Unlock()
		cancel(context.Canceled)
	}
}

// newClaim returns a claim of key that is not won yet.
func (s *Store) newClaim(key Key, fp Fingerprint, attempt, owner string) *Claim {
	c := &Claim{s: s, key: key, fp: fp, attempt: attempt, owner: owner, life: newLifetime(), gen: s.restores.Load()}
	c.ctx = c.life.ctx
	return c
}

// cancel ends the claim's context (and its derived ones) with cause.
func (c *Claim) cancel(cause error) { c.life.end(cause) }

// Key returns the claimed key.
func (c *Claim) Key() Key { return c.key }

// storeOf returns the store the claim was made in: on a shard set
// (package shard), the shard that holds the key, where the values that go
// with it (package jobs' events) are kept too.
func (c *Claim) storeOf() *Store { return c.s }

// Token returns the claim's fencing token: the etcd revision of the claim.
// Send it with every downstream write (fencing.SetHeader) so a stale worker
// is refused there too.
func (c *Claim) Token() fencing.Token { return c.token }

// Created returns when the claimed record was created: when its operation
// began. A key whose record passed its retention names a new operation,
// with a new Created.
func (c *Claim) Created() time.Time { return c.created }

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
// past its deadline, or abandoned) at least once: resume from
// LastCheckpoint, and fence or deduplicate downstream.
func (c *Claim) TookOver() bool { return c.takeovers > 0 }

// Takeovers returns how many times the key was taken over, this claim's
// own takeover included (the record's count; jobs counts attempts by it).
func (c *Claim) Takeovers() int { return c.takeovers }

// CutShort reports whether an earlier claim was cut short (Record.CutShort).
func (c *Claim) CutShort() bool { return c.cutShort }

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

// Err returns why the claim is no longer held: ErrSessionLost, ErrDeadline
// (its deadline passed, or its record expired: a claim is held at most one
// retention after its last write, or after its deadline if that is later),
// ErrClosed, ErrFenced or ErrClaimEnded; nil while it is.
func (c *Claim) Err() error {
	if c.ctx.Err() != nil {
		return context.Cause(c.ctx)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if end := c.heldUntilLocked(); !end.IsZero() && !c.s.now().Before(end) {
		return ErrDeadline
	}
	return nil
}

// heldUntilLocked is when the claim stops being held whatever its
// session: its deadline, or its record's expiry, whichever comes first.
// Others treat an expired record as absent, so a claim that has written
// nothing for a whole retention (no Checkpoint, no Renew) ends with its
// record, with ErrDeadline.
func (c *Claim) heldUntilLocked() time.Time {
	end := c.deadline
	if !c.expires.IsZero() && (end.IsZero() || c.expires.Before(end)) {
		end = c.expires
	}
	return end
}

// Context returns a context derived from parent that is also cancelled when
// the claim is lost or ends, with the claim's cause, and that carries the
// fencing token (fencing.FromContext). Call the cancel function when done.
func (c *Claim) Context(parent context.Context) (context.Context, context.CancelFunc) {
	c.mu.Lock()
	c.watchLocked()
	c.mu.Unlock()
	return c.life.derive(fencing.NewContext(parent, c.token))
}

// BeforeEnd returns a context derived from parent that ends a fifth of
// the time left before the claim stops being held whatever its session
// (its deadline, or its record's expiry, a retention after its last write,
// if that is sooner), measured on the store's clock when BeforeEnd is
// called: a later Checkpoint or Renew does not move it. Work that must not
// run once another owner may take the key over runs under it (a forwarded
// request, a gRPC handler), with that fifth left to save its answer. It
// does not end when the claim's session is lost (Context does).
func (c *Claim) BeforeEnd(parent context.Context) (context.Context, context.CancelFunc) {
	c.mu.Lock()
	end := c.heldUntilLocked()
	c.mu.Unlock()
	if end.IsZero() {
		return parent, func() {}
	}
	left := max(end.Sub(c.s.now()), 0)
	return c.s.clock.WithTimeout(parent, left-left/5)
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

// claim is Claim with its options applied, in a span when tracing.
func (s *Store) claim(ctx context.Context, key Key, fp Fingerprint, cfg *claimConfig) (*Claim, *Record, error) {
	ctx, sp := s.startSpan(ctx, "idem.claim", key)
	c, done, err := s.claimUntraced(ctx, key, fp, cfg)
	s.endClaimSpan(sp, key, c, done, err)
	return c, done, err
}

func (s *Store) claimUntraced(ctx context.Context, key Key, fp Fingerprint, cfg *claimConfig) (*Claim, *Record, error) {
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
		// The attempt id is the claim's capability: with the key and the
		// token (which anyone who can read the key learns) it attaches to
		// the claim (Attach), to complete or abandon it. 130 random bits:
		// no one guesses it, and it says nothing of other claims.
		cfg.attempt = rand.Text()
	}
	owner := sess.Owner()
	if cfg.noSession {
		if cfg.deadline <= 0 {
			return nil, nil, fmt.Errorf("claim %s: %w: WithoutSession needs WithDeadline", key, ErrInvalidArgument)
		}
		owner = deadlineOwner
	}
	c := s.newClaim(key, fp, cfg.attempt, owner)
	c.inRun = cfg.run
	if err := s.register(c); err != nil {
		c.cancel(ErrClaimEnded)
		return nil, nil, fmt.Errorf("claim %s: %w", key, err)
	}
	// The request timeout bounds the claim, unless it waits for a held
	// key: then the caller's context bounds the wait (issue 38: the
	// worker API's wait_ms gave up at the request timeout), and each etcd
	// request in it is bounded on its own.
	cancel := context.CancelFunc(func() {})
	if !cfg.wait {
		ctx, cancel = s.bound(ctx)
	}
	defer cancel()
	done, left, err := s.acquire(ctx, c, cfg)
	if err != nil || done != nil {
		s.unregister(c)
		c.cancel(ErrClaimEnded)
		if left.uncertain {
			// A claim write of ours may have landed although we could not
			// learn it, or may still land: nobody here will run it, and
			// other processes would see a live owner until this one dies.
			s.reap(lostClaim{key: key, fp: fp, owner: c.owner, attempt: c.attempt, seen: left.seen, overMoved: cfg.overMoved, setRev: cfg.setRev})
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
	end := c.heldUntilLocked()
	if end.IsZero() {
		return
	}
	// The timer holds the context's cancel function and the store, not the
	// claim: an attached claim dropped by its caller keeps no checkpoint
	// alive until its deadline.
	if !c.watching {
		return // armed on first use of Done or Context
	}
	life, s, rk := c.life, c.s, runKey{c.key, c.attempt}
	c.timer = s.clock.AfterFunc(end.Sub(s.now()), func() {
		// No longer held here first, then Done: a caller that sees Done
		// and claims again with the same attempt id must not find the
		// ended claim still registered (a conflict with itself).
		s.unregisterIfCurrent(rk, life)
		life.end(ErrDeadline)
	})
}

// watchLocked arms the deadline timer on first use.
func (c *Claim) watchLocked() {
	if !c.watching {
		c.watching = true
		c.armDeadlineLocked()
	}
}
