package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/dict"
	"github.com/idem-dev/idem/etcdstore/internal/kpb"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"

	"github.com/idem-dev/idem/internal/storeext"
)

// Admin reads and evicts records without a session: for operators' tools,
// which must not hold leases or owner keys. It starts no goroutines. A Store
// offers the same methods.
type Admin struct {
	client  *clientv3.Client
	ks      keyspace
	clock   clock.Clock
	timeout time.Duration // per etcd request; 0: none
	dicts   *dict.Set     // the compression dictionaries met (format 3)
	log     *slog.Logger
}

func (a *Admin) now() time.Time { return a.clock.Now() }

// bound limits one call of the store, its retries included, to the
// request timeout (or to the caller's deadline, when that comes first).
func (a *Admin) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if a.timeout <= 0 {
		return ctx, func() {}
	}
	if d, ok := ctx.Deadline(); ok && d.Sub(a.clock.Now()) <= a.timeout {
		return ctx, func() {}
	}
	return a.clock.WithTimeout(ctx, a.timeout)
}

// try prepares the context of one etcd request within a bounded call. It
// requires a leader: a member cut off from the leader answers at once ("no
// leader") instead of holding the request. And it gets a quarter of the
// request timeout: a member that hangs (paused, or behind a network that
// silently drops) costs that quarter, and the retry, a new RPC, goes to
// the next member. The store retries its own conditional writes; they are
// recognised by their attempt id when an earlier try landed.
func (a *Admin) try(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx = clientv3.WithRequireLeader(ctx)
	if a.timeout <= 0 {
		return ctx, func() {}
	}
	return a.clock.WithTimeout(ctx, a.timeout/tryShare)
}

// tryShare: one etcd request gets 1/tryShare of the request timeout.
const tryShare = 4

// retry runs read, one etcd read, with a try context until it succeeds,
// fails for a reason a retry cannot mend, or ctx ends. It returns the last
// error.
func (a *Admin) retry(ctx context.Context, read func(context.Context) error) error {
	for n := 0; ; n++ {
		tctx, cancel := a.try(ctx)
		err := read(tctx)
		cancel()
		if err == nil || !retryable(ctx, err) || !a.backoff(ctx, n) {
			return err
		}
	}
}

// NewAdmin returns an Admin for the store under the prefix set by opts.
func NewAdmin(client *clientv3.Client, opts ...AdminOption) (*Admin, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil etcd client", ErrInvalidArgument)
	}
	c := config{prefix: DefaultPrefix, requestTimeout: DefaultRequestTimeout, clock: clock.Real}
	for _, o := range opts {
		if err := o.apply(&c); err != nil {
			return nil, fmt.Errorf("new admin: %w", err)
		}
	}
	a := &Admin{client: client, ks: keyspace{prefix: c.prefix}, clock: c.clock, timeout: c.requestTimeout, log: slog.New(slog.DiscardHandler)}
	a.dicts = dict.New(dict.Config{Client: client, Clock: c.clock, Log: a.log, Try: a.try, Prefix: a.ks.dictionaries()})
	return a, nil
}

// Get returns the record of key with a linearizable read, or an error
// wrapping ErrNotFound when there is none or its retention has passed.
func (a *Admin) Get(ctx context.Context, key Key) (*Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("get: %w", err)
	}
	rec, _, err := a.get(ctx, key)
	if err != nil {
		return nil, err
	}
	if rec == nil || rec.expired(a.now()) {
		return nil, fmt.Errorf("get %s: %w", key, ErrNotFound)
	}
	return rec, nil
}

// peek returns the record of key as etcd holds it, with a linearizable
// read, past its retention too (its Expires says so) until it is deleted;
// an error wrapping ErrNotFound when etcd holds none. A record past its
// retention can still be taken over by a claim that read it before it
// expired, or on a clock behind this one: EvictIf with its Revision
// forgets it for good. Package jobs does so before it takes a schedule's
// previous job for ended.
func (a *Admin) peek(ctx context.Context, key Key) (*Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("peek: %w", err)
	}
	rec, _, err := a.get(ctx, key)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		return nil, fmt.Errorf("peek %s: %w", key, ErrNotFound)
	}
	return rec, nil
}

