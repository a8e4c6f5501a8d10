package jobs

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
)

var cluster *etcdtest.Cluster

func TestMain(m *testing.M) {
	// The queues log to the process's logger by default: quiet in tests
	// (TestJobsLogThroughTheProcesssLogger sets its own).
	slog.SetDefault(slog.New(slog.DiscardHandler))
	os.Exit(etcdtest.Main(m, 1, etcdtest.Options{}, &cluster))
}

var prefixSeq atomic.Int64

func testPrefix(t testing.TB) string {
	return fmt.Sprintf("/jobs-test/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newStore returns a store of its own (a process of its own, as far as
// sessions go) under prefix.
func newStore(t testing.TB, prefix string, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	return newStoreOn(t, cluster.MustClient(t), prefix, opts...)
}

func newStoreOn(t testing.TB, cli *clientv3.Client, prefix string, opts ...etcdstore.Option) *etcdstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.New(ctx, cli, append([]etcdstore.Option{etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(2 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatalf("etcdstore.New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func newQueue(t testing.TB, s *etcdstore.Store, opts ...Option) *Queue {
	t.Helper()
	q, err := New(s, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return q
}

func newWorker(t testing.TB, q *Queue, kinds []Kind, opts ...WorkerOption) *Worker {
	t.Helper()
	w, err := NewWorker(q, kinds, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

// endSession revokes s's session lease, as its expiry would after the
// process died or was cut off: its claims may be taken over at once.
func endSession(t testing.TB, s *etcdstore.Store) {
	t.Helper()
	cli := cluster.MustClient(t)
	ctx := testCtx(t)
	resp, err := cli.Get(ctx, s.Prefix()+"o/"+s.Owner())
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("owner key of %s: %v, %v", s.Owner(), resp, err)
	}
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
}

// sink is a downstream that applies each step's effect once (by its step
// key) and refuses a token lower than the highest it saw for the job.
type sink struct {
	mu      sync.Mutex
	fence   fencing.Checker
	applied map[string]int             // step key -> effects applied
	calls   map[string][]fencing.Token // step key -> tokens of every call
	refused int
}

func newSink() *sink {
	return &sink{applied: map[string]int{}, calls: map[string][]fencing.Token{}}
}

// apply is a step's downstream call: it reports whether the token was
// accepted.
func (s *sink) apply(r *Run) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls[r.StepKey()] = append(s.calls[r.StepKey()], r.Token())
	if err := s.fence.Check(r.Key().ID, r.Token()); err != nil {
		s.refused++
		return err
	}
	if s.applied[r.StepKey()] == 0 {
		s.applied[r.StepKey()]++
	}
	return nil
}

func (s *sink) count(stepKey string) (applied, calls int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.applied[stepKey], len(s.calls[stepKey])
}

func (s *sink) tokens(stepKey string) []fencing.Token {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]fencing.Token(nil), s.calls[stepKey]...)
}

// waitState waits, on a Watch, until job id is final or parked.
func waitJob(t testing.TB, q *Queue, id string) *Job {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	j, err := q.Wait(ctx, id)
	if err != nil {
		t.Fatalf("Wait(%s): %v", id, err)
	}
	return j
}
