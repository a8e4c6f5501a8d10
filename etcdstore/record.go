package etcdstore

import (
	"time"

	"github.com/idem-dev/idem/fencing"
)

// State is a record's state.
type State string

// The states of a record.
const (
	InFlight State = "in_flight"
	Done     State = "done"
	// Moved marks a key handed over to another shard (package shard): the
	// key lives there now, and this store refuses to claim it (ErrMoved).
	Moved State = "moved"
)

// Outcome is the result of a key's work, saved once and replayed to every
// retry. Status and Header are for HTTP-shaped results and may be left zero;
// Err is set when the work's failure itself was saved (policy EndSave).
type Outcome struct {
	Status int
	Header map[string][]string
	Body   []byte
	Err    string
}

// size is the outcome's contribution to the record size.
func (o *Outcome) size() int {
	n := len(o.Body) + len(o.Err)
	for k, vs := range o.Header {
		n += len(k)
		for _, v := range vs {
			n += len(v) + 4
		}
	}
	return n
}

// Record is the state of one key as stored in etcd.
type Record struct {
	Key         Key
	State       State
	Fingerprint Fingerprint
	// Owner is the owner id (session) holding an in-flight claim, or "" when
	// the claim was abandoned for the next claimant to resume.
	Owner string
	// Attempt identifies the attempt that made the current claim.
	Attempt string
	// Token is the fencing token of the current claim (or of the claim that
	// completed the record).
	Token fencing.Token
	// Created is when the key was first claimed.
	Created time.Time
	// Expires is when retention ends; the record is treated as absent after.
	Expires time.Time
	// Deadline is when an in-flight claim becomes stale even if its owner is
	// alive; zero when the claim has none.
	Deadline time.Time
	// Checkpoint is the last recovery point saved by an owner.
	Checkpoint []byte
	// Takeovers counts how often the key was taken over from a stale owner.
	Takeovers int
	// CutShort: an earlier claim held the key and was cut short (its owner
	// gone or past its deadline): its work may have run.
	CutShort bool
	// Outcome is the saved outcome of a done record.
	Outcome *Outcome
	// Revision is the record's etcd ModRevision: the fence of its last write.
	Revision int64
	// Lease is the retention lease the record is attached to.
	Lease int64
	// MovedTo names the shard a Moved record hands the key over to.
	MovedTo string
	// Epoch is the epoch of the record's claim (or move): its token's top bits.
	Epoch int64
	// Fence marks a placeholder the store wrote to fence a claim write of
	// its own whose outcome was unknown: the key is free, as if absent.
	Fence bool
	// Kind is KindKey (Claim, Run, Do) or KindJob (Enqueue); empty on a
	// moved record, and on records written before idem 0.6.
	Kind Kind
}

// Kind is what a record is, for every reader to decode the same way.
type Kind string

const (
	KindKey Kind = "key" // an idempotency key: Claim, Run, Do
	KindJob Kind = "job" // a job: Enqueue
)

// epochShift is where a shard epoch starts in a fencing token: a token is
// epoch<<epochShift | revision. Without epochs (one etcd cluster) the
// epoch is 0 and a token is the revision, as always. 44 bits hold
// revisions for 55 years at 10,000 writes a second.
const epochShift = 44

// tokenOf is the fencing token of a claim written at rev under epoch.
func tokenOf(epoch, rev int64) fencing.Token { return fencing.Token(epoch<<epochShift | rev) }

// toMillis rounds t down to the millisecond, the precision of times stored
// in records, so a claim's in-memory deadline equals the stored one.
func toMillis(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

// expired reports whether the record's retention has passed at now, or
// it is a fence: either way the key names no operation.
func (r *Record) expired(now time.Time) bool { return r.Fence || !now.Before(r.Expires) }

// pastDeadline reports whether an in-flight claim's deadline has passed at now.
func (r *Record) pastDeadline(now time.Time) bool {
	return !r.Deadline.IsZero() && !now.Before(r.Deadline)
}
