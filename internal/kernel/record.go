package kernel

import (
	"bytes"
	"crypto/subtle"
	"slices"
	"time"
)

// State is a record's state.
type State uint8

// The states of a record.
const (
	InFlight State = iota + 1 // claimed (or abandoned, or enqueued): its work has not ended
	Done                      // its outcome is saved
	Moved                     // handed over to another shard
)

func (s State) String() string {
	switch s {
	case InFlight:
		return "in_flight"
	case Done:
		return "done"
	case Moved:
		return "moved"
	}
	return "absent"
}

// Outcome is a key's saved outcome.
type Outcome struct {
	Status int
	Header map[string][]string
	Body   []byte
	Err    string
}

// Record is what the kernel knows of a key's record: what it was written
// with, and the revision of its last write.
type Record struct {
	State       State
	Fingerprint [32]byte
	Owner       string // the session holding an in-flight claim; "" when abandoned
	Attempt     string
	Token       int64 // the fencing token of its claim
	Created     time.Time
	Expires     time.Time
	Deadline    time.Time // zero: none
	Checkpoint  []byte
	Takeovers   int
	// CutShort: an earlier claim of this operation held it and was cut
	// short (its owner gone, or past its deadline) after it may have run
	// the work; kept by every later write (a takeover, a fence, an
	// abandon), so that an edge that must never run such work twice
	// (idemhttp's save policy) knows it whoever took the key over since.
	CutShort bool
	Outcome  *Outcome // Done
	MovedTo  string   // Moved
	Epoch    int64    // the shard epoch its claim (or move) was written under
	Fence    bool     // a placeholder that fences a lost claim write: the key is free
	Kind     Kind     // what the record is: a plain key or a job (Enqueue); 0 before kinds
	Revision int64    // its ModRevision: the fence of its last write
	Lease    int64    // the lease it is attached to
}

// Kind says what a record is. A claim of a new key writes KindKey, an
// Enqueue KindJob; every later write of the record (a takeover, a
// checkpoint, its end) keeps it. KindUnknown is a record written before
// records had kinds.
type Kind uint8

const (
	KindUnknown Kind = iota
	KindKey
	KindJob
)

// DeadlineOwner is the owner of a claim made without a session (the HTTP
// worker API's): it is stale only once its deadline passes. It is never an
// owner key, and cannot collide with a session's owner id (a UUID).
const DeadlineOwner = "~deadline"

// EpochShift is where a shard epoch starts in a fencing token: a token is
// epoch<<EpochShift | revision.
const EpochShift = 44

// TokenOf is the fencing token of a claim written at rev under epoch.
func TokenOf(epoch, rev int64) int64 { return epoch<<EpochShift | rev }

// Millis rounds t down to the millisecond, the precision of times stored
// in records.
func Millis(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

// Expired reports whether the record's retention has passed at now, or it
// is a fence: either way the key names no operation.
func (r *Record) Expired(now time.Time) bool { return r.Fence || !now.Before(r.Expires) }

// PastDeadline reports whether an in-flight claim's deadline has passed at
// now.
func (r *Record) PastDeadline(now time.Time) bool {
	return !r.Deadline.IsZero() && !now.Before(r.Deadline)
}

// Live reports whether the record names an operation at now: it exists,
// is not expired (nor a fence), and is not Moved.
func (r *Record) Live(now time.Time) bool {
	return r != nil && !r.Expired(now) && r.State != Moved
}

// InFlightExpiry is the expiry of an in-flight record written at now with
// deadline (zero: none): one retention after the later of the two, so that
// a claim's record outlives the time its claim may be held by a retention,
// and a stale claim can always be taken over with its checkpoint.
func InFlightExpiry(now, deadline time.Time, retention time.Duration) time.Time {
	if deadline.After(now) {
		now = deadline
	}
	return Millis(now.Add(retention))
}

// SameAttempt reports whether two attempt ids are the same, in time that
// does not depend on where they differ: an attempt id is a secret.
func SameAttempt(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// SameOutcome reports whether two outcomes would replay identically. A
// header name with no values is no header at all: a record does not keep
// it, so the outcome read back lacks the name the caller gave.
func SameOutcome(a, b *Outcome) bool {
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

// sameInFlight reports whether two in-flight records of one claim say the
// same: a write that would put want has already landed as got.
func sameInFlight(got, want *Record) bool {
	return got.Owner == want.Owner && got.Deadline.Equal(want.Deadline) && bytes.Equal(got.Checkpoint, want.Checkpoint)
}
