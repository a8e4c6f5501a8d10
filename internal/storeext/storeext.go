// Package storeext carries the parts of package etcdstore that exist for
// idem's own packages alone (shard, jobs, the idem command): the shard
// set's guards and hand-overs, shard epochs, named values, a record feed,
// and the claim and enqueue options they use. They are not etcdstore's
// public API: a user of the store never calls them, and keeping them out
// of it keeps that API what a user reads (issue 37).
//
// etcdstore sets the hooks below when it is initialised, as grpc-go's
// internal package does; package storex gives them their types. This
// package imports nothing of idem's, so that etcdstore can import it.
package storeext

import (
	"errors"
	"fmt"
	"time"
)

// Hooks, set by etcdstore's init; each is called through storex, which
// knows its type.
var (
	Forward, RaiseEpoch, Epoch, ShardSet, LoadShardSet                                             any
	UnderShardSet, ValueUnderShardSet, OnSession, WithoutCreate, ReplaceMoved                      any
	Routed, IfValue, IfValueThen, WithEpochs, Retained                                             any
	SetValue, DeleteValue, GetValue, Values, ClaimHeld, Peek, BumpEpoch, AdminEpoch                any
	SettingsOf, SameAttempt, Follow, OwnerAlive, DecodeRecord, ReadStats, WithTxnObserver, StoreOf any
)

// Value is a small value that a package built on a store keeps beside the
// store's records, under a name of its own: package jobs keeps its
// schedules' cursors there (names s/<tenant>/<schedule>). Revision is the
// etcd revision of its last write, for SetValue's compare-and-set.
type Value struct {
	Name     string
	Value    []byte
	Revision int64
}

// Settings are the limits a store opened with some options keeps, known
// before it connects: package shard answers with them for all its shards.
type Settings struct {
	Retention     time.Duration
	MaxRecordSize int
}

// FollowOptions selects what Follow follows.
type FollowOptions struct {
	// ID follows this one key of the tenant instead of all of its records.
	ID string
	// Sessions follows the live sessions of every process too.
	Sessions bool
	// Values, when set, follows the values (SetValue) whose names start
	// with any of these prefixes too.
	Values []string
	// Stall bounds how long the feed may go without proving itself
	// current (the watch answers a progress request every Stall/4) before
	// Next fails with ErrUnavailable: a watch whose connection stops moving
	// bytes delivers nothing and says nothing. Default 10 s.
	Stall time.Duration
}

// ShardSetValue is the name of the value that records the shard set a
// shard belongs to (package shard writes it; claims under a set compare
// its revision).
const ShardSetValue = "shard/set"

// EpochShift is where a shard epoch starts in a fencing token: a token is
// epoch<<EpochShift | revision. Without epochs (one etcd cluster) the
// epoch is 0 and a token is the revision, as always. 44 bits hold
// revisions for 55 years at 10,000 writes a second.
const EpochShift = 44

// DefaultRestoreEpochBump is how far a restore raises a shard's epoch by
// default.
const DefaultRestoreEpochBump = 1024

// Change is one change a record feed delivers: of a record (Key set) or of
// a session (Owner set). K and R are etcdstore's Key and Record (this
// package cannot name them).
type Change[K, R any] struct {
	// Key is the record's key; Record is the record as written, nil when
	// it was deleted, or when it cannot be read (Err says why).
	Key    K
	Record *R
	Err    error
	// Owner is a session's owner id, Alive whether it began or ended.
	Owner string
	Alive bool
	// Value is a value that was written (FollowOptions.Values) or, with
	// Revision 0 and no Value, deleted (its lease expired, say).
	Value *Value
	// Revision is the etcd revision of the change.
	Revision int64
}

// MovedError reports a key handed over to another shard (K is
// etcdstore.Key).
type MovedError[K any] struct {
	Key K
	// To names the shard the key lives on now.
	To string
	// Epoch is the shard epoch of this shard when the key moved: every
	// token the key had here is below epoch+1<<EpochShift.
	Epoch int64
}

func (e *MovedError[K]) Error() string {
	return fmt.Sprintf("key %v: %v (to %s)", e.Key, ErrMoved, e.To)
}

// Is reports whether target is ErrMoved.
func (e *MovedError[K]) Is(target error) bool { return target == ErrMoved }

var (
	// ErrMoved is returned (in a *MovedError) when a key was handed over to
	// another shard of a shard set (package shard): claim it there.
	ErrMoved = errors.New("idempotency key moved to another shard")

	// ErrSetChanged is returned by a claim, enqueue or Forward of a store
	// WithEpochs when the shard set in its etcd (ShardSetValue) changed
	// since the store last read it: nothing was written; route the key
	// again by the new set (package shard does).
	ErrSetChanged = errors.New("the shard set changed")

	// ErrValueChanged is returned by an enqueue with IfValue when the value
	// moved from the revision the write was decided under. Nothing was
	// written.
	ErrValueChanged = errors.New("value changed")
)

// Stats counts what the store holds.
type Stats struct {
	Records  int64 `json:"records"`   // records, expired ones included until their lease fires
	InFlight int64 `json:"in_flight"` // of the scanned records
	Done     int64 `json:"done"`      // of the scanned records
	Expired  int64 `json:"expired"`   // of the scanned records: past retention, awaiting their lease
	Scanned  int64 `json:"scanned"`   // records whose state was read; < Records when the scan was capped
	Owners   int64 `json:"owners"`    // live sessions (idem processes)
	Leases   int64 `json:"leases"`    // live retention leases (each bucket has one or more)
}

// ValueOption configures SetValue.
type ValueOption func(*ValueConfig)

// ValueConfig is what SetValue's options say.
type ValueConfig struct {
	Retained, Session bool
	SetRev            int64 // ValueUnderShardSet
}

// OutcomeNotSaved starts the error a store saves in place of an outcome it
// cannot save (too large): package jobs tells a job's end by it on records
// written before records had kinds.
const OutcomeNotSaved = "the outcome could not be saved: "
