package etcdstore

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Get returns the record of key with a linearizable read, or an error
// wrapping ErrNotFound when there is none or its retention has passed.
func (s *Store) Get(ctx context.Context, key Key) (*Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("get: %w", err)
	}
	rec, _, err := s.get(ctx, key)
	if err != nil {
		return nil, err
	}
	if rec == nil || rec.expired(s.now()) {
		return nil, fmt.Errorf("get %s: %w", key, ErrNotFound)
	}
	return rec, nil
}

// Evict deletes key's record whatever its state, so the next request with the
// key runs the work again. It is an operator's tool: evicting a done key
// forgets its outcome, and evicting an in-flight key fences its owner out (its
// Complete will fail with ErrFenced). It returns an error wrapping
// ErrNotFound when there was nothing to delete.
func (s *Store) Evict(ctx context.Context, key Key) error {
	if err := key.Validate(); err != nil {
		return fmt.Errorf("evict: %w", err)
	}
	resp, err := s.client.Delete(ctx, s.ks.record(key))
	if err != nil {
		return unavailable("evict", key, err)
	}
	if resp.Deleted == 0 {
		return fmt.Errorf("evict %s: %w", key, ErrNotFound)
	}
	return nil
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
}

// MaxListLimit is the largest page List returns.
const MaxListLimit = 1000

// List returns records of tenant (every tenant when tenant is empty) in key
// order, skipping expired ones, one page at a time: pass the last key
// returned as After to get the next page. A page shorter than Limit is the
// last. Records that cannot be decoded are skipped and counted in the error
// (which wraps ErrCorrupt) after the page.
func (s *Store) List(ctx context.Context, tenant string, o ListOptions) ([]*Record, error) {
	prefix := s.ks.records()
	if tenant != "" {
		if err := ValidateTenant(tenant); err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		prefix = s.ks.tenant(tenant)
	}
	switch {
	case o.Limit == 0:
		o.Limit = 100
	case o.Limit < 0 || o.Limit > MaxListLimit:
		return nil, fmt.Errorf("list: %w: limit %d must be between 1 and %d", ErrInvalidArgument, o.Limit, MaxListLimit)
	}
	if o.State != "" && o.State != InFlight && o.State != Done {
		return nil, fmt.Errorf("list: %w: state %q must be %q or %q", ErrInvalidArgument, o.State, InFlight, Done)
	}
	start := prefix
	if o.After != nil {
		if err := o.After.Validate(); err != nil {
			return nil, fmt.Errorf("list: after: %w", err)
		}
		if tenant != "" && o.After.tenant() != tenant {
			return nil, fmt.Errorf("list: %w: after key of tenant %q while listing %q", ErrInvalidArgument, o.After.tenant(), tenant)
		}
		start = s.ks.record(*o.After) + "\x00"
	}
	end := clientv3.GetPrefixRangeEnd(prefix)
	var out []*Record
	corrupt := 0
	for len(out) < o.Limit {
		resp, err := s.client.Get(ctx, start, clientv3.WithRange(end), clientv3.WithLimit(int64(o.Limit)))
		if err != nil {
			return nil, fmt.Errorf("list %q: %w: %w", tenant, ErrUnavailable, err)
		}
		now := s.now()
		for _, kv := range resp.Kvs {
			k, ok := s.ks.parseRecord(string(kv.Key))
			if !ok {
				corrupt++
				continue
			}
			rec, err := decode(k, kv)
			if err != nil {
				corrupt++
				continue
			}
			if rec.expired(now) || o.State != "" && rec.State != o.State {
				continue
			}
			out = append(out, rec)
			if len(out) == o.Limit {
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
