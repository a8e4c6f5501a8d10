package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"

	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/lease"
)

// attempted is what a claim's writes left behind when the claim was not
// won: whether one had an unknown outcome (it may have landed, or land
// still), and the highest revision the claim saw etcd at: every compare of
// its writes was of a state at or before it.
type attempted struct {
	uncertain bool
	seen      int64
}

// acquire runs the decision table until the claim is won, the key is found
// done, or a definite refusal. It returns the done record for a replay, and
// what the claim's writes left behind.
func (s *Store) acquire(ctx context.Context, c *Claim, sess *lease.Session, cfg *claimConfig) (done *Record, left attempted, err error) {
	done, err = s.decide(ctx, c, sess, cfg, &left)
	return done, left, err
}

// decide is acquire's loop; it records in left what its writes left
// behind.
func (s *Store) decide(ctx context.Context, c *Claim, sess *lease.Session, cfg *claimConfig, left *attempted) (*Record, error) {
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
		if cfg.existing && !known {
			rec, rev, err := s.get(ctx, c.key)
			if err != nil {
				return nil, err
			}
			cur, seenRev, known = rec, rev, true
		}
		if cfg.existing && (cur == nil || cur.expired(now) || cur.State == Moved) {
			return nil, fmt.Errorf("claim %s: %w: no live record in this store (WithoutCreate)", c.key, ErrNotFound)
		}
		var cmps []cond
		var taken *Record // the record being replaced, for a takeover
		if !known || cur == nil {
			cmps = []cond{created(ekey, pb.Compare_EQUAL, 0)}
		} else {
			switch {
			case cur.expired(now), cfg.overMoved && cur.State == Moved:
				// Retention has passed (or the Moved record here is stale:
				// ReplaceMoved): the key names a new operation. Replace
				// the old record; the new token is still greater.
			case cur.State == Moved:
				return nil, &MovedError{Key: c.key, To: cur.MovedTo, Epoch: cur.Epoch}
			case cur.Fingerprint != c.fp:
				return nil, &MismatchError{Key: c.key}
			case cur.State == Done:
				return cur, nil
			case cur.Owner != "" && !SameAttempt(cur.Attempt, c.attempt) && s.runningHere(c.key, cur.Attempt):
				// Held by this very process: running, or finished with its
				// final write still pending (its outcome is only here). Its
				// owner is alive by definition, whatever its session or
				// deadline: this process never runs the key again meanwhile.
				if !cfg.wait {
					return nil, s.conflict(c.key, cur, now)
				}
				next, rev, err := s.awaitChange(ctx, c.key, cur, seenRev, 0)
				if err != nil {
					return nil, err
				}
				cur, seenRev = next, rev
				continue
			case cur.pastDeadline(now): // even our own: its holder may be gone
				taken = cur
			case cur.Owner != "" && cur.Owner == c.owner && SameAttempt(cur.Attempt, c.attempt):
				// Our own claim, written by an earlier try whose reply was lost.
				c.won(cur, nil)
				return nil, nil
			case cur.Owner == "", // abandoned for the next claimant
				// Our orphan: nobody here runs it, and without a deadline it
				// would hold the key until this process dies. A claim with a
				// deadline may be renewed through another process (Attach),
				// so only its deadline makes it stale.
				cur.Owner == c.owner && cur.Deadline.IsZero():
				taken = cur
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
		if cfg.fence {
			// Written abandoned (see reap); on a key with no record, a
			// fence that leaves it free, as if absent.
			rec.Owner = ""
			rec.Fence = taken == nil
		}
		if cfg.deadline > 0 {
			rec.Deadline = toMillis(now.Add(cfg.deadline))
		}
		rec.Expires = s.inFlightExpiry(now, rec.Deadline)
		if taken != nil && taken.State == InFlight {
			rec.Created = taken.Created
			rec.Checkpoint = taken.Checkpoint
			rec.Takeovers = taken.Takeovers + 1
		}
		epoch := s.epoch.Load()
		var setRev int64
		if s.epochs {
			rec.Epoch = epoch
			var guards []cond
			guards, setRev = s.guards(epoch, cfg.setRev)
			cmps = append(cmps, guards...)
		}
		res, err := s.writeRecord(ctx, c.key, checkOwner, cmps, rec, 0)
		if errors.Is(err, rpctypes.ErrNoSpace) {
			// etcd is over its quota and refuses any Txn with a Put, even
			// when its Else would run. A done key can still be replayed.
			return s.readOnly(ctx, c, err)
		}
		if err != nil {
			if mayHaveLanded(err) {
				left.uncertain = true
			}
			if left.uncertain && errors.Is(err, ErrNotSent) {
				// This try never left, but an earlier one may have landed:
				// the claim as a whole is not "not sent".
				err = fmt.Errorf("an earlier try may have landed; the last was not sent (%v)", err)
			}
			if errors.Is(err, ErrCorrupt) || !retryable(ctx, err) || tries >= maxTries {
				return nil, wrapEtcd("claim", c.key, err)
			}
			// Unknown outcome: read what is there and decide again. Our own
			// claim is recognised by its owner and attempt id.
			tries++
			if !s.backoff(ctx, tries) {
				return nil, wrapEtcd("claim", c.key, err)
			}
			known = false
			continue
		}
		if res.ok {
			rec.Revision, rec.Token = res.rev, tokenOf(epoch, res.rev)
			c.won(rec, taken)
			s.observe(taken != nil)
			return nil, nil
		}
		if res.ownerGone {
			return nil, fmt.Errorf("claim %s: %w: %w", c.key, ErrUnavailable, ErrSessionLost)
		}
		if s.epochs && s.setChanged(res, setRev) {
			return nil, fmt.Errorf("claim %s: %w", c.key, ErrSetChanged)
		}
		if s.epochs && res.epoch != epoch {
			s.epoch.Store(res.epoch) // the shard's epoch was raised: claim under it
		}
		cur, seenRev, known = res.cur, res.rev, true
		left.seen = max(left.seen, res.rev)
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
		if r, ok := s.cache.Get(s.ks.record(k)); ok && !r.expired(s.now()) {
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
	rec, err := s.decode(ctx, k, resp.Kvs[0])
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
	case cur.Owner != "" && (cur.Deadline.IsZero() || s.now().Before(cur.Deadline)):
		// In flight: if its owner lives, it is a conflict as always (the
		// owner may still save its outcome: a Put is refused, but the
		// answer to this request does not depend on it). A stale one would
		// be taken over, which needs a write.
		if alive, _, err := s.ownerAlive(ctx, cur.Owner); err == nil && alive {
			return nil, s.conflict(c.key, cur, s.now())
		}
	}
	return nil, wrapEtcd("claim", c.key, werr)
}

// writeRecord puts rec on the current retention lease under cmps (and, when
// owner is set, only while owner's key exists), with token (0: the revision
// of this write), refreshing the lease once if etcd no longer knows it.
func (s *Store) writeRecord(ctx context.Context, k Key, owner string, cmps []cond, rec *Record, token fencing.Token, extra ...clientv3.Op) (casResult, error) {
	for refreshed := false; ; refreshed = true {
		id, err := s.buckets.Until(ctx, s.now(), rec.Expires)
		if err != nil {
			return casResult{}, err
		}
		val := s.encodeAs(ctx, s.format, rec, token, id)
		res, err := s.cas(ctx, k, owner, cmps, write{key: s.ks.record(k), value: val, lease: id}, extra)
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && !refreshed {
			s.buckets.Invalidate(id)
			s.dicts.Forget(id)
			continue
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && len(extra) > 0 {
			// Not found with a fresh bucket lease too: a lease of the
			// caller's ops. Nothing was applied.
			return res, fmt.Errorf("%w: a lease in the extra ops does not exist (%v)", ErrInvalidArgument, err)
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
	c.expires = rec.Expires
	c.takeovers = rec.Takeovers
	c.previous = previous
	c.checkpoint = rec.Checkpoint
	c.fenced = rec.State == InFlight && rec.Owner == ""
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
	if errors.Is(err, ErrCorrupt) || errors.Is(err, ErrInvalidArgument) {
		return fmt.Errorf("%s %s: %w", op, k, err)
	}
	if errors.Is(err, rpctypes.ErrRequestTooLarge) || errors.Is(err, rpctypes.ErrTooManyOps) {
		return fmt.Errorf("%s %s: %w: %w", op, k, ErrTooLarge, err)
	}
	if errors.Is(err, rpctypes.ErrNoSpace) {
		return fmt.Errorf("%s %s: %w: %w: %w", op, k, ErrStoreFull, ErrUnavailable, err)
	}
	if etcdCode(err) == codes.InvalidArgument {
		// etcd refused the request for what it holds (a duplicate or empty
		// key in the caller's ops): nothing was applied, and a retry would
		// be refused again.
		return fmt.Errorf("%s %s: %w: %w", op, k, ErrInvalidArgument, err)
	}
	return unavailable(op, k, err)
}
