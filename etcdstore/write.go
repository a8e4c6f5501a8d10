package etcdstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"
)

// MaxExtraOps is the most extra ops Complete and Checkpoint take: etcd
// allows 128 ops in a Txn branch, and the record's own Put is one.
const MaxExtraOps = 127

// Complete saves out as the key's outcome, to be replayed to every retry, and
// ends the claim. ops, when given, commit in the same etcd Txn: an effect that
// lives in etcd is then applied exactly once, atomically with the outcome.
// They must not touch the store's prefix and may not be nested Txns. A done
// record keeps the outcome only: the last checkpoint is dropped.
//
// The write is fenced: it happens only if the record is still the one this
// claim last wrote. Otherwise nothing is written, the claim ends, and the
// error wraps ErrFenced. An error wrapping ErrUnavailable leaves the outcome
// unknown and the claim held: call Complete again with the same outcome (an
// earlier write that landed is recognised) or Abandon.
func (c *Claim) Complete(ctx context.Context, out Outcome, ops ...clientv3.Op) error {
	if err := c.s.checkOps(ops); err != nil {
		return fmt.Errorf("complete %s: %w", c.key, err)
	}
	if size := out.size(); size > c.s.maxRecord {
		return fmt.Errorf("complete %s: %w: outcome is %d bytes, limit %d", c.key, ErrTooLarge, size, c.s.maxRecord)
	}
	return c.write(ctx, "complete", true, ops, func(r *Record) *Record {
		r.State, r.Outcome, r.Checkpoint = Done, &out, nil
		return r
	})
}

// Checkpoint saves data as the claim's recovery point (Brandur Leach's
// "recovery points"): if this worker dies, the owner that takes over finds it
// in LastCheckpoint and resumes from there. The fencing token does not
// change; IsOwner's comparison does. Fenced like Complete; on ErrFenced the
// claim ends. After an error wrapping ErrUnavailable the checkpoint may or
// may not have been saved; the claim's next write finds out and keeps
// whichever is newer, so a checkpoint never moves backwards.
//
// ops, when given, commit in the same etcd Txn, as Complete's do: the
// effect of a step that lives in etcd is applied exactly once, atomically
// with the recovery point that says the step is finished. After an error
// wrapping ErrUnavailable, call Checkpoint again with the same data and ops:
// a write that landed is recognised (its ops landed with it) and not
// repeated.
func (c *Claim) Checkpoint(ctx context.Context, data []byte, ops ...clientv3.Op) error {
	if err := c.s.checkOps(ops); err != nil {
		return fmt.Errorf("checkpoint %s: %w", c.key, err)
	}
	if len(data) > c.s.maxRecord {
		return fmt.Errorf("checkpoint %s: %w: %d bytes, limit %d", c.key, ErrTooLarge, len(data), c.s.maxRecord)
	}
	data = bytes.Clone(data)
	return c.write(ctx, "checkpoint", false, ops, func(r *Record) *Record {
		r.Checkpoint = data
		return r
	})
}

// Release deletes the claim so that a retry runs the work again, and ends the
// claim. Use it when the work failed before any effect, or when the work is
// idempotent downstream; otherwise releasing brings back the double effect
// the key exists to prevent. If the record is no longer this claim's (taken
// over, evicted), Release leaves it alone and returns an error wrapping
// ErrFenced.
//
// A claim that took the key over (TookOver) is abandoned instead of
// released: an earlier owner may have acted, and deleting the record would
// forget that (and its checkpoint), so that the next claim would start the
// work afresh. Abandoned, the key is taken over and resumed.
func (c *Claim) Release(ctx context.Context) error {
	if c.TookOver() {
		return c.Abandon(ctx)
	}
	return c.write(ctx, "release", true, nil, nil)
}

// Abandon gives the claim up without deleting it: the record stays in flight
// with its fingerprint and last checkpoint but no owner, and the next
// request with the key takes it over at once and resumes from the
// checkpoint, with a greater fencing token. Fenced like Complete.
func (c *Claim) Abandon(ctx context.Context) error {
	return c.write(ctx, "abandon", true, nil, func(r *Record) *Record {
		r.Owner = ""
		r.Deadline = time.Time{}
		return r
	})
}

