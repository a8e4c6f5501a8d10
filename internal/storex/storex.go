// Package storex is etcdstore's API for idem's own packages (shard, jobs,
// the idem command), typed: each function calls the hook etcdstore set in
// package storeext. See storeext for why these are not etcdstore's public
// API.
package storex

import (
	"context"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/storeext"
)

type (
	Change        = storeext.Change[etcdstore.Key, etcdstore.Record]
	MovedError    = storeext.MovedError[etcdstore.Key]
	Stats         = storeext.Stats
	Value         = storeext.Value
	ValueOption   = storeext.ValueOption
	Settings      = storeext.Settings
	FollowOptions = storeext.FollowOptions
)

var (
	ErrMoved        = storeext.ErrMoved
	ErrSetChanged   = storeext.ErrSetChanged
	ErrValueChanged = storeext.ErrValueChanged
)

const (
	OutcomeNotSaved         = storeext.OutcomeNotSaved
	ShardSetValue           = storeext.ShardSetValue
	EpochShift              = storeext.EpochShift
	DefaultRestoreEpochBump = storeext.DefaultRestoreEpochBump
)

// Feed is a record feed (Follow): the records, sessions and values of a
// tenant as of Revision, then every change after it.
type Feed interface {
	Records() []*etcdstore.Record
	Owners() []string
	Values() []Value
	Revision() int64
	Next(ctx context.Context) ([]Change, error)
	Close()
}

// Forward hands key over to shard to: a Moved record naming it, unless the
// key lives here (the live record is returned).
func Forward(s *etcdstore.Store, ctx context.Context, key etcdstore.Key, to string, opts ...etcdstore.ClaimOption) (*etcdstore.Record, error) {
	return storeext.Forward.(func(*etcdstore.Store, context.Context, etcdstore.Key, string, ...etcdstore.ClaimOption) (*etcdstore.Record, error))(s, ctx, key, to, opts...)
}

// RaiseEpoch raises the shard's epoch above above; it returns the epoch.
func RaiseEpoch(s *etcdstore.Store, ctx context.Context, above int64) (int64, error) {
	return storeext.RaiseEpoch.(func(*etcdstore.Store, context.Context, int64) (int64, error))(s, ctx, above)
}

// Epoch is the shard epoch s claims under.
func Epoch(s *etcdstore.Store) int64 { return storeext.Epoch.(func(*etcdstore.Store) int64)(s) }

// ShardSet is the shard set s last read (ShardSetValue).
func ShardSet(s *etcdstore.Store) Value { return storeext.ShardSet.(func(*etcdstore.Store) Value)(s) }

// LoadShardSet reads the shard set of s's cluster.
func LoadShardSet(s *etcdstore.Store, ctx context.Context) (Value, error) {
	return storeext.LoadShardSet.(func(*etcdstore.Store, context.Context) (Value, error))(s, ctx)
}

// UnderShardSet guards a claim with the shard set recorded at rev.
func UnderShardSet(rev int64) etcdstore.ClaimOption {
	return storeext.UnderShardSet.(func(int64) etcdstore.ClaimOption)(rev)
}

// ValueUnderShardSet guards a value's write with the shard set at rev.
func ValueUnderShardSet(rev int64) ValueOption {
	return storeext.ValueUnderShardSet.(func(int64) ValueOption)(rev)
}

// OnSession puts a value on the writer's session lease.
func OnSession() ValueOption { return storeext.OnSession.(func() ValueOption)() }

// Retained puts a value on a retention lease.
func Retained() ValueOption { return storeext.Retained.(func() ValueOption)() }

// WithoutCreate claims only a live record: a key without one is
// ErrNotFound, never created.
func WithoutCreate() etcdstore.ClaimOption {
	return storeext.WithoutCreate.(func() etcdstore.ClaimOption)()
}

// ReplaceMoved lets a claim replace a Moved record (the key came back).
func ReplaceMoved() etcdstore.ClaimOption {
	return storeext.ReplaceMoved.(func() etcdstore.ClaimOption)()
}

// Routed makes an enqueue write where, and only as, a claim with opts
// would.
func Routed(opts ...etcdstore.ClaimOption) etcdstore.EnqueueOption {
	return storeext.Routed.(func(...etcdstore.ClaimOption) etcdstore.EnqueueOption)(opts...)
}

// IfValue makes an enqueue land only while value name is at rev.
func IfValue(name string, rev int64) etcdstore.EnqueueOption {
	return storeext.IfValue.(func(string, int64) etcdstore.EnqueueOption)(name, rev)
}

// IfValueThen is IfValue that also writes value in the same Txn.
func IfValueThen(name string, rev int64, value []byte) etcdstore.EnqueueOption {
	return storeext.IfValueThen.(func(string, int64, []byte) etcdstore.EnqueueOption)(name, rev, value)
}

// WithEpochs makes a store a shard's: tokens carry its epoch, and claims
// compare the shard set.
func WithEpochs() etcdstore.Option { return storeext.WithEpochs.(func() etcdstore.Option)() }

// SetValue writes value name if it is still at rev (0: absent).
func SetValue(s *etcdstore.Store, ctx context.Context, name string, value []byte, rev int64, opts ...ValueOption) (Value, bool, error) {
	return storeext.SetValue.(func(*etcdstore.Store, context.Context, string, []byte, int64, ...ValueOption) (Value, bool, error))(s, ctx, name, value, rev, opts...)
}

