package jobs

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// DefaultTenant is the tenant a Queue keeps its jobs under unless told
// otherwise (WithTenant): jobs never share keys with a service's
// idempotency keys.
const DefaultTenant = "jobs"

// Queue submits, reads and administers jobs: the records of one tenant of
// an etcdstore.Store, or of a shard set (NewOnShards). It starts no
// goroutines; Worker and Scheduler run on it.
type Queue struct {
	store  *etcdstore.Store // one cluster (New); nil on a shard set
	set    Shards           // a shard set (NewOnShards); nil on one cluster
	recs   idem.Store       // store or set: where each job's record is
	limits storex.Settings
	tenant string
	log    *slog.Logger
	clock  clock.Clock
	zone   string
}

// Option configures a Queue.
type Option func(*Queue) error

// WithTenant keeps the queue's jobs under tenant (default DefaultTenant).
func WithTenant(tenant string) Option {
	return func(q *Queue) error {
		if err := etcdstore.ValidateTenant(tenant); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		q.tenant = tenant
		return nil
	}
}

// WithZone names the data centre (or zone) this process runs in: the jobs
// it submits are kept there while it has workers (each job prefers a
// worker of the zone that submitted it), and its workers say they run
// there. 1 to 64 characters of [A-Za-z0-9._-]; default none (every
// worker is as good as another).
func WithZone(zone string) Option {
	return func(q *Queue) error {
		if err := validName(zone, 64, true); err != nil {
			return fmt.Errorf("%w: zone %q: %v", ErrInvalid, zone, err)
		}
		q.zone = zone
		return nil
	}
}

// Zone returns the queue's zone (WithZone), or "".
func (q *Queue) Zone() string { return q.zone }

// WithLogger sets the logger of the queue and of the workers and
// schedulers on it (default: slog.Default() when the queue is made, the
// process's logger: the skips and failures it counts are logged there).
func WithLogger(l *slog.Logger) Option {
	return func(q *Queue) error { q.log = l; return nil }
}

// New returns a Queue on store. The store's retention is how long a job is
// remembered after its last write: a job's id names one job for that long,
// so a job must not wait (parked, or scheduled) longer, and schedules catch
// up at most half of it.
func New(store *etcdstore.Store, opts ...Option) (*Queue, error) {
	if store == nil {
		return nil, fmt.Errorf("new queue: %w: nil store", ErrInvalid)
	}
	q := &Queue{store: store, recs: store, tenant: DefaultTenant, log: slog.Default(), clock: store.Clock(),
		limits: storex.Settings{Retention: store.Retention(), MaxRecordSize: store.MaxRecordSize()}}
	for _, o := range opts {
		if err := o(q); err != nil {
			return nil, fmt.Errorf("new queue: %w", err)
		}
	}
	return q, nil
}

// NewOnShards returns a Queue on a shard set: each job is kept on the
// shard its key is placed on (its id, under the queue's tenant), with its
// events, and is handed over when the set changes as the shard protocol
// allows (a live job stays on its old shard until it ends). A schedule's
// cursor is on the shard its name is placed on. The shards' shortest
// retention is the queue's. Per-key limits (Kind.Limits) need one
// cluster: a Worker on a shard set refuses kinds with limits.
func NewOnShards(set Shards, opts ...Option) (*Queue, error) {
	if v := reflect.ValueOf(set); set == nil || v.Kind() == reflect.Pointer && v.IsNil() {
		return nil, fmt.Errorf("new queue: %w: nil shard set", ErrInvalid)
	}
	q := &Queue{set: set, recs: set, limits: set.Settings(), tenant: DefaultTenant, log: slog.Default(), clock: set.Clock()}
	for _, o := range opts {
		if err := o(q); err != nil {
			return nil, fmt.Errorf("new queue: %w", err)
		}
	}
	return q, nil
}