// get reads the record with a linearizable Get. It returns nil when absent,
// and the revision of the read.
func (a *Admin) get(ctx context.Context, k Key) (*Record, int64, error) {
	ctx, cancel := a.bound(ctx)
	defer cancel()
	var resp *clientv3.GetResponse
	err := a.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = a.client.Get(ctx, a.ks.record(k))
		return err
	})
	if err != nil {
		return nil, 0, unavailable("get", k, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, resp.Header.Revision, nil
	}
	rec, err := a.decode(ctx, k, resp.Kvs[0])
	if err != nil {
		return nil, 0, fmt.Errorf("get %s: %w", k, err)
	}
	return rec, resp.Header.Revision, nil
}

// Evict deletes key's record whatever its state, so the next request with the
// key runs the work again. It is an operator's tool: evicting a done key
// forgets its outcome, and evicting an in-flight key fences its owner out (its
// Complete will fail with ErrFenced). It returns an error wrapping
// ErrNotFound when there was nothing to delete.
func (a *Admin) Evict(ctx context.Context, key Key) error {
	_, err := a.evict(ctx, key)
	return err
}

// EvictIf deletes key's record if it is still the one written at revision
// rev (Record.Revision), and reports whether key has no record now: false
// when a record was written since (it is left alone). Package shard's
// drain deletes, this way, the expired records of keys handed over, so
// that no takeover read before can land after it.
func (a *Admin) EvictIf(ctx context.Context, key Key, rev int64) (bool, error) {
	gone, _, err := a.evictIf(ctx, key, rev)
	return gone, err
}

func (a *Admin) evictIf(ctx context.Context, key Key, rev int64) (gone bool, at int64, err error) {
	if err := key.Validate(); err != nil {
		return false, 0, fmt.Errorf("evict: %w", err)
	}
	if rev <= 0 {
		return false, 0, fmt.Errorf("evict %s: %w: revision %d", key, ErrInvalidArgument, rev)
	}
	ctx, cancel := a.bound(ctx)
	defer cancel()
	t := kernel.EvictIf(a.ks.record(key), rev)
	// Safe to retry: after a try whose outcome is unknown, the record is
	// either gone (that try deleted it) or still at rev.
	err = a.retry(ctx, func(ctx context.Context) error {
		resp, err := a.client.Txn(ctx).If(kpb.Cmps(t.If)...).Then(clientv3.OpDelete(t.Then[0].Key)).
			Else(clientv3.OpGet(t.Else[0].Key, clientv3.WithCountOnly())).Commit()
		if err != nil {
			return err
		}
		gone = kernel.EvictIfGone(resp.Succeeded, resp.Responses[0].GetResponseRange().GetCount())
		at = resp.Header.Revision
		return nil
	})
	if err != nil {
		return false, 0, unavailable("evict", key, err)
	}
	return gone, at, nil
}

// evict deletes key's record and returns a revision at or after the
// deletion.
func (a *Admin) evict(ctx context.Context, key Key) (int64, error) {
	if err := key.Validate(); err != nil {
		return 0, fmt.Errorf("evict: %w", err)
	}
	ctx, cancel := a.bound(ctx)
	defer cancel()
	// A delete is safe to retry; after a try whose outcome is unknown,
	// finding nothing to delete means that try deleted it.
	var deleted, unknown bool
	var rev int64
	err := a.retry(ctx, func(ctx context.Context) error {
		resp, err := a.client.Delete(ctx, a.ks.record(key))
		if err != nil {
			unknown = unknown || mayHaveLanded(err)
			return err
		}
		deleted, rev = resp.Deleted > 0 || unknown, resp.Header.Revision
		return nil
	})
	if err != nil {
		return 0, unavailable("evict", key, err)
	}
	if !deleted {
		return rev, fmt.Errorf("evict %s: %w", key, ErrNotFound)
	}
	return rev, nil
}

