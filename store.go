// Package idem names the contract between idem's stores and the layers
// that use them.
//
// Two implementations keep idem's records: *etcdstore.Store on one etcd
// cluster, and *shard.Store over several. The HTTP edge (idemhttp), gRPC
// (idemgrpc), package jobs, the console and the CLI read and write records
// through Store, and know no implementation. A service that wraps a store
// (to add tracing, quotas or a cache of its own) implements Store too, and
// proves it keeps the contract with the conformance suite in package
// idemtest:
//
//	func TestMyStore(t *testing.T) {
//		idemtest.TestStore(t, idemtest.Harness{Store: wrap(store)})
//	}
//
// The promises below are the ones idemtest checks; each method's godoc says
// what it answers in every state of the key's record (absent, in flight,
// done, moved, expired).
package idem

import (
	"context"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// Store is idem's store as its users see it. Records are etcdstore.Record,
// keys etcdstore.Key, and errors wrap etcdstore's sentinels (ErrNotFound,
// ErrMismatch, ErrConflict, ErrFenced, ErrUnavailable, ErrTooLarge, ...),
// which the edges alone map to HTTP and gRPC statuses.
//
// Freshness, for every method: what a call returns reflects every write
// that completed before the call began (reads are linearizable), except
// where a store was configured to answer from memory (etcdstore.WithCache),
// which may answer with a done record deleted at most its staleness bound
// (etcdstore.WithCacheStaleness) ago. In particular, a replay never returns
// a record deleted (Evict, EvictIf, a shard's drain) before the request
// began, whichever etcd member the store's read went to.
//
// "May have landed": an error wrapping etcdstore.ErrUnavailable leaves a
// write's outcome unknown. Retrying the same call (same key, fingerprint,
// attempt id or outcome) is always safe: a claim retried WithAttempt
// recognises its own landed claim, an Enqueue finds its own record, an
// Evict that landed answers ErrNotFound, an EvictIf answers true.
type Store interface {
	// Run claims key for fingerprint fp and runs work under the claim, once:
	//   - absent, released, evicted or expired: work runs; its outcome is
	//     saved (EndSave), or the key released (EndRelease) or abandoned
	//     (EndAbandon) as it says; Result.Replayed is false;
	//   - done with fp: the saved Outcome, Replayed, the saving claim's
	//     Token; work does not run;
	//   - done or in flight with another fingerprint: an error wrapping
	//     ErrMismatch; work does not run;
	//   - in flight under a live owner (or before its deadline): a
	//     *ConflictError (ErrConflict), or WithWait the answer once it ends;
	//   - in flight under a dead owner, past its deadline, or abandoned
	//     (Enqueue): taken over with a greater token, work runs and finds the
	//     last checkpoint in Claim.LastCheckpoint.
	Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error)
	// Do is Run with the fingerprint of params and work returning its
	// outcome: a saved error is replayed as *SavedError.
	Do(ctx context.Context, key etcdstore.Key, params []byte, work etcdstore.Work, opts ...etcdstore.RunOption) (etcdstore.Result, error)
	// Claim is Run's first half, for callers that hold the steps
	// themselves: it returns the won *Claim (complete, checkpoint, release
	// or abandon it), or the done record to replay, or Run's errors. A
	// claim's writes are fenced: once another claim took the key over, or
	// the record was evicted, they fail with ErrFenced and change nothing.
	Claim(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, opts ...etcdstore.ClaimOption) (*etcdstore.Claim, *etcdstore.Record, error)
	// Attach returns the claim a Handle names, from any process, if it is
	// still the key's current claim; otherwise an error wrapping ErrFenced.
	Attach(ctx context.Context, h etcdstore.Handle) (*etcdstore.Claim, error)
	// Get returns key's record in whatever state (done, in flight,
	// abandoned), or an error wrapping ErrNotFound when there is none or its
	// retention has passed. On a shard set, the record at the key's home
	// (or, during a hand-over, where it still lives).
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	// Wait blocks until key is no longer held by a live claim and returns
	// its record (done, or stale: claim it to take it over), or ErrNotFound
	// when it is gone or was never claimed.
	Wait(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	// Enqueue writes key in flight with no owner and data as its
	// checkpoint (a job for the next claimant), unless it has a live record:
	// then it returns that record if its fingerprint is fp (in flight or
	// done: a key is enqueued once), or an error wrapping ErrMismatch. The
	// record it writes is of kind etcdstore.KindJob.
	Enqueue(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, data []byte, opts ...etcdstore.EnqueueOption) (*etcdstore.Record, error)
	// Evict deletes key's record whatever its state: the next request runs
	// the work again, a claim holding it is fenced. ErrNotFound when there
	// was nothing to delete.
	Evict(ctx context.Context, key etcdstore.Key) error
	// EvictIf deletes key's record if it is still the one written at
	// revision rev (Record.Revision), and reports whether key has no record
	// now: true when it deleted it or there was none (never an error for a
	// key that no store holds), false when a record was written since (it
	// is left alone).
	EvictIf(ctx context.Context, key etcdstore.Key, rev int64) (bool, error)
	// List returns tenant's live records (every tenant's when tenant is
	// empty) in key order, one page at a time (ListOptions.After, Limit).
	List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error)
	// Retention is how long a record is kept at least after its last
	// write (on a shard set, the shortest of the shards'): clients stop
	// retrying well inside it; a key is a new operation after it.
	Retention() time.Duration
	// MaxRecordSize is the largest outcome plus checkpoint a claim saves;
	// a larger one fails with ErrTooLarge and saves nothing.
	MaxRecordSize() int
}

var _ Store = (*etcdstore.Store)(nil)