// DeleteValue deletes value name if it is still at rev.
func DeleteValue(s *etcdstore.Store, ctx context.Context, name string, rev int64) (bool, error) {
	return storeext.DeleteValue.(func(*etcdstore.Store, context.Context, string, int64) (bool, error))(s, ctx, name, rev)
}

// GetValue reads value name (Revision 0: absent).
func GetValue[A Admin](a A, ctx context.Context, name string) (Value, error) {
	return storeext.GetValue.(func(*etcdstore.Admin, context.Context, string) (Value, error))(adminOf(a), ctx, name)
}

// Values reads the values whose names start with prefix.
func Values[A Admin](a A, ctx context.Context, prefix string) ([]Value, error) {
	return storeext.Values.(func(*etcdstore.Admin, context.Context, string) ([]Value, error))(adminOf(a), ctx, prefix)
}

// ClaimHeld reports whether key's record is still the claim of token.
func ClaimHeld[A Admin](a A, ctx context.Context, key etcdstore.Key, token fencing.Token) (bool, error) {
	return storeext.ClaimHeld.(func(*etcdstore.Admin, context.Context, etcdstore.Key, fencing.Token) (bool, error))(adminOf(a), ctx, key, token)
}

// Peek reads key's record even past its retention (until it is deleted).
func Peek[A Admin](a A, ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	return storeext.Peek.(func(*etcdstore.Admin, context.Context, etcdstore.Key) (*etcdstore.Record, error))(adminOf(a), ctx, key)
}

// BumpEpoch raises the cluster's shard epoch by by (after a restore).
func BumpEpoch[A Admin](a A, ctx context.Context, by int64) (int64, error) {
	return storeext.BumpEpoch.(func(*etcdstore.Admin, context.Context, int64) (int64, error))(adminOf(a), ctx, by)
}

// AdminEpoch reads the cluster's shard epoch.
func AdminEpoch[A Admin](a A, ctx context.Context) (int64, error) {
	return storeext.AdminEpoch.(func(*etcdstore.Admin, context.Context) (int64, error))(adminOf(a), ctx)
}

// SettingsOf returns the limits a store opened with opts keeps.
func SettingsOf(opts ...etcdstore.Option) (Settings, error) {
	return storeext.SettingsOf.(func(...etcdstore.Option) (Settings, error))(opts...)
}

// SameAttempt reports whether two attempt ids name one attempt.
func SameAttempt(a, b string) bool { return storeext.SameAttempt.(func(string, string) bool)(a, b) }

// Follow starts a feed of tenant's records (and sessions, and values).
func Follow(s *etcdstore.Store, ctx context.Context, tenant string, o FollowOptions) (Feed, error) {
	f, err := storeext.Follow.(func(*etcdstore.Store, context.Context, string, FollowOptions) (any, error))(s, ctx, tenant, o)
	if err != nil {
		return nil, err
	}
	return f.(Feed), nil
}

// OwnerAlive reports whether owner's session lives.
func OwnerAlive[A Admin](a A, ctx context.Context, owner string) (bool, error) {
	return storeext.OwnerAlive.(func(*etcdstore.Admin, context.Context, string) (bool, error))(adminOf(a), ctx, owner)
}

// DecodeRecord decodes a record read from etcd (a watch event's, say).
func DecodeRecord[A Admin](a A, kv *mvccpb.KeyValue) (*etcdstore.Record, error) {
	return storeext.DecodeRecord.(func(*etcdstore.Admin, *mvccpb.KeyValue) (*etcdstore.Record, error))(adminOf(a), kv)
}

// Admin is a store or its Admin: the functions that read need only the
// Admin.
type Admin interface {
	*etcdstore.Store | *etcdstore.Admin
}

func adminOf[A Admin](a A) *etcdstore.Admin {
	switch v := any(a).(type) {
	case *etcdstore.Store:
		return &v.Admin
	case *etcdstore.Admin:
		return v
	}
	return nil
}

// Stats counts records, live sessions and retention leases, reading the
// state of at most maxScan records (0: all) in pages of 1000.
func ReadStats[A Admin](a A, ctx context.Context, maxScan int64) (Stats, error) {
	return storeext.ReadStats.(func(*etcdstore.Admin, context.Context, int64) (Stats, error))(adminOf(a), ctx, maxScan)
}

// WithTxnObserver has f told how long each of the store's conditional
// writes took (the idem_txn_seconds histogram).
func WithTxnObserver(f func(time.Duration)) etcdstore.Option {
	return storeext.WithTxnObserver.(func(func(time.Duration)) etcdstore.Option)(f)
}

// StoreOf returns the store claim c was made in: on a shard set, the shard
// that holds the key, where the values that go with it (package jobs'
// events) are kept too.
func StoreOf(c *etcdstore.Claim) *etcdstore.Store {
	return storeext.StoreOf.(func(*etcdstore.Claim) *etcdstore.Store)(c)
}

// Placed is a shard set's placed value as read: on shard Shard, at
// Revision (0: none; a marker there reads as none, at its revision, to
// write over). Package shard calls it shard.Placed.
type Placed struct {
	Shard    string
	Value    []byte
	Revision int64
	Exists   bool
}

// PlacedPrefix starts the names of a shard set's placed values.
const PlacedPrefix = "k/"

// PlacedName is the name of key's placed value on its shard.
func PlacedName(key etcdstore.Key) string {
	tenant := key.Tenant
	if tenant == "" {
		tenant = etcdstore.DefaultTenant
	}
	return PlacedPrefix + tenant + "/" + key.ID
}
