package shard

import (
	"context"
	"fmt"
	"sort"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// Admin reads and evicts records across a shard set without sessions, for
// operators' tools (idem get, ls, evict, status): etcdstore.Admin on every
// shard, with the set in force to find each key.
type Admin struct {
	names  []string
	admins map[string]*etcdstore.Admin
	want   Set
}

// NewAdmin returns an Admin over cfg's shards (each needs its Client).
func NewAdmin(cfg Config, opts ...etcdstore.AdminOption) (*Admin, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	a := &Admin{admins: map[string]*etcdstore.Admin{}, want: Set{Generation: max(cfg.Generation, 1), Placement: cfg.Placement, Previous: cfg.Previous}}
	for _, sh := range cfg.Shards {
		if sh.Client == nil {
			return nil, fmt.Errorf("shard %s: %w: no etcd client", sh.Name, etcdstore.ErrInvalidArgument)
		}
		adm, err := etcdstore.NewAdmin(sh.Client, opts...)
		if err != nil {
			return nil, fmt.Errorf("shard %s: %w", sh.Name, err)
		}
		a.names = append(a.names, sh.Name)
		a.admins[sh.Name] = adm
	}
	if len(a.want.Placement.Shards) == 0 {
		a.want.Placement.Shards = a.names
	}
	return a, nil
}

// Shards returns the shards' names; Shard one shard's Admin.
func (a *Admin) Shards() []string                   { return append([]string(nil), a.names...) }
func (a *Admin) Shard(name string) *etcdstore.Admin { return a.admins[name] }

// SetStatus is what one shard records of the shard set.
type SetStatus struct {
	// Set is the set the shard holds (Generation 0: none).
	Set Set
	// Drained is the generation the shard was last drained for (0: none).
	Drained int64
}

// Sets reads what every shard records of the shard set: a shard that
// cannot be read is missing from the map and named in the error.
func (a *Admin) Sets(ctx context.Context) (map[string]SetStatus, error) {
	out := map[string]SetStatus{}
	var errs []error
	for _, n := range a.names {
		st, err := a.setOf(ctx, n)
		if err != nil {
			errs = append(errs, fmt.Errorf("shard %s: %w", n, err))
			continue
		}
		out[n] = st
	}
	if len(errs) > 0 {
		return out, errs[0]
	}
	return out, nil
}

// SetOf reads what shard name records of the shard set.
func (a *Admin) SetOf(ctx context.Context, name string) (SetStatus, error) {
	if a.admins[name] == nil {
		return SetStatus{}, fmt.Errorf("shard %s: %w: not configured", name, etcdstore.ErrInvalidArgument)
	}
	return a.setOf(ctx, name)
}

func (a *Admin) setOf(ctx context.Context, name string) (SetStatus, error) {
	adm := a.admins[name]
	v, err := storex.GetValue(adm, ctx, storex.ShardSetValue)
	if err != nil {
		return SetStatus{}, err
	}
	var st SetStatus
	if v.Revision != 0 {
		if st.Set, err = decodeSet(v.Value); err != nil {
			return SetStatus{}, err
		}
	}
	d, err := storex.GetValue(adm, ctx, drainedValue)
	if err != nil {
		return SetStatus{}, err
	}
	if m, ok := parseMark(d); ok {
		st.Drained = m.Generation
	}
	return st, nil
}

// inForce returns the newest set any shard records (the configuration's
// when none does), and the shards known drained for it.
func (a *Admin) inForce(ctx context.Context) (Set, map[string]bool, error) {
	sets, err := a.Sets(ctx)
	best, found := a.want, false
	for _, st := range sets {
		if st.Set.Generation > 0 && (!found || st.Set.after(best)) {
			best, found = st.Set, true
		}
	}
	if !found && err != nil {
		return Set{}, nil, err
	}
	drained := map[string]bool{}
	for n, st := range sets {
		drained[n] = st.Drained == best.Generation
	}
	return best, drained, nil
}

func (a *Admin) locate(ctx context.Context, key etcdstore.Key) (string, *etcdstore.Record, error) {
	set, drained, err := a.inForce(ctx)
	if err != nil {
		return "", nil, err
	}
	return locate(ctx, key, set, func(n string) bool { return drained[n] }, func(n string) (getter, error) {
		if adm := a.admins[n]; adm != nil {
			return adm, nil
		}
		return nil, fmt.Errorf("shard %s: %w: the shard set in force names it, and no connection settings for it were given", n, etcdstore.ErrUnavailable)
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
	return list(ctx, a.names, func(n string) (lister, error) { return a.admins[n], nil }, tenant, o)
}

type lister interface {
	List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error)
}

// list merges the shards' listings, leaving Moved records out (each shard
// fills its page with live records: a page of Moved records hides none),
// in the order of their etcd keys (tenant, "/", id, as bytes: the order
// each shard resumes o.After in; "t-b/x" comes before "t/y"), at most
// o.Limit (default 100) of them: a page, as one store's List, that o.After
// resumes.
func list(ctx context.Context, names []string, shard func(string) (lister, error), tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error) {
	o.Live = true
	var out []*etcdstore.Record
	for _, n := range names {
		l, err := shard(n)
		if err != nil {
			return nil, err
		}
		recs, err := l.List(ctx, tenant, o)
		if err != nil {
			return nil, fmt.Errorf("shard %s: %w", n, err)
		}
		out = append(out, recs...)
	}
	sort.Slice(out, func(i, j int) bool { return listOrder(out[i].Key) < listOrder(out[j].Key) })
	limit := o.Limit
	if limit == 0 {
		limit = 100
	}
	if len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}

// listOrder is where a key's record sorts among a store's: its etcd key
// after the prefix.
func listOrder(k etcdstore.Key) string {
	t := k.Tenant
	if t == "" {
		t = etcdstore.DefaultTenant
	}
	return t + "/" + k.ID
}
