package etcdstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
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
// caller's with the same fingerprint, which names the same work.
//
// The transaction is the claim's: If CreateRevision(record) == 0 Then
// Put(record, lease=bucket) Else Get(record), or a compare-and-set on a
// record whose retention has passed.
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
	data = bytes.Clone(data)
	ctx, cancel := s.bound(ctx)
	defer cancel()
	ekey := s.ks.record(key)
	var cur *Record // the record as last read; nil: absent or not read
	known := false
	tries := 0
	var landed landing
	for round := 0; round < 8; round++ {
		now := s.now()
		if cfg.route.existing && !known {
			rec, _, err := s.get(ctx, key)
			if err != nil {
				return nil, wrapEtcd("enqueue", key, err)
			}
			cur, known = rec, true
		}
		if cfg.route.existing && (cur == nil || cur.expired(now) || cur.State == Moved) {
			return nil, fmt.Errorf("enqueue %s: %w: no live record in this store (WithoutCreate)", key, ErrNotFound)
		}
		cmps := []cond{created(ekey, pb.Compare_EQUAL, 0)}
		var expect *Record // the record this round's write replaces (nil: none)
		if known && cur != nil {
			switch {
			case cur.expired(now), cfg.route.overMoved && cur.State == Moved:
				cmps, expect = []cond{modified(ekey, cur.Revision)}, cur // a new operation
			case cur.State == Moved:
				return nil, &MovedError{Key: key, To: cur.MovedTo, Epoch: cur.Epoch}
			case cur.Fingerprint != fp:
				return nil, &MismatchError{Key: key}
			default:
				return cur, nil
			}
		}
		rec := &Record{
			Key:         key,
			State:       InFlight,
			Fingerprint: fp,
			Attempt:     rand.Text(),
			Created:     now,
			Expires:     now.Add(s.retention),
			Checkpoint:  data,
		}
		var touch []clientv3.Op
		if cfg.value != "" {
			cmps = append(cmps, modified(s.ks.values()+cfg.value, cfg.valueRev))
			switch {
			case cfg.valueTo != nil:
				touch = append(touch, clientv3.OpPut(s.ks.values()+cfg.value, string(cfg.valueTo), clientv3.WithIgnoreLease()))
			case cfg.valueRev != 0:
				// The record and the value's new revision land together:
				// a decision made at valueRev that the record is absent
				// (a compare-and-set of the value) cannot land beside it.
				touch = append(touch, clientv3.OpPut(s.ks.values()+cfg.value, "", clientv3.WithIgnoreValue(), clientv3.WithIgnoreLease()))
			}
		}
		epoch := s.epoch.Load()
		var setRev int64
		if s.epochs {
			rec.Epoch = epoch
			var guards []cond
			guards, setRev = s.guards(epoch, cfg.route.setRev)
			cmps = append(cmps, guards...)
		}
		res, err := s.writeRecord(ctx, key, "", cmps, rec, 0, touch...)
		if errors.Is(err, rpctypes.ErrNoSpace) {
			// etcd refuses every Put while it is full: a key already
			// enqueued (or done) can still be answered from a read.
			if got, _, rerr := s.get(ctx, key); rerr == nil && got != nil && !got.expired(now) && got.State != Moved && got.Fingerprint == fp {
				return got, nil
			}
			return nil, wrapEtcd("enqueue", key, err)
		}
		if err != nil {
			err = landed.failed(err)
			if errors.Is(err, ErrCorrupt) || !retryable(ctx, err) || tries >= maxTries {
				return nil, wrapEtcd("enqueue", key, err)
			}
			tries++
			if !s.backoff(ctx, tries) {
				return nil, wrapEtcd("enqueue", key, err)
			}
			known = false // the write may have landed: read what is there
			continue
		}
		if res.ok {
			rec.Revision, rec.Token = res.rev, tokenOf(epoch, res.rev)
			rec.Expires, rec.Created = toMillis(rec.Expires), toMillis(rec.Created)
			return rec, nil
		}
		if s.epochs && s.setChanged(res, setRev) {
			return nil, fmt.Errorf("enqueue %s: %w", key, ErrSetChanged)
		}
		if s.epochs && res.epoch != epoch {
			s.epoch.Store(res.epoch)
		}
		cur, known = res.cur, true
		if cfg.value != "" && (cur == nil && expect == nil || cur != nil && expect != nil && cur.Revision == expect.Revision) {
			// The record was as this round expected (absent, or the same
			// expired one), so the compare that failed is the value's.
			return nil, fmt.Errorf("enqueue %s: %w: value %q is no longer at revision %d", key, ErrValueChanged, cfg.value, cfg.valueRev)
		}
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

// Routed makes Enqueue write where, and only as, a claim with opts would:
// UnderShardSet compares that shard set instead of the store's own,
// WithoutCreate enqueues nothing where the key has no live record (it
// returns the live one, or an error wrapping ErrNotFound), ReplaceMoved
// replaces a Moved record as a new job instead of failing with a
// *MovedError. Other claim options are ignored. Package shard enqueues so
// on the shard it routed the key to (shard.Store.Enqueue).
func Routed(opts ...ClaimOption) EnqueueOption {
	return func(c *enqueueConfig) {
		for _, o := range opts {
			if err := o.applyRun(&c.route); err != nil && c.err == nil {
				c.err = err
			}
		}
	}
}

// IfValue makes Enqueue write the record only while the value name
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
func IfValue(name string, rev int64) EnqueueOption {
	return func(c *enqueueConfig) { c.value, c.valueRev, c.valueTo = name, rev, nil }
}

// IfValueThen is IfValue (rev other than 0), and the record's write sets
// the value to value in the same transaction, its lease unchanged: the
// value says the record was written, and nothing can read one without the
// other. When the record exists already, the value is left as it is.
// Package jobs so marks a schedule's cursor with the occurrence whose job
// it submitted: a job absent later ended, or was forgotten, and is never
// submitted again.
func IfValueThen(name string, rev int64, value []byte) EnqueueOption {
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