// Shards is what a queue needs of a shard set beyond the store contract
// (idem.Store): the shards, each an etcd cluster's store, the shard that
// holds a key (where its job's events are kept), and values placed with
// keys (a schedule's cursor). *shard.Store implements it; package jobs
// knows no implementation.
type Shards interface {
	idem.Store
	// Shards names the set's shards; Shard returns one's store (nil while
	// it is not connected).
	Shards() []string
	Shard(name string) *etcdstore.Store
	// Holder returns the shard that holds key's record, and the record
	// (ErrNotFound, with key's home shard, when none does).
	Holder(ctx context.Context, key etcdstore.Key) (*etcdstore.Store, *etcdstore.Record, error)
	// GetValue and SetValue read and compare-and-set the value placed
	// with key, on the shard that holds it.
	GetValue(ctx context.Context, key etcdstore.Key) (storex.Placed, error)
	SetValue(ctx context.Context, key etcdstore.Key, value []byte, at storex.Placed) (storex.Placed, bool, error)
	// Settings are the limits every shard keeps at least; Clock is the
	// set's clock.
	Settings() storex.Settings
	Clock() clock.Clock
}

func (q *Queue) retention() time.Duration { return q.limits.Retention }
func (q *Queue) maxRecord() int           { return q.limits.MaxRecordSize }

// holder returns the store that holds job id's record (on a shard set, its
// shard: where its events are kept), with the record.
func (q *Queue) holder(ctx context.Context, id string) (*etcdstore.Store, *etcdstore.Record, error) {
	if q.set == nil {
		rec, err := q.store.Get(ctx, q.Key(id))
		return q.store, rec, err
	}
	return q.set.Holder(ctx, q.Key(id))
}

// Shards returns the queue's shard set, or nil on one cluster.
func (q *Queue) Shards() Shards { return q.set }

// Tenant returns the tenant the queue's jobs live under.
func (q *Queue) Tenant() string { return q.tenant }

// Store returns the store the queue keeps its jobs in (nil on a shard set:
// Shards).
func (q *Queue) Store() *etcdstore.Store { return q.store }

// Key returns the store key of job id.
func (q *Queue) Key(id string) etcdstore.Key { return etcdstore.Key{Tenant: q.tenant, ID: id} }

// SubmitOption configures Submit.
type SubmitOption func(*submitConfig)

type submitConfig struct {
	st     *state
	refuse bool
	window time.Duration
	fence  []etcdstore.EnqueueOption // a schedule's decided occurrence: its cursor
	// found, if set, learns whether the job returned is another
	// submission's (it existed: the fence's value was not written).
	found *bool

	submissionSet bool
}

// RunAt holds the job's first attempt back until t: it is Scheduled until
// then. t must lie within half the store's retention.
func RunAt(t time.Time) SubmitOption {
	return func(c *submitConfig) { c.st.NotBefore = ceilMilli(t) } // never before t
}

// RefuseDuplicate makes Submit refuse a job id that names a job already
// (submitted before, by anyone, and not forgotten): it returns that job
// and an error wrapping ErrDuplicate, instead of returning it as its own.
// A submission retried after a lost reply recognises its own job: only
// another submission's is a duplicate.
func RefuseDuplicate() SubmitOption { return func(c *submitConfig) { c.refuse = true } }

// SubmissionID names the submission, for RefuseDuplicate: a caller that
// retries Submit after an error whose outcome is unknown (etcdstore.
// ErrUnavailable: the job may have been written) passes the same id on
// every try, and gets its own job back instead of ErrDuplicate. 1 to 128
// bytes of visible ASCII, unique per submission (a request id). Without
// it, a Submit call recognises only its own retries.
func SubmissionID(id string) SubmitOption {
	return func(c *submitConfig) { c.st.Submission, c.submissionSet = id, true }
}

