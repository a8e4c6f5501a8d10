package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore/internal/kpb"
	"github.com/idem-dev/idem/internal/kernel"

	"github.com/idem-dev/idem/internal/storeext"
)

// namedValue is a small value that a package built on a store keeps beside the
// store's records, under a name of its own: package jobs keeps its
// schedules' cursors there (names s/<tenant>/<schedule>). Revision is the
// etcd revision of its last write, for SetValue's compare-and-set.
type namedValue = storeext.Value

// validValueName checks a value's name: 1 to 512 bytes of visible ASCII,
// not starting with '/'.
func validValueName(name string) error {
	if name == "" || len(name) > 512 || name[0] == '/' {
		return fmt.Errorf("%w: value name %q must be 1 to 512 bytes, not starting with /", ErrInvalidArgument, name)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("%w: value name %q: byte %#02x at offset %d is not visible ASCII", ErrInvalidArgument, name, c, i)
		}
	}
	return nil
}

// getValue returns the value under name, with a linearizable read; its
// Revision is 0 (and getValue nil) when there is none.
func (a *Admin) getValue(ctx context.Context, name string) (namedValue, error) {
	if err := validValueName(name); err != nil {
		return namedValue{}, fmt.Errorf("value: %w", err)
	}
	vs, err := a.values(ctx, a.ks.values()+name, false)
	if err != nil || len(vs) == 0 {
		return namedValue{Name: name}, err
	}
	return vs[0], nil
}

// listValues returns every value whose name starts with prefix, in name order.
func (a *Admin) listValues(ctx context.Context, prefix string) ([]namedValue, error) {
	if prefix != "" {
		if err := validValueName(prefix); err != nil {
			return nil, fmt.Errorf("values: %w", err)
		}
	}
	return a.values(ctx, a.ks.values()+prefix, true)
}

