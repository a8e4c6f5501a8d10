package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/kernel"
)

// attempted is what a claim's writes left behind when the claim was not
// won: whether one had an unknown outcome (it may have landed, or land
// still), and the highest revision the claim saw etcd at: every compare of
// its writes was of a state at or before it.
type attempted struct {
	uncertain bool
	seen      int64
}

// acquire runs the kernel's claim machine until the claim is won, the key
// is found done, or a definite refusal. It returns the done record for a
// replay, and what the claim's writes left behind.
func (s *Store) acquire(ctx context.Context, c *Claim, cfg *claimConfig) (*Record, attempted, error) {
	var left attempted
	a, err := s.runClaim(ctx, c, cfg, &left)
	if err != nil {
		return nil, left, err
	}
	done, err := s.claimed(c, a)
	return done, left, err
}

// runClaim executes the kernel's claim machine for c, and returns its
// answer, or the error of a read or a wait it asked for. It records in
// left what the claim's writes left behind.
func (s *Store) runClaim(ctx context.Context, c *Claim, cfg *claimConfig, left *attempted) (kernel.Answer, error) {
	m := kernel.NewClaim(s.kcfg(), kernel.ClaimRequest{
		Key: s.ks.record(c.key), Fingerprint: c.fp, Owner: c.owner, Attempt: c.attempt, Deadline: cfg.deadline,
		Wait: cfg.wait, Existing: cfg.existing, OverMoved: cfg.overMoved, Fence: cfg.fence, SetRev: cfg.setRev,
	})
	defer func() { left.uncertain, left.seen = m.Uncertain() }()
	for {
		a := m.Next(s.view(c.key))
		if a.Wait > 0 && clock.Sleep(s.clock, ctx, a.Wait) != nil {
			return kernel.Answer{Verdict: kernel.Error, Err: a.Err}, nil
		}
		switch a.Kind {
		case kernel.ActDone:
			return m.Answer(), nil
		case kernel.ActRead:
			rec, rev, err := s.get(ctx, c.key)
			if err != nil {
				return kernel.Answer{}, err
			}
			m.Read(kernelRecord(rec), rev)
		case kernel.ActOwner:
			m.Owner(s.ownerAlive(ctx, a.Owner))
		case kernel.ActAwait:
			next, rev, err := s.awaitChange(ctx, c.key, storeRecord(c.key, a.Rec), a.Rev, a.OwnerRev)
			if err != nil {
				return kernel.Answer{}, err
			}
			m.Awaited(kernelRecord(next), rev)
		case kernel.ActSend:
			s.learn(m.Sent(s.exec(ctx, c.key, a.Txn, nil)))
		}
	}
}

// claimed gives a claim the kernel's answer: the claim won, a done
// record to replay, or an error.
func (s *Store) claimed(c *Claim, a kernel.Answer) (*Record, error) {
	rec := storeRecord(c.key, a.Record)
	switch a.Verdict {
	case kernel.Won:
		c.won(rec, storeRecord(c.key, a.Previous))
		if a.Wrote {
			s.observe(a.Previous != nil)
		}
		return nil, nil
	case kernel.Replay:
		return rec, nil
	case kernel.Mismatch:
		return nil, &MismatchError{Key: c.key}
	case kernel.IsMoved:
		return nil, &movedError{Key: c.key, To: rec.MovedTo, Epoch: rec.Epoch}
	case kernel.NotFound:
		return nil, fmt.Errorf("claim %s: %w: no live record in this store (WithoutCreate)", c.key, ErrNotFound)
	case kernel.SessionGone:
		return nil, fmt.Errorf("claim %s: %w: %w", c.key, ErrUnavailable, ErrSessionLost)
	case kernel.SetChanged:
		return nil, fmt.Errorf("claim %s: %w", c.key, errSetChanged)
	case kernel.Error:
		return nil, wrapEtcd("claim", c.key, a.Err)
	}
	return nil, s.conflict(c.key, rec, s.now())
}

// findDone looks for key's done record without a write: in the cache, or
// with a linearizable read when recent claims keep finding records. The
// read is linearizable, not serializable, because done records are
// deleted (evict, a job's DedupWindow, a drain): a member that lags, or is
// cut off but has not yet noticed, would replay a record deleted before
// the request began. The cache may be as old as its staleness bound
// (WithCacheStaleness), and is opt-in for that reason; anything else is
// decided by the linearizable claim Txn. It returns the record to replay, a mismatch, or
// nothing (and no error: the claim Txn decides then), as the kernel judges
// it (ReadDone).
func (s *Store) findDone(ctx context.Context, k Key, fp Fingerprint) (*Record, error) {
	var rec *Record
	if s.cache != nil {
		if r, ok := s.cache.Get(s.ks.record(k)); ok && kernel.ReadDone(kernelRecord(r), fp, s.now()) != 0 {
			rec = r
		}
	}
	if rec == nil && s.readFirst() {
		if r, err := s.readDone(ctx, k, fp); err == nil && r != nil {
			s.observe(true)
			rec = r
		}
	}
	switch {
	case rec == nil:
		return nil, nil
	case kernel.ReadDone(kernelRecord(rec), fp, s.now()) == kernel.Mismatch:
		return nil, &MismatchError{Key: k}
	}
	return rec, nil
}

// readDone returns key's record when a linearizable read finds one the
// kernel would replay or refuse (ReadDone), and nil otherwise. It is a
// read-index round at the leader, never a raft write.
func (s *Store) readDone(ctx context.Context, k Key, fp Fingerprint) (*Record, error) {
	rctx, cancel := s.try(ctx)
	defer cancel()
	resp, err := s.client.Get(rctx, s.ks.record(k))
	if err != nil || len(resp.Kvs) == 0 {
		return nil, err
	}
	rec, err := s.decode(ctx, k, resp.Kvs[0])
	if err != nil || kernel.ReadDone(kernelRecord(rec), fp, s.now()) == 0 {
		return nil, err
	}
	return rec, nil
}

// won records a successful claim: rec is the record as this claim wrote it.
func (c *Claim) won(rec *Record, previous *Record) {
	c.rev = rec.Revision
	c.token = rec.Token
	c.created = rec.Created
	c.deadline = rec.Deadline
	c.expires = rec.Expires
	c.takeovers = rec.Takeovers
	c.cutShort = rec.CutShort
	c.kind = rec.Kind
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
