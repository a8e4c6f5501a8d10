package etcdstore

import (
	"errors"
	"fmt"
	"time"

	"github.com/idem-dev/idem/etcdstore/internal/send"
	"github.com/idem-dev/idem/fencing"

	"github.com/idem-dev/idem/internal/storeext"
)

// Errors of the decision table. The HTTP edge maps them to statuses; the
// store itself knows nothing of HTTP.
var (
	// ErrMismatch is returned (in a *MismatchError) when a key is reused with
	// parameters whose fingerprint differs from the first request's. The work
	// never runs and nothing is replayed: this is a client bug; do not retry.
	ErrMismatch = errors.New("idempotency key reused with different parameters")

	// ErrConflict is returned (in a *ConflictError) when the key is claimed by
	// a live owner that has not finished. Retry later with the same key and
	// parameters, or ask to wait.
	ErrConflict = errors.New("idempotency key is in flight")

	// ErrFenced is returned by Complete, Checkpoint, Release and Abandon when
	// the record is no longer the one this claim last wrote: another owner
	// took it over, or it was evicted or expired. Nothing was written.
	ErrFenced = errors.New("claim fenced out by a newer owner")
)

// Errors of bad input. Each is returned before any etcd call, so nothing is
// written.
var (
	// ErrInvalidKey is returned when an idempotency key is empty, longer than
	// MaxKeyLen bytes, has a byte outside visible ASCII (0x21-0x7e) or a
	// '/', or is "." or "..".
	ErrInvalidKey = errors.New("invalid idempotency key")

	// ErrInvalidTenant is returned when a tenant is not 1 to MaxTenantLen
	// characters of [A-Za-z0-9._-] starting with a letter or digit.
	ErrInvalidTenant = errors.New("invalid tenant")

	// ErrInvalidParams is returned when parameters that are JSON cannot be
	// put in canonical form: an object repeats a key, a number cannot be
	// represented exactly, or nesting is too deep.
	ErrInvalidParams = errors.New("invalid parameters")

	// ErrInvalidArgument is returned for any other bad argument: an extra op
	// inside idem's prefix, too many extra ops, a bad option value.
	ErrInvalidArgument = errors.New("invalid argument")

	// ErrTooLarge is returned when a saved outcome or checkpoint would make
	// the record larger than the store's limit.
	ErrTooLarge = errors.New("too large")
)

// Errors of state and availability.
var (
	// ErrNotFound is returned by Get, Evict and Wait when no record exists for
	// the key, or its retention has passed.
	ErrNotFound = errors.New("idempotency key not found")

	// ErrUnavailable wraps every error from etcd itself (timeouts, lost
	// connections, no leader, quota exceeded) and the absence of a live
	// session. The outcome of a write that fails this way is unknown; the
	// attempt id lets a retry recognise its own claim.
	ErrUnavailable = errors.New("etcd unavailable")

	// ErrNotSent is wrapped by the error of a write that never left this
	// process (its caller's context ended while it waited for its turn in
	// a batch): it did not land, and is the only failure of a write that
	// says so. Every other failure of a write may have landed.
	ErrNotSent = send.ErrNotSent

	// ErrStoreFull is returned (together with ErrUnavailable) when etcd
	// refuses a write because its database reached its quota (the NOSPACE
	// alarm). Nothing was written. Replays of done keys still work; an
	// operator must compact, defragment and disarm the alarm.
	ErrStoreFull = errors.New("etcd is out of space (NOSPACE alarm)")

	// ErrSessionLost is the cause of a claim's context when the process's
	// session lease expired: another process may take the claim over.
	ErrSessionLost = errors.New("session lease lost")

	// ErrDeadline is the cause of a claim's context when the claim's own
	// deadline passed: another process may take the claim over.
	ErrDeadline = errors.New("claim deadline passed")

	// ErrClaimEnded is returned when a claim is used after Complete, Release
	// or Abandon succeeded, or after it was fenced out.
	ErrClaimEnded = errors.New("claim already ended")

	// ErrClosed is returned by calls on a closed Store, and is the cause of
	// the contexts of claims that were running when it closed.
	ErrClosed = errors.New("store closed")

	// ErrCorrupt is returned when a record in etcd cannot be decoded. The
	// store never overwrites a record it cannot read.
	ErrCorrupt = errors.New("corrupt record")

	// ErrRestored is returned, with ErrUnavailable, by writes after etcd was
	// restored from a snapshot, until the store has raised the epoch.
	ErrRestored = errors.New("etcd was restored from a snapshot")
)

// MismatchError reports a key reused with different parameters.
type MismatchError struct {
	Key Key
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("key %s: %v", e.Key, ErrMismatch)
}

// Is reports whether target is ErrMismatch.
func (e *MismatchError) Is(target error) bool { return target == ErrMismatch }

// movedError reports a key handed over to another shard
// (storeext.MovedError).
type movedError = storeext.MovedError[Key]

// The shard set's errors (storeext).
var (
	errMoved        = storeext.ErrMoved
	errSetChanged   = storeext.ErrSetChanged
	errValueChanged = storeext.ErrValueChanged
)

// ConflictError reports a key in flight under a live owner.
type ConflictError struct {
	Key Key
	// Token is the fencing token of the claim in flight.
	Token fencing.Token
	// RetryAfter is a hint of how long to wait before retrying.
	RetryAfter time.Duration
}

func (e *ConflictError) Error() string {
	return fmt.Sprintf("key %s: %v (token %d, retry after %v)", e.Key, ErrConflict, e.Token, e.RetryAfter)
}

// Is reports whether target is ErrConflict.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// SavedError is what Do returns when it replays an outcome that saved a
// failure of the work (policy EndSave). Message is the text of the first
// attempt's error; the original error value cannot be replayed.
type SavedError struct {
	Message string
}

func (e *SavedError) Error() string { return e.Message }

// unavailable wraps an etcd error so that errors.Is(err, ErrUnavailable) holds
// and the cause is kept.
func unavailable(op string, k Key, err error) error {
	return fmt.Errorf("%s %s: %w: %w", op, k, ErrUnavailable, err)
}