// DedupWindow makes a job id name one job for d after it was submitted,
// rather than for the store's whole retention: a Submit of an id whose job
// was submitted d or longer ago and has ended replaces it with a new job
// (of these params, which may differ). A job that has not ended is never
// replaced. Without it, or with d 0, an id names its job until the store
// forgets it.
func DedupWindow(d time.Duration) SubmitOption { return func(c *submitConfig) { c.window = d } }

// Submit submits job id of kind with params, to be run by a worker that
// registered kind (the completer of any Worker on this tenant finds it). It
// is idempotent: submitting an id again with the same kind and params
// changes nothing and returns the job as it stands, whatever state it is
// in (RefuseDuplicate makes that an error; DedupWindow lets an ended job's
// id name a new job); with other params it is an error wrapping
// etcdstore.ErrMismatch. One etcd Txn (etcdstore.Store.Enqueue) writes the
// job with its params, so any worker can run it, in any data centre. The
// submitter needs no Worker.
//
// id is 1 to 255 bytes of visible ASCII without '/', as any idempotency
// key. The job's params and the outputs of its steps share the store's
// record size limit.
func (q *Queue) Submit(ctx context.Context, id, kind string, params []byte, opts ...SubmitOption) (*Job, error) {
	key := q.Key(id)
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("submit: %w", err)
	}
	if err := validName(kind, 64, true); err != nil {
		return nil, fmt.Errorf("submit %s: %w: kind %q: %v", id, ErrInvalid, kind, err)
	}
	fp, err := fingerprint(kind, params)
	if err != nil {
		return nil, fmt.Errorf("submit %s: %w", id, err)
	}
	// Submission tells this call's job from one another submission
	// wrote: it stays in the job's state for good.
	cfg := submitConfig{st: &state{Kind: kind, Params: params, Submission: rand.Text(), Zone: q.zone}}
	for _, o := range opts {
		o(&cfg)
	}
	st := cfg.st
	if cfg.submissionSet {
		if err := validSubmission(st.Submission); err != nil {
			return nil, fmt.Errorf("submit %s: %w: submission id %q: %v", id, ErrInvalid, st.Submission, err)
		}
	}
	switch {
	case cfg.window < 0:
		return nil, fmt.Errorf("submit %s: %w: negative dedup window %v", id, ErrInvalid, cfg.window)
	case st.NotBefore != 0 && time.UnixMilli(st.NotBefore).After(q.clock.Now().Add(q.retention()/2)):
		return nil, fmt.Errorf("submit %s: %w: RunAt %v is past half the store's retention (%v): the job could be forgotten before it runs",
			id, ErrInvalid, time.UnixMilli(st.NotBefore), q.retention())
	}
	for round := 0; ; round++ {
		rec, err := q.recs.Enqueue(ctx, key, fp, st.encode(), cfg.fence...)
		if errors.Is(err, etcdstore.ErrTooLarge) {
			return nil, fmt.Errorf("submit %s: params of %d bytes do not fit the store's %d-byte records: %w", id, len(params), q.maxRecord(), err)
		}
		if cfg.window > 0 && round < 3 && (err == nil || errors.Is(err, etcdstore.ErrMismatch)) {
			// The job of this id may be past its window: replace it.
			if err != nil {
				if rec, err = q.recs.Get(ctx, key); err != nil {
					return nil, fmt.Errorf("submit: %w", err)
				}
			}
			if q.pastWindow(rec, st.Submission, cfg.window) {
				if _, err := q.recs.EvictIf(ctx, key, rec.Revision); err != nil {
					return nil, fmt.Errorf("submit %s: replacing the job past its dedup window: %w", id, err)
				}
				continue // evicted, or changed meanwhile: enqueue again
			}
			if rec.Fingerprint != fp {
				return nil, fmt.Errorf("submit: %w", &etcdstore.MismatchError{Key: key})
			}
		}
		if err != nil {
			return nil, fmt.Errorf("submit: %w", err)
		}
		j, err := FromRecord(rec, q.clock.Now())
		if err != nil {
			return nil, fmt.Errorf("submit: %w", err)
		}
		if cfg.refuse && !q.submittedBy(rec, st.Submission) {
			return j, fmt.Errorf("submit %s: %w (%s, submitted %v)", key, ErrDuplicate, j.State, j.Created.Format(time.RFC3339))
		}
		if cfg.found != nil {
			*cfg.found = !q.submittedBy(rec, st.Submission)
		}
		return j, nil
	}
}