// page reads one page of a listing, bounded like one call.
func (a *Admin) page(ctx context.Context, read func(context.Context) error) error {
	ctx, cancel := a.bound(ctx)
	defer cancel()
	return a.retry(ctx, read)
}

// ListOptions selects records for List.
type ListOptions struct {
	// State keeps only records in that state; empty keeps both.
	State State
	// After resumes a listing after this key (the last key of the previous
	// page). Its Tenant must be the listed tenant when one is given.
	After *Key
	// Limit is the page size: default 100, at most 1000.
	Limit int
	// Live leaves Moved records out (package shard's hand-over records),
	// as State does.
	Live bool
	// Expired keeps records whose retention passed too, until they are
	// deleted.
	Expired bool
}

// MaxListLimit is the largest page List returns.
const MaxListLimit = 1000

// List returns records of tenant (every tenant when tenant is empty) in key
// order, skipping expired ones, one page at a time: pass the last key
// returned as After to get the next page. A page shorter than Limit is the
// last. Records that cannot be decoded are skipped and counted in the error
// (which wraps ErrCorrupt) after the page.
func (a *Admin) List(ctx context.Context, tenant string, o ListOptions) ([]*Record, error) {
	start, end, err := a.listRange(tenant, &o)
	if err != nil {
		return nil, fmt.Errorf("list: %w", err)
	}
	var out []*Record
	corrupt := 0
	for len(out) < o.Limit {
		var resp *clientv3.GetResponse
		err := a.page(ctx, func(ctx context.Context) (err error) {
			resp, err = a.client.Get(ctx, start, clientv3.WithRange(end), clientv3.WithLimit(int64(o.Limit)))
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("list %q: %w: %w", tenant, ErrUnavailable, err)
		}
		now := a.now()
		for _, kv := range resp.Kvs {
			rec, err := a.listed(ctx, kv)
			switch {
			case err != nil && !errors.Is(err, ErrCorrupt):
				// Not the record's fault (a dictionary that could not be
				// read, a closed store): say what it is.
				return nil, fmt.Errorf("list %q: %w", tenant, err)
			case err != nil:
				corrupt++
				continue
			}
			if !o.Expired && rec.expired(now) || o.State != "" && rec.State != o.State || o.Live && rec.State == Moved {
				continue
			}
			if out = append(out, rec); len(out) == o.Limit {
				break
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	if corrupt > 0 {
		return out, fmt.Errorf("list %q: %w: %d records could not be read", tenant, ErrCorrupt, corrupt)
	}
	return out, nil
}

// listRange checks a List's options (filling the default limit) and
// returns the range of keys it lists.
func (a *Admin) listRange(tenant string, o *ListOptions) (start, end string, err error) {
	prefix := a.ks.records()
	if tenant != "" {
		if err := ValidateTenant(tenant); err != nil {
			return "", "", err
		}
		prefix = a.ks.tenant(tenant)
	}
	switch {
	case o.Limit == 0:
		o.Limit = 100
	case o.Limit < 0 || o.Limit > MaxListLimit:
		return "", "", fmt.Errorf("%w: limit %d must be between 1 and %d", ErrInvalidArgument, o.Limit, MaxListLimit)
	}
	if o.State != "" && o.State != InFlight && o.State != Done {
		return "", "", fmt.Errorf("%w: state %q must be %q or %q", ErrInvalidArgument, o.State, InFlight, Done)
	}
	start = prefix
	if o.After != nil {
		if err := o.After.Validate(); err != nil {
			return "", "", fmt.Errorf("after: %w", err)
		}
		if tenant != "" && o.After.tenant() != tenant {
			return "", "", fmt.Errorf("%w: after key of tenant %q while listing %q", ErrInvalidArgument, o.After.tenant(), tenant)
		}
		start = a.ks.record(*o.After) + "\x00"
	}
	return start, clientv3.GetPrefixRangeEnd(prefix), nil
}

// listed decodes a record a List read (ErrCorrupt: its key is not a
// record's, or it does not decode).
func (a *Admin) listed(ctx context.Context, kv *mvccpb.KeyValue) (*Record, error) {
	k, ok := a.ks.parseRecord(string(kv.Key))
	if !ok {
		return nil, fmt.Errorf("%w: key %q", ErrCorrupt, kv.Key)
	}
	return a.decode(ctx, k, kv)
}

// storeStats counts what the store holds (storeext.Stats).
type storeStats = storeext.Stats

// stats counts records, live sessions and retention leases, reading the
// state of at most maxScan records (0: all) in pages of 1000.
func (a *Admin) stats(ctx context.Context, maxScan int64) (storeStats, error) {
	var st storeStats
	for _, c := range []struct {
		prefix string
		n      *int64
	}{{a.ks.records(), &st.Records}, {a.ks.owners(), &st.Owners}, {a.ks.buckets(), &st.Leases}} {
		var resp *clientv3.GetResponse
		err := a.page(ctx, func(ctx context.Context) (err error) {
			resp, err = a.client.Get(ctx, c.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
			return err
		})
		if err != nil {
			return st, fmt.Errorf("stats: %w: %w", ErrUnavailable, err)
		}
		*c.n = resp.Count
	}
	start, end := a.ks.records(), clientv3.GetPrefixRangeEnd(a.ks.records())
	now := a.now()
	for maxScan == 0 || st.Scanned < maxScan {
		var resp *clientv3.GetResponse
		err := a.page(ctx, func(ctx context.Context) (err error) {
			resp, err = a.client.Get(ctx, start, clientv3.WithRange(end), clientv3.WithLimit(1000))
			return err
		})
		if err != nil {
			return st, fmt.Errorf("stats: %w: %w", ErrUnavailable, err)
		}
		for _, kv := range resp.Kvs {
			if maxScan > 0 && st.Scanned == maxScan {
				return st, nil
			}
			k, _ := a.ks.parseRecord(string(kv.Key))
			rec, err := a.decode(ctx, k, kv)
			st.Scanned++
			switch {
			case err != nil && !errors.Is(err, ErrCorrupt):
				return st, fmt.Errorf("stats: %w", err)
			case err != nil:
			case rec.expired(now):
				st.Expired++
			case rec.State == Done:
				st.Done++
			default:
				st.InFlight++
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	return st, nil
}

// Client returns the etcd client the Admin reads with.
func (a *Admin) Client() *clientv3.Client { return a.client }

// Prefix returns the etcd key prefix under which the store keeps everything
// (WithPrefix).
func (a *Admin) Prefix() string { return a.ks.prefix }

// ownerLives reports, with a linearizable read, whether owner (a
// Record's Owner: a store's session) is alive: while it is, the claims it
// holds are not stale, and nobody takes them over before their deadline.
// DeadlineOwner, who has no session, is an ErrInvalidArgument.
func (a *Admin) ownerLives(ctx context.Context, owner string) (bool, error) {
	if owner == "" || owner == deadlineOwner || strings.ContainsRune(owner, '/') {
		return false, fmt.Errorf("owner alive %q: %w: not an owner id", owner, ErrInvalidArgument)
	}
	var resp *clientv3.GetResponse
	err := a.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = a.client.Get(ctx, a.ks.owner(owner), clientv3.WithCountOnly())
		return err
	})
	if err != nil {
		return false, fmt.Errorf("owner alive: %w: %w", ErrUnavailable, err)
	}
	return resp.Count > 0, nil
}

// claimHeld reports, with a linearizable read, whether key's record is in
// flight and held (it has an owner) by the claim whose fencing token is
// token. False means that claim can write nothing more: its record was
// taken over (a greater token), given back, ended or deleted. Expiry is
// not judged here (clocks differ): a held record counts as held.
func (a *Admin) claimHeld(ctx context.Context, key Key, token fencing.Token) (bool, error) {
	if err := key.Validate(); err != nil {
		return false, fmt.Errorf("claim held: %w", err)
	}
	rec, _, err := a.get(ctx, key)
	if err != nil {
		return false, err
	}
	return rec != nil && rec.State == InFlight && rec.Owner != "" && rec.Token == token, nil
}
