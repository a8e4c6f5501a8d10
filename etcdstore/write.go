package etcdstore

import (
	"bytes"
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/kernel"
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
	return c.write(ctx, kernel.WriteRequest{Kind: kernel.Complete, Outcome: kernelOutcome(&out)}, ops)
}

// Checkpoint saves data as the claim's recovery point (Brandur Leach's
// "recovery points"): if this worker dies, the owner that takes over finds it
// in LastCheckpoint and resumes from there. The fencing token does not
// change; IsOwner's comparison does. Fenced like Complete; on ErrFenced the
// claim ends. After an error wrapping ErrUnavailable the checkpoint may or
// may not have been saved; the claim's next write finds out and keeps
// whichever is newer, so a checkpoint never moves backwards.
//
// ops, when given, commit in the same etcd Txn, as Complete's do: once,
// atomically with the recovery point. After ErrUnavailable, call it again
// with the same data and ops: a write that landed is not repeated.
func (c *Claim) Checkpoint(ctx context.Context, data []byte, ops ...clientv3.Op) error {
	if err := c.s.checkOps(ops); err != nil {
		return fmt.Errorf("checkpoint %s: %w", c.key, err)
	}
	if len(data) > c.s.maxRecord {
		return fmt.Errorf("checkpoint %s: %w: %d bytes, limit %d", c.key, ErrTooLarge, len(data), c.s.maxRecord)
	}
	return c.write(ctx, kernel.WriteRequest{Kind: kernel.Checkpoint, Checkpoint: bytes.Clone(data)}, ops)
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
	return c.write(ctx, kernel.WriteRequest{Kind: kernel.Release}, nil)
}

// Abandon gives the claim up without deleting it: the record stays in flight
// with its fingerprint and last checkpoint but no owner, and the next
// request with the key takes it over at once and resumes from the
// checkpoint, with a greater fencing token. Fenced like Complete.
func (c *Claim) Abandon(ctx context.Context) error {
	return c.write(ctx, kernel.WriteRequest{Kind: kernel.Abandon}, nil)
}

// write performs one fenced write of the claim, as the kernel's Write
// machine decides it: If(ModRevision(record) == c.rev). It is retried,
// within ctx bounded by the request timeout, while its outcome is unknown.
//
// A retry, or any write after one whose outcome was unknown, may find a
// record with this claim's token and attempt id that it did not expect:
// only this claim writes those, so an earlier write of its own landed. The
// claim then adopts what that record says (its checkpoint, its deadline)
// before it decides, so it never rewrites the record from older memory:
// a checkpoint that landed with a lost reply is never moved backwards.
func (c *Claim) write(ctx context.Context, req kernel.WriteRequest, extra []clientv3.Op) (err error) {
	op := req.Kind.String()
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
	if c.gen != c.s.restores.Load() {
		// etcd was restored since the claim was made: its record may be
		// gone, and its revision handed out again to a newer claim of the
		// key, which a write compared with it would overwrite.
		c.endLocked(ErrRestored)
		return fmt.Errorf("%s %s: %w: %w: the claim was made before etcd was restored", op, c.key, ErrFenced, ErrRestored)
	}
	s := c.s
	ctx, cancel := s.bound(ctx)
	defer cancel()
	m := kernel.NewWrite(s.kcfg(), c.heldLocked(), req)
	for {
		a := m.Next(s.view(c.key))
		if a.Wait > 0 && clock.Sleep(s.clock, ctx, a.Wait) != nil {
			c.adoptLocked(m.Held()) // the claim stays held
			return wrapEtcd(op, c.key, a.Err)
		}
		switch a.Kind {
		case kernel.ActDone:
			return c.wroteLocked(op, m)
		case kernel.ActRead:
			cur, _, err := s.get(ctx, c.key)
			m.Read(kernelRecord(cur), err)
		case kernel.ActSend:
			m.Sent(s.exec(ctx, c.key, a.Txn, extra))
		}
	}
}

// wroteLocked takes a finished write's answer: the claim adopts what
// landed of it, ends if the answer ends it, and the caller learns the
// answer as an error (nil: landed).
func (c *Claim) wroteLocked(op string, m *kernel.Write) error {
	c.adoptLocked(m.Held())
	a := m.Answer()
	cause, err := ErrClaimEnded, error(nil)
	switch a.Verdict {
	case kernel.Expired:
		cause = ErrDeadline
		at := c.expires.Format(time.RFC3339Nano)
		if a.EarlierMayHaveLanded {
			err = fmt.Errorf("%s %s: %w: an earlier try may have landed, and the claim's record is now past its expiry (%s): %w", op, c.key, ErrUnavailable, at, ErrDeadline)
		} else {
			err = fmt.Errorf("%s %s: %w: %w: its record is past its expiry (%s)", op, c.key, ErrClaimEnded, ErrDeadline, at)
		}
	case kernel.Fenced:
		cause, err = ErrFenced, fmt.Errorf("%s %s: %w", op, c.key, ErrFenced)
	case kernel.Ended:
		err = fmt.Errorf("%s %s: %w: %s", op, c.key, ErrClaimEnded, a.Why)
	case kernel.KeptChanging:
		err = fmt.Errorf("%s %s: %w: the claim's record kept changing under it", op, c.key, ErrUnavailable)
	case kernel.Error:
		err = wrapEtcd(op, c.key, a.Err) // the claim stays held
	}
	if m.Ends() {
		c.endLocked(cause)
	}
	return err
}

// heldLocked is the claim as the kernel knows it.
func (c *Claim) heldLocked() kernel.Held {
	return kernel.Held{Key: c.s.ks.record(c.key), Fingerprint: c.fp, Owner: c.owner, Attempt: c.attempt,
		Token: int64(c.token), Rev: c.rev, Created: c.created, Deadline: c.deadline, Expires: c.expires,
		Checkpoint: c.checkpoint, Takeovers: c.takeovers, CutShort: c.cutShort, Kind: kernelKinds[c.kind]}
}

// adoptLocked makes h, what landed of this claim's writes, the claim's
// state: the fence, the checkpoint and the deadline (re-arming its timer).
func (c *Claim) adoptLocked(h kernel.Held) {
	c.rev = h.Rev
	c.checkpoint = h.Checkpoint
	if !h.Deadline.Equal(c.deadline) || !h.Expires.Equal(c.expires) {
		c.deadline, c.expires = h.Deadline, h.Expires
		c.armDeadlineLocked()
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