func validSubmission(s string) error {
	if s == "" || len(s) > 128 {
		return fmt.Errorf("must be 1 to 128 bytes")
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("byte %#02x at offset %d is not visible ASCII", c, i)
		}
	}
	return nil
}

// submittedBy reports whether rec holds the job of the submission nonce.
func (q *Queue) submittedBy(rec *etcdstore.Record, nonce string) bool {
	raw := rec.Checkpoint
	if rec.State == etcdstore.Done && rec.Outcome != nil {
		raw = rec.Outcome.Body
	}
	st, err := decodeState(raw)
	return err == nil && st.Submission == nonce
}

// pastWindow reports whether rec's job is another submission's, ended, and
// was submitted window or longer ago.
func (q *Queue) pastWindow(rec *etcdstore.Record, nonce string, window time.Duration) bool {
	return rec.State == etcdstore.Done && !q.submittedBy(rec, nonce) && !q.clock.Now().Before(rec.Created.Add(window))
}

// fingerprint is what a job's key is claimed with: its kind and params, in
// canonical JSON form when the params are JSON.
func fingerprint(kind string, params []byte) (etcdstore.Fingerprint, error) {
	k, _ := json.Marshal(kind)
	var env []byte
	if len(params) > 0 && json.Valid(params) {
		env = fmt.Appendf(nil, `{"job":%s,"params":%s}`, k, params)
	} else {
		env = fmt.Appendf(nil, `{"job":%s,"params_base64":%q}`, k, base64.StdEncoding.EncodeToString(params))
	}
	return etcdstore.FingerprintOf(env)
}

// Get returns job id, read linearizably. A job that does not exist (or
// whose retention passed) is an error wrapping etcdstore.ErrNotFound.
func (q *Queue) Get(ctx context.Context, id string) (*Job, error) {
	rec, err := q.recs.Get(ctx, q.Key(id))
	if err != nil {
		return nil, err
	}
	return FromRecord(rec, q.clock.Now())
}

// ListOptions selects jobs for List.
type ListOptions struct {
	// State keeps only jobs in that state; empty keeps all.
	State State
	// After resumes a listing after this job id (the last of the previous
	// page).
	After string
	// Limit is the page size: default 100, at most etcdstore.MaxListLimit.
	Limit int
}

// List returns the queue's jobs in id order, a page at a time: pass the
// last id returned as After for the next page. A page shorter than Limit
// is the last. Records of the tenant that hold no job are skipped.
func (q *Queue) List(ctx context.Context, o ListOptions) ([]*Job, error) {
	limit := o.Limit
	if limit <= 0 {
		limit = 100
	}
	if limit > etcdstore.MaxListLimit {
		return nil, fmt.Errorf("list: %w: limit %d, at most %d", ErrInvalid, limit, etcdstore.MaxListLimit)
	}
	var after *etcdstore.Key
	if o.After != "" {
		k := q.Key(o.After)
		after = &k
	}
	var out []*Job
	var listErr error
	for len(out) < limit {
		recs, err := q.recs.List(ctx, q.tenant, etcdstore.ListOptions{After: after, Limit: etcdstore.MaxListLimit})
		if err != nil && len(recs) == 0 {
			return out, err
		}
		if err != nil {
			listErr = err // records that did not decode, counted after the page
		}
		for _, rec := range recs {
			if j, err := FromRecord(rec, q.clock.Now()); err == nil && (o.State == "" || j.State == o.State) {
				out = append(out, j)
				if len(out) == limit {
					return out, listErr
				}
			}
		}
		if len(recs) < etcdstore.MaxListLimit {
			break
		}
		k := recs[len(recs)-1].Key
		after = &k
	}
	return out, listErr
}

