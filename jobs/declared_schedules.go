package jobs

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// DeclaredSchedulers runs the schedules of every tenant's declared kinds
// on a store (Declaration.Schedules): a Scheduler per tenant, started
// again whenever the tenant's declared schedules change. idem serve runs
// one in each of its processes; every occurrence is submitted once
// whatever the number of processes (Scheduler).
type DeclaredSchedulers struct {
	store *etcdstore.Store
	queue func(tenant string) (*Queue, error)
	log   *slog.Logger
	stop  context.CancelFunc
	done  chan struct{}

	mu      sync.Mutex
	running map[string]*declaredScheduler // by tenant
}

type declaredScheduler struct {
	key string // the tenant's declared schedules, as JSON: a change starts them again
	s   *Scheduler
}

// declFollowID is the one key a declarations feed follows besides its
// values: none.
const declFollowID = "~declarations"

// RunDeclaredSchedules starts running the declared schedules of store's
// tenants, each on the queue queue returns for it, until Close.
func RunDeclaredSchedules(store *etcdstore.Store, queue func(tenant string) (*Queue, error), log *slog.Logger) *DeclaredSchedulers {
	if log == nil {
		log = slog.Default()
	}
	ctx, stop := context.WithCancel(context.Background())
	d := &DeclaredSchedulers{store: store, queue: queue, log: log, stop: stop, done: make(chan struct{}), running: map[string]*declaredScheduler{}}
	go func() {
		defer close(d.done)
		d.follow(ctx)
	}()
	return d
}

// Close stops every schedule it runs.
func (d *DeclaredSchedulers) Close() error {
	d.stop()
	<-d.done
	d.mu.Lock()
	defer d.mu.Unlock()
	for t, r := range d.running {
		r.s.Close()
		delete(d.running, t)
	}
	return nil
}

// Running returns the names of the schedules it runs for tenant.
func (d *DeclaredSchedulers) Running(tenant string) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.running[tenant]
	if r == nil {
		return nil
	}
	var names []string
	for _, sc := range r.s.schedules {
		names = append(names, sc.Name)
	}
	return names
}

func (d *DeclaredSchedulers) follow(ctx context.Context) {
	clk := d.store.Clock()
	for fails := 0; ctx.Err() == nil; fails++ {
		feed, err := storex.Follow(d.store, ctx, DefaultTenant, storex.FollowOptions{ID: declFollowID, Values: []string{"d/"}})
		if err == nil {
			fails = 0
			values := map[string][]byte{}
			for _, v := range feed.Values() {
				values[v.Name] = v.Value
			}
			d.reconcile(values)
			for err == nil {
				var changes []storex.Change
				if changes, err = feed.Next(ctx); err != nil {
					break
				}
				for _, ch := range changes {
					if ch.Value == nil {
						continue
					}
					if ch.Value.Revision == 0 {
						delete(values, ch.Value.Name)
					} else {
						values[ch.Value.Name] = ch.Value.Value
					}
				}
				d.reconcile(values)
			}
			feed.Close()
		}
		if ctx.Err() != nil {
			return
		}
		d.log.Info("idem: re-reading the declared schedules", "err", err)
		clock.Sleep(clk, ctx, min(time.Duration(100<<min(fails, 6))*time.Millisecond, 5*time.Second))
	}
}

// reconcile starts, starts again or stops each tenant's scheduler for the
// declarations in values (by value name, d/<tenant>).
func (d *DeclaredSchedulers) reconcile(values map[string][]byte) {
	byTenant := map[string][]Declaration{}
	for name, v := range values {
		tenant := strings.TrimPrefix(name, "d/")
		m, err := decodeDeclarations(v)
		if err != nil || strings.Contains(tenant, "/") {
			continue
		}
		for _, decl := range sortedDeclarations(m) {
			if len(decl.Schedules) > 0 {
				byTenant[tenant] = append(byTenant[tenant], decl)
			}
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for tenant, r := range d.running {
		if byTenant[tenant] == nil {
			r.s.Close()
			delete(d.running, tenant)
		}
	}
	for tenant, ds := range byTenant {
		key := schedulesKey(ds)
		if r := d.running[tenant]; r != nil && r.key == key {
			continue
		}
		q, err := d.queue(tenant)
		if err != nil {
			d.log.Error("idem: declared schedules not run", "tenant", tenant, "err", err)
			continue
		}
		scs, errs := RunnableSchedules(ds, q.retention())
		for _, err := range errs {
			d.log.Error("idem: a declared schedule is not run", "tenant", tenant, "err", err)
		}
		if r := d.running[tenant]; r != nil {
			r.s.Close()
			delete(d.running, tenant)
		}
		if len(scs) == 0 {
			continue
		}
		s, err := NewScheduler(q, scs)
		if err != nil {
			d.log.Error("idem: declared schedules not run", "tenant", tenant, "err", err)
			continue
		}
		d.running[tenant] = &declaredScheduler{key: key, s: s}
	}
}

// schedulesKey is ds's schedules as JSON, by kind name.
func schedulesKey(ds []Declaration) string {
	m := map[string][]ScheduleDeclaration{}
	for _, d := range ds {
		m[d.Name] = d.Schedules
	}
	b, _ := json.Marshal(m) // maps marshal in key order
	return string(b)
}