func (a *Admin) values(ctx context.Context, key string, prefix bool) ([]namedValue, error) {
	var out []namedValue
	end := ""
	if prefix {
		end = clientv3.GetPrefixRangeEnd(key)
	}
	for from := key; ; {
		var resp *clientv3.GetResponse
		err := a.page(ctx, func(ctx context.Context) (err error) {
			opts := []clientv3.OpOption{clientv3.WithLimit(1000)}
			if end != "" {
				opts = append(opts, clientv3.WithRange(end))
			}
			resp, err = a.client.Get(ctx, from, opts...)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("values %q: %w: %w", key, ErrUnavailable, err)
		}
		for _, kv := range resp.Kvs {
			out = append(out, namedValue{Name: strings.TrimPrefix(string(kv.Key), a.ks.values()), Value: kv.Value, Revision: kv.ModRevision})
		}
		if !resp.More || len(resp.Kvs) == 0 || end == "" {
			return out, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// valueOption configures setValue (storeext.ValueOption).
type valueOption = storeext.ValueOption

// valueUnderShardSet guards the write with the shard set recorded at
// revision rev (ShardSetValue), as UnderShardSet guards a claim: a write
// decided under a set that is no longer this shard's is refused with an
// error wrapping ErrSetChanged (and the store notes the new set). Package
// shard writes the values it places by key so (shard.Store.SetValue).
func valueUnderShardSet(rev int64) valueOption {
	return func(c *storeext.ValueConfig) { c.SetRev = rev }
}

// retained puts the value on a retention lease, as a record: it is deleted
// once the store's retention has passed since this write, instead of being
// kept until it is deleted. Package jobs keeps its events so.
func retained() valueOption { return func(c *storeext.ValueConfig) { c.Retained = true } }

// onSession puts the value on this process's current session lease: it is
// deleted when the session ends (the process died, was cut off past the
// session's TTL, or closed the store). The process starts a new session
// then, under a new owner (Store.Owner): write the value again for it.
// Package jobs' workers advertise themselves so.
func onSession() valueOption { return func(c *storeext.ValueConfig) { c.Session = true } }

// setValue writes value under name if the value's revision is still rev (0:
// only if there is none), and reports whether it did; if not, it returns
// the value as it stands. A write whose outcome is unknown is an error
// wrapping ErrUnavailable: read the value again.
func (s *Store) setValue(ctx context.Context, name string, value []byte, rev int64, opts ...valueOption) (namedValue, bool, error) {
	if err := validValueName(name); err != nil {
		return namedValue{}, false, fmt.Errorf("set value: %w", err)
	}
	var cfg storeext.ValueConfig
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.SetRev < 0 {
		return namedValue{}, false, fmt.Errorf("set value %q: %w: shard set revision %d", name, ErrInvalidArgument, cfg.SetRev)
	}
	l := kernel.NoLease
	switch {
	case cfg.Session:
		l = kernel.SessionLease
	case cfg.Retained:
		l = kernel.BucketLease
	}
	t := s.kcfg().Keys.SetValue(s.ks.values()+name, value, rev, l, cfg.SetRev)
	ctx, cancel := s.bound(ctx)
	defer cancel()
	resp, err := s.sendValue(ctx, t)
	if errors.Is(err, ErrSessionLost) || errors.Is(err, ErrClosed) {
		return namedValue{}, false, fmt.Errorf("set value %q: %w", name, err)
	}
	if err != nil {
		return namedValue{}, false, fmt.Errorf("set value %q: %w: %w", name, ErrUnavailable, err)
	}
	return s.valueSet(name, value, cfg.SetRev, resp)
}

// sendValue sends a value's Txn, refreshing a bucket lease etcd no longer
// knows once.
func (s *Store) sendValue(ctx context.Context, t *kernel.Txn) (*clientv3.TxnResponse, error) {
	for refreshed := false; ; refreshed = true {
		var id clientv3.LeaseID
		then := make([]*pb.RequestOp, len(t.Then))
		for i, op := range t.Then {
			r, _, err := s.requestOp(ctx, Key{}, op)
			if err != nil {
				return nil, err
			}
			if op.Lease == kernel.BucketLease {
				id = clientv3.LeaseID(r.GetRequestPut().Lease)
			}
			then[i] = r
		}
		els, err := kpb.Ops(t.Else)
		if err != nil {
			return nil, err
		}
		var resp *clientv3.TxnResponse
		err = s.kv.Do(ctx, func(ctx context.Context) (err error) {
			resp, err = s.client.Txn(ctx).If(kpb.Cmps(t.If)...).Then(kpb.ClientOps(then)...).Else(kpb.ClientOps(els)...).Commit()
			return err
		})
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && !refreshed && id != 0 {
			s.buckets.Invalidate(id) // nothing was written: try a fresh lease
			continue
		}
		return resp, err
	}
}

// valueSet reads the answer to SetValue's Txn.
func (s *Store) valueSet(name string, value []byte, setRev int64, resp *clientv3.TxnResponse) (namedValue, bool, error) {
	if resp.Succeeded {
		v := namedValue{Name: name, Value: value, Revision: resp.Header.Revision}
		if s.epochs && name == shardSetValue {
			s.noteSet(v)
		}
		return v, true, nil
	}
	if setRev != 0 {
		set := namedValue{Name: shardSetValue}
		if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) == 1 {
			set.Value, set.Revision = kvs[0].Value, kvs[0].ModRevision
		}
		if set.Revision != setRev {
			s.noteSet(set)
			return namedValue{}, false, fmt.Errorf("set value %q: %w", name, errSetChanged)
		}
	}
	cur := namedValue{Name: name}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) == 1 {
		cur.Value, cur.Revision = kvs[0].Value, kvs[0].ModRevision
	}
	if s.epochs && name == shardSetValue {
		s.noteSet(cur)
	}
	return cur, false, nil
}

// deleteValue deletes the value under name if its revision is still rev,
// and reports whether it did (false: it changed, or is gone). A delete
// whose outcome is unknown is an error wrapping ErrUnavailable: read the
// value again.
func (s *Store) deleteValue(ctx context.Context, name string, rev int64) (bool, error) {
	if err := validValueName(name); err != nil {
		return false, fmt.Errorf("delete value: %w", err)
	}
	if rev <= 0 {
		return false, fmt.Errorf("delete value %q: %w: revision %d", name, ErrInvalidArgument, rev)
	}
	key := s.ks.values() + name
	ctx, cancel := s.bound(ctx)
	defer cancel()
	t := kernel.DeleteValue(key, rev)
	var resp *clientv3.TxnResponse
	err := s.kv.Do(ctx, func(ctx context.Context) (err error) {
		resp, err = s.client.Txn(ctx).If(kpb.Cmps(t.If)...).Then(clientv3.OpDelete(key)).Commit()
		return err
	})
	if err != nil {
		return false, fmt.Errorf("delete value %q: %w: %w", name, ErrUnavailable, err)
	}
	return resp.Succeeded, nil
}