// Wait blocks, on an etcd Watch, until job id has ended (succeeded, failed
// or cancelled) or is parked, and returns it then; or until ctx ends. A job
// that does not exist is an error wrapping etcdstore.ErrNotFound.
func (q *Queue) Wait(ctx context.Context, id string) (*Job, error) {
	key := q.Key(id)
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("wait: %w", err)
	}
	for {
		st := q.store
		var err error
		if q.set != nil {
			// The shard that holds it (or its home, when none does yet).
			if st, _, err = q.set.Holder(ctx, key); err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
				st = nil
			}
		}
		var feed storex.Feed
		if st != nil {
			feed, err = storex.Follow(st, ctx, q.tenant, storex.FollowOptions{ID: id})
		}
		if st == nil || err != nil {
			if ctx.Err() != nil {
				return nil, context.Cause(ctx)
			}
			if err := clock.Sleep(q.clock, ctx, time.Second); err != nil {
				return nil, err
			}
			continue
		}
		if recs := feed.Records(); len(recs) == 0 {
			feed.Close()
			return nil, fmt.Errorf("wait %s: %w", key, etcdstore.ErrNotFound)
		} else if j, done, err := q.waitOver(recs[0]); err != nil || done {
			feed.Close()
			return j, err
		}
		j, done, err := q.waitFeed(ctx, key, feed)
		feed.Close()
		if done || ctx.Err() != nil {
			return j, err
		}
		// The watch broke or stalled: read again.
	}
}

// waitFeed follows feed until job key is over, or the feed breaks.
func (q *Queue) waitFeed(ctx context.Context, key etcdstore.Key, feed storex.Feed) (*Job, bool, error) {
	for {
		changes, err := feed.Next(ctx)
		if err != nil {
			return nil, ctx.Err() != nil, err
		}
		for _, c := range changes {
			switch {
			case c.Err != nil:
				return nil, true, c.Err
			case c.Record == nil:
				return nil, true, fmt.Errorf("wait %s: %w", key, etcdstore.ErrNotFound)
			}
			if j, done, err := q.waitOver(c.Record); err != nil || done {
				return j, true, err
			}
		}
	}
}

// waitOver decodes a job's record and says whether Wait is over.
func (q *Queue) waitOver(rec *etcdstore.Record) (*Job, bool, error) {
	if rec.Fence || !q.clock.Now().Before(rec.Expires) { // gone, as the kernel's Record.Expired says
		return nil, true, fmt.Errorf("wait %s: %w", rec.Key, etcdstore.ErrNotFound)
	}
	j, err := FromRecord(rec, q.clock.Now())
	if err != nil {
		return nil, true, err
	}
	return j, j.State.Final() || j.State == Parked, nil
}

// Retry gives a parked job a new series of attempts: it is queued again,
// resuming at its first unfinished step, with its attempt count reset. It
// takes the job over (a claim with a greater token) to rewrite it, so it
// needs a session like any claim. A job that is not parked is an error
// wrapping ErrNotParked (ErrFinal once it ended).
func (q *Queue) Retry(ctx context.Context, id string) (*Job, error) {
	return q.operate(ctx, "retry", id, func(j *Job) error {
		if j.State != Parked {
			return fmt.Errorf("%w: %s", ErrNotParked, j.State)
		}
		return nil
	}, func(c *etcdstore.Claim, st *state) (etcdstore.Outcome, etcdstore.End, error) {
		if !st.Parked {
			st.Base++ // this takeover was no attempt
			return etcdstore.Outcome{}, etcdstore.EndAbandon, ErrNotParked
		}
		st.Parked, st.NotBefore, st.Base = false, 0, c.Takeovers()
		return etcdstore.Outcome{}, etcdstore.EndAbandon, nil
	})
}