// write performs one fenced write: If(ModRevision(record) == c.rev). next
// edits a copy of the claim's record (nil next: delete the record). final
// writes end the claim. The write is retried, within ctx bounded by the
// request timeout, while its outcome is unknown.
//
// A retry, or any write after one whose outcome was unknown, may find a
// record with this claim's token and attempt id that it did not expect:
// only this claim writes those, so an earlier write of its own landed. The
// claim then adopts what that record says (its checkpoint, its deadline)
// before it decides, so it never rewrites the record from older memory:
// a checkpoint that landed with a lost reply is never moved backwards.
func (c *Claim) write(ctx context.Context, op string, final bool, extra []clientv3.Op, next func(*Record) *Record) (err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.s.tracer != nil {
		var sp trace.Span
		ctx, sp = c.s.startSpan(ctx, "idem."+op, c.key)
		defer func() { c.s.endWriteSpan(sp, c, err) }() // under c.mu
	}
	if c.ended {
		return fmt.Errorf("%s %s: %w", op, c.key, ErrClaimEnded)
	}
	s := c.s
	ctx, cancel := s.bound(ctx)
	defer cancel()
	ekey := s.ks.record(c.key)
	var landed landing
	for try := 0; ; try++ {
		cmps := []cond{modified(ekey, c.rev)}
		var want *Record // the record this write puts; nil: a delete
		var res casResult
		var err error
		if next != nil {
			want = next(c.recordLocked(s.now()))
		}
		if want != nil && want.State == InFlight && !c.expires.IsZero() && !s.now().Before(c.expires) {
			// The claim's record is past its expiry, by this store's clock:
			// others treat it as absent (a scheduler moves on from a job
			// that was forgotten), and the claim ended with it (its timer
			// may not have fired yet: it waits for c.mu, held here across
			// tries). An in-flight write now (a checkpoint, a renewal, an
			// abandon) would bring the forgotten record back; a Complete
			// or a Release still goes, as an outcome that happened is
			// better saved. (Past its deadline alone, the record is not
			// forgotten: a late write races a takeover by compare.)
			c.endLocked(ErrDeadline)
			if landed.maybe {
				return fmt.Errorf("%s %s: %w: an earlier try may have landed, and the claim's record is now past its expiry (%s): %w",
					op, c.key, ErrUnavailable, c.expires.Format(time.RFC3339Nano), ErrDeadline)
			}
			return fmt.Errorf("%s %s: %w: %w: its record is past its expiry (%s)", op, c.key, ErrClaimEnded, ErrDeadline, c.expires.Format(time.RFC3339Nano))
		}
		if next == nil {
			res, err = s.cas(ctx, c.key, "", cmps, write{key: ekey, delete: true}, extra)
		} else {
			res, err = s.writeRecord(ctx, c.key, "", cmps, want, c.token, extra...)
		}
		if err != nil && errors.Is(err, rpctypes.ErrNoSpace) && want != nil && (want.State == Done || want.Owner == "") {
			// etcd over its quota refuses every Txn with a Put, even one
			// whose compare fails: an earlier try of this Complete or
			// Abandon that landed (its reply lost) is known only by a read.
			if cur, _, gerr := s.get(ctx, c.key); gerr == nil && cur != nil && cur.Token == c.token {
				switch {
				case want.State == Done && cur.State == Done && sameOutcome(cur.Outcome, want.Outcome):
					c.rev = cur.Revision
					c.endLocked(ErrClaimEnded)
					return nil // our Complete landed
				case want.State == InFlight && cur.State == InFlight && cur.Owner == "" && SameAttempt(cur.Attempt, c.attempt):
					c.adoptLocked(cur, cur.Revision)
					c.endLocked(ErrClaimEnded)
					return nil // our Abandon landed
				}
			}
		}
		if err != nil {
			err = landed.failed(err)
			if errors.Is(err, ErrCorrupt) || !retryable(ctx, err) || try >= maxTries-1 || !s.backoff(ctx, try) {
				return wrapEtcd(op, c.key, err) // the claim stays held
			}
			continue
		}
		if res.ok {
			if want != nil {
				c.adoptLocked(want, res.rev)
			} else {
				c.rev = res.rev
			}
			if final {
				c.endLocked(ErrClaimEnded)
			}
			return nil
		}
		cur := res.cur
		// This claim's record: its token (a done record keeps no attempt id:
		// no other claim of the key can have its token) and attempt id.
		mine := cur != nil && cur.Token == c.token && (cur.State == Done || SameAttempt(cur.Attempt, c.attempt))
		switch {
		case mine && cur.State == InFlight && cur.Owner == "":
			c.adoptLocked(cur, cur.Revision)
			c.endLocked(ErrClaimEnded)
			if want != nil && want.State == InFlight && want.Owner == "" {
				return nil // our Abandon landed although its reply was lost
			}
			// Abandoned, by this claim through another handle (Attach).
			return fmt.Errorf("%s %s: %w: abandoned", op, c.key, ErrClaimEnded)
		case mine && cur.State == InFlight:
			// An earlier write of this claim landed although its reply was
			// lost (or another handle of this claim wrote): adopt it.
			c.adoptLocked(cur, cur.Revision)
			if want != nil && want.State == InFlight && sameInFlight(cur, want) {
				return nil // this very write landed
			}
			if try >= maxTries-1 {
				return fmt.Errorf("%s %s: %w: the claim's record kept changing under it", op, c.key, ErrUnavailable)
			}
			continue // write again, on top of what landed
		case mine && cur.State == Done:
			c.rev = cur.Revision
			c.endLocked(ErrClaimEnded)
			if want != nil && want.State == Done && sameOutcome(cur.Outcome, want.Outcome) {
				return nil // our Complete landed
			}
			// Completed through another handle, with another outcome.
			return fmt.Errorf("%s %s: %w: completed with another outcome", op, c.key, ErrClaimEnded)
		case cur == nil && next == nil:
			c.endLocked(ErrClaimEnded) // nothing of ours is left to release
			return nil
		}
		c.endLocked(ErrFenced)
		return fmt.Errorf("%s %s: %w", op, c.key, ErrFenced)
	}
}

