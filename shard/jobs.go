package shard

import (
	"context"
	"errors"
	"fmt"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// This file holds what package jobs needs of a shard set beyond claims:
// enqueueing a key where a claim of it would go, and finding the shard
// that holds a key's record (a job's events are kept beside it).

// Enqueue is etcdstore.Store.Enqueue on the shard that may claim key: its
// old shard while that one holds a live record of it (where only that
// record is returned: nothing is created there), its home otherwise (over
// a Moved record an older set left). A value opts compare (etcdstore.
// IfValue) is compared on that shard.
func (s *Store) Enqueue(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, data []byte, opts ...etcdstore.EnqueueOption) (rec *etcdstore.Record, err error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("enqueue: %w", err)
	}
	err = s.do(ctx, key, func(t target) error {
		rec, err = t.st.Enqueue(ctx, key, fp, data, append([]etcdstore.EnqueueOption{storex.Routed(t.opts...)}, opts...)...)
		return err
	})
	return rec, err
}

// Holder returns the store of the shard that holds key's live record, with
// the record; when no shard holds one, the store of its home under the set
// in force and an error wrapping etcdstore.ErrNotFound. It only reads: it
// never hands a key over.
func (s *Store) Holder(ctx context.Context, key etcdstore.Key) (*etcdstore.Store, *etcdstore.Record, error) {
	if err := key.Validate(); err != nil {
		return nil, nil, fmt.Errorf("holder: %w", err)
	}
	st, rec, err := s.readShard(ctx, key)
	if st == nil && (err == nil || errors.Is(err, etcdstore.ErrNotFound)) {
		return nil, nil, s.unreachable(s.Place(key))
	}
	return st, rec, err
}

// EvictIf is etcdstore.Store.EvictIf on the shard that holds key's record.
// A key that no shard holds has no record: true, as on one store (a job's
// DedupWindow re-submit that races the old record's expiry, or another
// submitter, must not fail).
func (s *Store) EvictIf(ctx context.Context, key etcdstore.Key, rev int64) (bool, error) {
	st, _, err := s.Holder(ctx, key)
	if errors.Is(err, etcdstore.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return st.EvictIf(ctx, key, rev)
}

// Settings returns the settings every shard's store keeps at least: the
// shortest retention and smallest record of the shards' options.
func (s *Store) Settings() storex.Settings {
	var out storex.Settings
	first := true
	for _, n := range s.names {
		got, err := storex.SettingsOf(append(append([]etcdstore.Option{}, s.opts...), s.members[n].Options...)...)
		if err != nil {
			continue // New fails on it, and keeps failing: it never connects
		}
		if first || got.Retention < out.Retention {
			out.Retention = got.Retention
		}
		if first || got.MaxRecordSize < out.MaxRecordSize {
			out.MaxRecordSize = got.MaxRecordSize
		}
		first = false
	}
	return out
}

// Places returns the shard the set in force puts key on, the one its
// previous placement did while the set hands keys over (else home again),
// and the set's generation; or ok false while no set is in force.
func (s *Store) Places(key etcdstore.Key) (home, old string, gen int64, ok bool) {
	set, known := s.current()
	if !known {
		return "", "", 0, false
	}
	home = set.Placement.place(key)
	old = home
	if p := set.handing(); p != nil {
		old = p.place(key)
	}
	return home, old, set.Generation, true
}

// Clock returns the clock the set's stores run on (Config.Clock).
func (s *Store) Clock() clock.Clock { return s.clk }
