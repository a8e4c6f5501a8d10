package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/internal/watch"

	"github.com/idem-dev/idem/internal/storeext"
)

// followOptions selects what Follow follows.
type followOptions = storeext.FollowOptions

// recordFeed follows records and sessions from a read at one revision on: every
// change after that read, in revision order. Package jobs' completer runs
// on one. A recordFeed is used by one goroutine at a time.
type recordFeed struct {
	s       *Store
	tenant  string
	records []*Record
	owners  []string
	values  []namedValue
	rev     int64

	stream *watch.Stream
	recW   int
	valW   map[int]bool
	cancel context.CancelFunc
	work   clock.Group
	heard  atomic.Int64 // when the watch last delivered anything (clock time, unix ns)
	stall  time.Duration

	mu      sync.Mutex
	stalled bool
}

// change is one change a feed delivers (storeext.change).
type change = storeext.Change[Key, Record]

// follow reads tenant's records (or one of them, FollowOptions.ID) and,
// with FollowOptions.Sessions, the live sessions, at one revision, and
// returns a Feed of every change after it. Records past their retention
// are left out of the read. The Feed ends with ctx or Close.
func (s *Store) follow(ctx context.Context, tenant string, o followOptions) (*recordFeed, error) {
	if tenant == "" {
		tenant = DefaultTenant
	}
	if err := ValidateTenant(tenant); err != nil {
		return nil, fmt.Errorf("follow: %w", err)
	}
	if o.ID != "" {
		if err := validateID(o.ID); err != nil {
			return nil, fmt.Errorf("follow: %w", err)
		}
	}
	for _, p := range o.Values {
		if err := validValueName(p); err != nil {
			return nil, fmt.Errorf("follow: %w", err)
		}
	}
	if o.Stall <= 0 {
		o.Stall = 10 * time.Second
	}
	f := &recordFeed{s: s, tenant: tenant, stall: o.Stall}
	if err := f.read(ctx, o); err != nil {
		return nil, err
	}
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(metadata.AppendToOutgoingContext(ctx,
		"idem-feed", strconv.FormatInt(feeds.Add(1), 10))))
	f.cancel = cancel
	f.stream = watch.New(s.clock)
	key, opts := s.ks.tenant(tenant), []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithRev(f.rev)}
	if o.ID != "" {
		key, opts = s.ks.record(Key{Tenant: tenant, ID: o.ID}), []clientv3.OpOption{clientv3.WithRev(f.rev)}
	}
	// From the read's own revision, not the next: etcd answers no progress
	// request of a watch that starts in the future. Events at rev are state
	// the read saw.
	f.recW = f.stream.Add(s.client.Watch(wctx, key, opts...))
	f.valW = map[int]bool{}
	for _, p := range o.Values {
		f.valW[f.stream.Add(s.client.Watch(wctx, s.ks.values()+p, clientv3.WithPrefix(), clientv3.WithRev(f.rev)))] = true
	}
	if o.Sessions {
		f.stream.Add(s.client.Watch(wctx, s.ks.owners(), clientv3.WithPrefix(), clientv3.WithRev(f.rev)))
	}
	f.heard.Store(s.clock.Now().UnixNano())
	f.work.Go(s.clock, wctx, "feed progress", func(wctx context.Context) {
		for clock.Sleep(s.clock, wctx, f.stall/4) == nil {
			if time.Duration(s.clock.Now().UnixNano()-f.heard.Load()) > f.stall {
				f.mu.Lock()
				f.stalled = true
				f.mu.Unlock()
				f.stream.Interrupt()
				cancel()
				return
			}
			s.client.RequestProgress(wctx)
		}
	})
	return f, nil
}

var feeds atomic.Int64 // each feed has a gRPC stream of its own

// read reads what the feed starts from, at one revision.
func (f *recordFeed) read(ctx context.Context, o followOptions) error {
	s := f.s
	ctx, cancel := s.bound(ctx)
	defer cancel()
	r := &snapshot{s: s, tenant: f.tenant}
	if o.Sessions {
		err := r.scan(ctx, s.ks.owners(), func(kv *mvccpb.KeyValue) {
			f.owners = append(f.owners, strings.TrimPrefix(string(kv.Key), s.ks.owners()))
		}, clientv3.WithKeysOnly())
		if err != nil {
			return err
		}
	}
	for _, p := range o.Values {
		err := r.scan(ctx, s.ks.values()+p, func(kv *mvccpb.KeyValue) {
			f.values = append(f.values, namedValue{Name: strings.TrimPrefix(string(kv.Key), s.ks.values()), Value: kv.Value, Revision: kv.ModRevision})
		})
		if err != nil {
			return err
		}
	}
	now := s.now()
	keep := func(kv *mvccpb.KeyValue) {
		if rec, err := s.decodeKV(ctx, kv); err == nil && !rec.expired(now) {
			f.records = append(f.records, rec)
		}
	}
	var err error
	if o.ID != "" {
		err = r.read(ctx, s.ks.record(Key{Tenant: f.tenant, ID: o.ID}), keep)
	} else {
		err = r.scan(ctx, s.ks.tenant(f.tenant), keep)
	}
	f.rev = r.rev
	return err
}

