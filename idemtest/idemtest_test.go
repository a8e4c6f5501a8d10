package idemtest_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/idemtest"
)

var cluster *etcdtest.Cluster

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m, 1, etcdtest.Options{}, &cluster)) }

var seq atomic.Int64

func newStore(t *testing.T, prefix string) *etcdstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.New(ctx, cluster.MustClient(t), etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func prefix() string {
	return "/idemtest/" + time.Now().Format("150405.000") + "/" + string(rune('a'+seq.Add(1)%26)) + "/"
}

// logged is what a service's wrapper of the store looks like: it counts
// the calls and passes them on. It keeps the contract, so it passes the
// suite: a wrapper runs the same suite as the stores themselves.
type logged struct {
	idem.Store
	runs atomic.Int64
}

func (l *logged) Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error) {
	l.runs.Add(1)
	return l.Store.Run(ctx, key, fp, work, opts...)
}

func TestAWrapperPassesTheSuite(t *testing.T) {
	p := prefix()
	w := &logged{Store: newStore(t, p)}
	idemtest.TestStore(t, idemtest.Harness{Store: w, Other: newStore(t, p)})
	if w.runs.Load() == 0 {
		t.Fatal("the suite never called the wrapper's Run")
	}
}

// Each defect of issue 37, put back into a store by a wrapper, fails the
// suite, at the promise it breaks.

// evictIfNotFound is defect 1: a shard set's EvictIf of a key that no
// shard holds failed with "not found".
type evictIfNotFound struct{ idem.Store }

func (s evictIfNotFound) EvictIf(ctx context.Context, key etcdstore.Key, rev int64) (bool, error) {
	if _, err := s.Get(ctx, key); err != nil {
		return false, err
	}
	return s.Store.EvictIf(ctx, key, rev)
}

// staleReader is defect 2: a store that read first from a member held
// behind replayed a done record deleted since. It remembers the done
// records it replayed, and while held answers from them.
type staleReader struct {
	idem.Store
	mu   sync.Mutex
	seen map[etcdstore.Key]etcdstore.Result
	held bool
}

func (s *staleReader) Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error) {
	s.mu.Lock()
	res, ok := s.seen[key]
	held := s.held
	s.mu.Unlock()
	if ok && held {
		return res, nil
	}
	res, err := s.Store.Run(ctx, key, fp, work, opts...)
	if err == nil && res.Replayed {
		s.mu.Lock()
		s.seen[key] = res
		s.mu.Unlock()
	}
	return res, err
}

func (s *staleReader) hold(context.Context) (func() error, error) {
	s.mu.Lock()
	s.held = true
	s.mu.Unlock()
	return func() error {
		s.mu.Lock()
		s.held = false
		s.mu.Unlock()
		return nil
	}, nil
}

// kindless is defect 3: records did not say what they are.
type kindless struct{ idem.Store }

func (s kindless) Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error) {
	rec, err := s.Store.Get(ctx, key)
	if rec != nil {
		rec.Kind = ""
	}
	return rec, err
}

func TestEveryDefectPutBackFailsTheSuite(t *testing.T) {
	p := prefix()
	real := newStore(t, p)
	if err := idemtest.Check(idemtest.Harness{Store: real, Other: newStore(t, p)}); err != nil {
		t.Fatalf("the real store fails the suite: %v", err)
	}
	stale := &staleReader{Store: newStore(t, p), seen: map[etcdstore.Key]etcdstore.Result{}}
	for _, c := range []struct {
		defect  string
		h       idemtest.Harness
		promise string
	}{
		{"EvictIf of a key no store holds fails", idemtest.Harness{Store: evictIfNotFound{real}}, "EvictIf"},
		{"a store held behind replays deleted records", idemtest.Harness{Store: real, Other: stale, Behind: stale.hold}, "NoStaleReplay"},
		{"records do not say what they are", idemtest.Harness{Store: kindless{real}}, "Kinds"},
	} {
		err := idemtest.Check(c.h)
		if err == nil || !strings.Contains(err.Error(), c.promise+" (") {
			t.Errorf("%s: Check = %v; want promise %s broken", c.defect, err, c.promise)
		}
	}
}
