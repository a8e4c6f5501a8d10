package etcdstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/kernel"
)

// Enqueue hands key's work to whoever claims the key next: unless the key
// already has a live record, it writes one in flight with no owner and data
// as its checkpoint, an abandoned claim that nobody held. The next Claim of
// key with fingerprint fp takes it over at once, with a greater fencing
// token, and finds data in LastCheckpoint. Package jobs submits jobs this
// way.
//
// It returns the key's record as it stands: the one this call wrote
// (Takeovers 0, no owner), or the live record it found with the same
// fingerprint, in flight or done: a key is enqueued once, whoever enqueues
// it. A record with another fingerprint is a *MismatchError. Enqueue needs
// no session. It retries its own write while the outcome is unknown; a
// retry that finds the record cannot tell its own write from another
// caller's with the same fingerprint, which names the same work. Its
// transaction is the claim's (docs/ARCHITECTURE.md).
func (s *Store) Enqueue(ctx context.Context, key Key, fp Fingerprint, data []byte, opts ...EnqueueOption) (*Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("enqueue: %w", err)
	}
	var cfg enqueueConfig
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.err != nil {
		return nil, fmt.Errorf("enqueue %s: %w", key, cfg.err)
	}
	if cfg.value != "" {
		if err := validValueName(cfg.value); err != nil {
			return nil, fmt.Errorf("enqueue %s: %w", key, err)
		}
	}
	if len(data) > s.maxRecord {
		return nil, fmt.Errorf("enqueue %s: %w: checkpoint is %d bytes, limit %d", key, ErrTooLarge, len(data), s.maxRecord)
	}
	req := kernel.EnqueueRequest{Key: s.ks.record(key), Fingerprint: fp, Attempt: rand.Text(), Data: bytes.Clone(data),
		Existing: cfg.route.existing, OverMoved: cfg.route.overMoved, SetRev: cfg.route.setRev, ValueRev: cfg.valueRev, ValueTo: cfg.valueTo}
	if cfg.value != "" {
		req.Value = s.ks.values() + cfg.value
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	m := kernel.NewEnqueue(s.kcfg(), req)
	for {
		a := m.Next(s.view(key))
		if a.Wait > 0 && clock.Sleep(s.clock, ctx, a.Wait) != nil {
			return nil, wrapEtcd("enqueue", key, a.Err)
		}
		switch a.Kind {
		case kernel.ActDone:
			return s.enqueued(key, &cfg, m.Answer())
		case kernel.ActRead:
			rec, _, err := s.get(ctx, key)
			if err != nil {
				return nil, wrapEtcd("enqueue", key, err)
			}
			m.Read(kernelRecord(rec))
		case kernel.ActSend:
			s.learn(m.Sent(s.exec(ctx, key, a.Txn, nil)))
		}
	}
}

// enqueued answers an Enqueue as the kernel decided it.
func (s *Store) enqueued(key Key, cfg *enqueueConfig, a kernel.Answer) (*Record, error) {
	rec := storeRecord(key, a.Record)
	switch a.Verdict {
	case kernel.Landed, kernel.Found:
		return rec, nil
	case kernel.IsMoved:
		return nil, &movedError{Key: key, To: rec.MovedTo, Epoch: rec.Epoch}
	case kernel.Mismatch:
		return nil, &MismatchError{Key: key}
	case kernel.NotFound:
		return nil, fmt.Errorf("enqueue %s: %w: no live record in this store (WithoutCreate)", key, ErrNotFound)
	case kernel.SetChanged:
		return nil, fmt.Errorf("enqueue %s: %w", key, errSetChanged)
	case kernel.ValueChanged:
		return nil, fmt.Errorf("enqueue %s: %w: value %q is no longer at revision %d", key, errValueChanged, cfg.value, cfg.valueRev)
	case kernel.Error:
		return nil, wrapEtcd("enqueue", key, a.Err)
	}
	return nil, fmt.Errorf("enqueue %s: %w: the record kept changing", key, ErrUnavailable)
}

// EnqueueOption configures Enqueue.
type EnqueueOption func(*enqueueConfig)

type enqueueConfig struct {
	value    string
	valueRev int64
	valueTo  []byte      // IfValueThen: the value's content after the write
	route    claimConfig // Routed
	err      error
}

// routed makes Enqueue write where, and only as, a claim with opts would:
// UnderShardSet compares that shard set instead of the store's own,
// WithoutCreate enqueues nothing where the key has no live record (it
// returns the live one, or an error wrapping ErrNotFound), ReplaceMoved
// replaces a Moved record as a new job instead of failing with a
// *MovedError. Other claim options are ignored. Package shard enqueues so
// on the shard it routed the key to (shard.Store.Enqueue).
func routed(opts ...ClaimOption) EnqueueOption {
	return func(c *enqueueConfig) {
		for _, o := range opts {
			if err := o.applyRun(&c.route); err != nil && c.err == nil {
				c.err = err
			}
		}
	}
}

// ifValue makes Enqueue write the record only while the value name
// (Store.SetValue) is still at revision rev: a write decided under that
// value cannot land after the value moved on (a stalled writer's late
// write). When it moved, and the record does not exist, Enqueue writes
// nothing and returns an error wrapping ErrValueChanged. A record that
// exists is returned as without the option.
//
// The write also moves the value to a new revision, its content and lease
// unchanged (for rev other than 0), in the same transaction: whoever read
// the value at rev and the record as absent, and sets the value at rev on
// that ground, fails (SetValue reports the value changed) instead of
// landing beside the record. Package jobs fences the occurrences its
// schedules decide with their cursor so: a scheduler that finds the
// previous occurrence's job absent (never submitted, or forgotten) and
// decides the next one cannot race that job's late submission.
func ifValue(name string, rev int64) EnqueueOption {
	return func(c *enqueueConfig) { c.value, c.valueRev, c.valueTo = name, rev, nil }
}

// ifValueThen is IfValue (rev other than 0), and the record's write sets
// the value to value in the same transaction, its lease unchanged: the
// value says the record was written, and nothing can read one without the
// other. When the record exists already, the value is left as it is.
// Package jobs so marks a schedule's cursor with the occurrence whose job
// it submitted: a job absent later ended, or was forgotten, and is never
// submitted again.
func ifValueThen(name string, rev int64, value []byte) EnqueueOption {
	return func(c *enqueueConfig) {
		c.value, c.valueRev, c.valueTo = name, rev, bytes.Clone(value)
		if rev == 0 {
			c.err = fmt.Errorf("%w: IfValueThen of value %q at revision 0", ErrInvalidArgument, name)
		}
		if c.valueTo == nil {
			c.valueTo = []byte{}
		}
	}
}