// snapshot reads a feed's first state, every read at the revision of the
// first.
type snapshot struct {
	s      *Store
	tenant string
	rev    int64 // 0 until the first read
}

// get is one read of the snapshot.
func (r *snapshot) get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	var resp *clientv3.GetResponse
	err := r.s.retry(ctx, func(ctx context.Context) (err error) {
		if r.rev != 0 {
			opts = append(opts, clientv3.WithRev(r.rev))
		}
		resp, err = r.s.client.Get(ctx, key, opts...)
		return err
	})
	if err != nil {
		return nil, unavailable("follow", Key{Tenant: r.tenant}, err)
	}
	if r.rev == 0 {
		r.rev = resp.Header.Revision
	}
	return resp, nil
}

// read calls each with key, if it exists.
func (r *snapshot) read(ctx context.Context, key string, each func(*mvccpb.KeyValue)) error {
	resp, err := r.get(ctx, key)
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		each(kv)
	}
	return nil
}

// scan calls each with every key under prefix, in pages.
func (r *snapshot) scan(ctx context.Context, prefix string, each func(*mvccpb.KeyValue), opts ...clientv3.OpOption) error {
	end := clientv3.GetPrefixRangeEnd(prefix)
	for from := prefix; ; {
		resp, err := r.get(ctx, from, append([]clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(500)}, opts...)...)
		if err != nil {
			return err
		}
		for _, kv := range resp.Kvs {
			each(kv)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// Records returns the records the feed started from.
func (f *recordFeed) Records() []*Record { return f.records }

// Owners returns the sessions alive when the feed started (with
// FollowOptions.Sessions).
func (f *recordFeed) Owners() []string { return f.owners }

// Values returns the values the feed started from (with
// FollowOptions.Values), in name order.
func (f *recordFeed) Values() []namedValue { return f.values }

// Revision returns the revision the feed started from.
func (f *recordFeed) Revision() int64 { return f.rev }

// Next returns the next changes, waiting for them, or an error wrapping
// ErrUnavailable when the watch broke or stalled (follow again, from a new
// read), or ctx's cause.
func (f *recordFeed) Next(ctx context.Context) ([]change, error) {
	for {
		r, err := f.stream.Next(ctx)
		if err != nil {
			return nil, err
		}
		f.mu.Lock()
		stalled := f.stalled
		f.mu.Unlock()
		switch {
		case stalled:
			return nil, fmt.Errorf("follow %s: %w: the watch delivered nothing for %v", f.tenant, ErrUnavailable, f.stall)
		case r.Closed:
			return nil, fmt.Errorf("follow %s: %w: watch closed", f.tenant, ErrUnavailable)
		case r.Canceled || r.Err() != nil:
			return nil, fmt.Errorf("follow %s: %w: %w", f.tenant, ErrUnavailable, errors.Join(r.Err(), errors.New("watch cancelled")))
		}
		f.heard.Store(f.s.clock.Now().UnixNano())
		if len(r.Events) == 0 {
			continue // a progress notification
		}
		out := make([]change, 0, len(r.Events))
		for _, ev := range r.Events {
			c := change{Revision: ev.Kv.ModRevision}
			if f.valW[r.Watch] {
				v := &namedValue{Name: strings.TrimPrefix(string(ev.Kv.Key), f.s.ks.values())}
				if ev.Type == mvccpb.PUT {
					v.Value, v.Revision = ev.Kv.Value, ev.Kv.ModRevision
				}
				c.Value = v
				out = append(out, c)
				continue
			}
			if r.Watch != f.recW {
				c.Owner, c.Alive = strings.TrimPrefix(string(ev.Kv.Key), f.s.ks.owners()), ev.Type == mvccpb.PUT
				out = append(out, c)
				continue
			}
			k, ok := f.s.ks.parseRecord(string(ev.Kv.Key))
			if !ok {
				continue
			}
			c.Key = k
			if ev.Type == mvccpb.PUT {
				c.Record, c.Err = f.s.decode(ctx, k, ev.Kv)
			}
			out = append(out, c)
		}
		return out, nil
	}
}

// Close ends the feed.
func (f *recordFeed) Close() {
	f.cancel()
	f.work.Wait(f.s.clock, context.Background())
}