// adoptLocked makes rec, written at rev by this claim, the claim's state:
// the fence, the checkpoint and the deadline (re-arming its timer).
func (c *Claim) adoptLocked(rec *Record, rev int64) {
	c.rev = rev
	c.checkpoint = rec.Checkpoint
	if !rec.Deadline.Equal(c.deadline) || !rec.Expires.Equal(c.expires) {
		c.deadline, c.expires = rec.Deadline, rec.Expires
		c.armDeadlineLocked()
	}
}

// sameInFlight reports whether two in-flight records of one claim say the
// same: a write that would put want has already landed as got.
func sameInFlight(got, want *Record) bool {
	return got.Owner == want.Owner && got.Deadline.Equal(want.Deadline) && bytes.Equal(got.Checkpoint, want.Checkpoint)
}

// recordLocked returns the claim's in-flight record as of now.
func (c *Claim) recordLocked(now time.Time) *Record {
	return &Record{
		State:       InFlight,
		Fingerprint: c.fp,
		Owner:       c.owner,
		Attempt:     c.attempt,
		Created:     c.created,
		Expires:     c.s.inFlightExpiry(now, c.deadline),
		Deadline:    c.deadline,
		Checkpoint:  c.checkpoint,
		Takeovers:   c.takeovers,
	}
}

// endLocked ends the claim: no more writes, its context is cancelled with
// cause, and the process no longer holds its key.
func (c *Claim) endLocked(cause error) {
	c.ended = true
	c.s.unregister(c)
	c.cancel(cause)
	if c.timer != nil {
		c.timer()
		c.timer = nil
	}
}

// giveUp ends the claim in this process without a write, when it cannot
// be ended in etcd for a reason a retry cannot mend.
func (c *Claim) giveUp(cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.ended {
		c.endLocked(cause)
	}
}

// checkOps validates the extra ops of Complete and Checkpoint.
func (s *Store) checkOps(ops []clientv3.Op) error {
	if len(ops) > MaxExtraOps {
		return fmt.Errorf("%w: %d extra ops, limit %d", ErrInvalidArgument, len(ops), MaxExtraOps)
	}
	lo, hi := s.ks.prefix, clientv3.GetPrefixRangeEnd(s.ks.prefix)
	written := map[string]int{}
	for i, op := range ops {
		if op.IsTxn() {
			return fmt.Errorf("%w: extra op %d is a nested txn", ErrInvalidArgument, i)
		}
		k, end := string(op.KeyBytes()), string(op.RangeBytes())
		if k == "" {
			return fmt.Errorf("%w: extra op %d has an empty key", ErrInvalidArgument, i)
		}
		if (op.IsPut() || op.IsDelete()) && end == "" {
			if j, dup := written[k]; dup {
				return fmt.Errorf("%w: extra ops %d and %d both write key %q (etcd refuses a key written twice in one txn)", ErrInvalidArgument, j, i, k)
			}
			written[k] = i
		}
		inside := k >= lo && k < hi
		if end != "" {
			// A range [k, end) ("\x00" means to the end of the keyspace)
			// overlaps [lo, hi) unless it lies wholly on one side.
			inside = inside || k < hi && (end == "\x00" || end > lo)
		}
		if inside {
			return fmt.Errorf("%w: extra op %d touches key %q inside the store's prefix %q", ErrInvalidArgument, i, k, lo)
		}
	}
	return nil
}

// sameOutcome reports whether two outcomes would replay identically. A
// header name with no values is no header at all: a record does not keep
// it, so the outcome read back lacks the name the caller gave.
func sameOutcome(a, b *Outcome) bool {
	return a.Status == b.Status && a.Err == b.Err && bytes.Equal(a.Body, b.Body) &&
		headerIn(a.Header, b.Header) && headerIn(b.Header, a.Header)
}

// headerIn reports whether every header value of a is in b, in order.
func headerIn(a, b map[string][]string) bool {
	for k, av := range a {
		if len(av) > 0 && !slices.Equal(av, b[k]) {
			return false
		}
	}
	return true
}
