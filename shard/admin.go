package shard

import (
	"context"
	"fmt"
	"sort"

	"github.com/idem-dev/idem/etcdstore"
)

// Admin reads and evicts records across a shard set without sessions, for
// operators' tools (idem get, ls, evict, status): etcdstore.Admin on every
// shard, with the placement to find each key.
type Admin struct {
	names     []string
	admins    map[string]*etcdstore.Admin
	placement Placement
	previous  *Placement
}

// NewAdmin returns an Admin over cfg's shards.
func NewAdmin(cfg Config, opts ...etcdstore.AdminOption) (*Admin, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	a := &Admin{admins: map[string]*etcdstore.Admin{}, placement: cfg.Placement, previous: cfg.Previous}
	for _, sh := range cfg.Shards {
		adm, err := etcdstore.NewAdmin(sh.Client, opts...)
		if err != nil {
			return nil, fmt.Errorf("shard %s: %w", sh.Name, err)
		}
		a.names = append(a.names, sh.Name)
		a.admins[sh.Name] = adm
	}
	if len(a.placement.Shards) == 0 {
		a.placement.Shards = a.names
	}
	return a, nil
}

// Shards returns the shards' names; Shard one shard's Admin.
func (a *Admin) Shards() []string                   { return append([]string(nil), a.names...) }
func (a *Admin) Shard(name string) *etcdstore.Admin { return a.admins[name] }

func (a *Admin) locate(ctx context.Context, key etcdstore.Key) (string, *etcdstore.Record, error) {
	return locate(ctx, key, &a.placement, a.previous, func(n string) getter {
		if adm := a.admins[n]; adm != nil {
			return adm
		}
		return nil
	})
}

// Get returns key's record from the shard that holds it.
func (a *Admin) Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("get: %w", err)
	}
	_, rec, err := a.locate(ctx, key)
	return rec, err
}

// Evict deletes key's record on the shard that holds it.
func (a *Admin) Evict(ctx context.Context, key etcdstore.Key) error {
	if err := key.Validate(); err != nil {
		return fmt.Errorf("evict: %w", err)
	}
	name, _, err := a.locate(ctx, key)
	if err != nil {
		return err
	}
	return a.admins[name].Evict(ctx, key)
}

// List is Store.List without a session.
func (a *Admin) List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error) {
	return list(ctx, a.names, func(n string) lister { return a.admins[n] }, tenant, o)
}

type lister interface {
	List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error)
}

// list merges the shards' listings, leaving Moved records out, sorted by
// tenant and key, at most o.Limit (default 100) of them: a page, as one
// store's List, that o.After resumes.
func list(ctx context.Context, names []string, shard func(string) lister, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error) {
	var out []*etcdstore.Record
	for _, n := range names {
		recs, err := shard(n).List(ctx, tenant, o)
		if err != nil {
			return nil, fmt.Errorf("shard %s: %w", n, err)
		}
		for _, r := range recs {
			if r.State != etcdstore.Moved {
				out = append(out, r)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Key.Tenant != out[j].Key.Tenant {
			return out[i].Key.Tenant < out[j].Key.Tenant
		}
		return out[i].Key.ID < out[j].Key.ID
	})
	limit := o.Limit
	if limit == 0 {
		limit = 100
	}
	if len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}