// Cancel ends a job that no live worker runs (queued, scheduled or parked)
// as cancelled, with reason saved: its remaining steps never run, its
// finished ones stay done (Cancel runs no compensation). A running job is
// an error wrapping ErrRunning; an ended one, ErrFinal; a job whose
// cancelled end cannot fit the record (see fit), an error wrapping
// etcdstore.ErrTooLarge, and the job is left as it was.
func (q *Queue) Cancel(ctx context.Context, id, reason string) (*Job, error) {
	if reason == "" {
		reason = "cancelled"
	}
	if len(reason) > maxErrorLen {
		reason = reason[:maxErrorLen] + "..."
	}
	return q.operate(ctx, "cancel", id, nil, func(c *etcdstore.Claim, st *state) (etcdstore.Outcome, etcdstore.End, error) {
		end := st.clone()
		end.Outcome, end.Parked, end.NotBefore = Cancelled, false, 0
		out, ok := fit(end, "cancelled: "+reason, q.maxRecord(), len(end.Done))
		if !ok {
			// Saved anyway, the store would put "too large" in the job's
			// place, losing its kind, parameters and finished steps. The
			// job is left as it was: this takeover was no attempt.
			st.Base++
			return etcdstore.Outcome{}, etcdstore.EndAbandon, fmt.Errorf("%w: the cancelled job's end would be %d bytes, limit %d",
				etcdstore.ErrTooLarge, len(out.Body)+len(out.Err), q.maxRecord())
		}
		return out, etcdstore.EndSave, nil
	})
}

// operate takes job id over to rewrite it as op says: the rewrite of an
// in-flight job goes into a checkpoint when op abandons the claim, into the
// outcome when it saves one.
func (q *Queue) operate(ctx context.Context, name, id string, check func(*Job) error, op func(*etcdstore.Claim, *state) (etcdstore.Outcome, etcdstore.End, error)) (*Job, error) {
	key := q.Key(id)
	rec, err := q.recs.Get(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	j, err := FromRecord(rec, q.clock.Now())
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", name, err)
	case j.State.Final():
		return j, fmt.Errorf("%s %s: %w: %s", name, key, ErrFinal, j.State)
	}
	// A running job's owner may be dead: the claim decides (a conflict
	// while it lives, a takeover once it is gone).
	if check != nil {
		if err := check(j); err != nil {
			return j, fmt.Errorf("%s %s: %w", name, key, err)
		}
	}
	var opErr error
	res, err := q.recs.Run(ctx, key, rec.Fingerprint, func(wctx context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		st, derr := decodeState(c.LastCheckpoint())
		if derr != nil {
			opErr = derr
			return etcdstore.Outcome{}, etcdstore.EndAbandon
		}
		out, end, err := op(c, st)
		opErr = err
		if end == etcdstore.EndAbandon {
			// Rewritten in a checkpoint, then abandoned for the next
			// worker; a checkpoint that did not land leaves the job as
			// it was (one attempt more counted), which is safe.
			if err := checkpoint(context.WithoutCancel(wctx), q.clock, c, st.encode(), nil); err != nil {
				opErr = errors.Join(opErr, err)
			}
		}
		return out, end
	}, storex.WithoutCreate()) // a job gone since the Get is not made again, empty
	var ce *etcdstore.ConflictError
	switch {
	case errors.As(err, &ce):
		return nil, fmt.Errorf("%s %s: %w", name, key, ErrRunning)
	case err != nil:
		return nil, fmt.Errorf("%s: %w", name, err)
	case res.Replayed:
		j, _ := FromRecord(&etcdstore.Record{Key: key, State: etcdstore.Done, Outcome: &res.Outcome, Token: res.Token}, q.clock.Now())
		return j, fmt.Errorf("%s %s: %w", name, key, ErrFinal)
	case opErr != nil:
		return nil, fmt.Errorf("%s %s: %w", name, key, opErr)
	}
	return q.Get(ctx, id)
}
