package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// N callers in N processes race on one key: the work runs exactly once, and
// every caller either gets the one outcome or a conflict.
func TestConcurrentDuplicatesRunWorkOnce(t *testing.T) {
	for _, tc := range []struct {
		name    string
		members int
		wait    bool
	}{
		{"1 member", 1, false},
		{"1 member, waiting", 1, true},
		{"3 members", 3, false},
		{"3 members, waiting", 3, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var clients []*clientv3.Client
			if tc.members == 1 {
				clients = []*clientv3.Client{client(t)}
			} else {
				c := threeMembers(t)
				for _, ep := range c.Endpoints() { // one client pinned to each member
					clients = append(clients, c.MustClient(t, ep))
				}
			}
			prefix := testPrefix(t)
			const procs, callers = 4, 32
			stores := make([]*Store, procs)
			for i := range stores {
				stores[i] = newStore(t, clients[i%len(clients)], prefix)
			}
			ctx := testCtx(t)
			for round := 0; round < 3; round++ {
				key := Key{ID: fmt.Sprintf("order-%d", round)}
				var runs atomic.Int32
				start := make(chan struct{})
				var wg sync.WaitGroup
				results := make([]Result, callers)
				errs := make([]error, callers)
				for i := 0; i < callers; i++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						var opts []RunOption
						if tc.wait {
							opts = append(opts, WithWait())
						}
						results[i], errs[i] = stores[i%procs].Do(ctx, key, []byte(`{"n":1}`), func(ctx context.Context, c *Claim) ([]byte, error) {
							runs.Add(1)
							return []byte(fmt.Sprintf("charged by token %d", c.Token())), nil
						}, opts...)
					}()
				}
				close(start)
				wg.Wait()
				if n := runs.Load(); n != 1 {
					t.Fatalf("round %d: work ran %d times; want 1", round, n)
				}
				var body string
				fresh := 0
				for i := range results {
					switch {
					case errs[i] == nil:
						if body == "" {
							body = string(results[i].Body)
						} else if string(results[i].Body) != body {
							t.Fatalf("round %d: caller %d got %q; another got %q", round, i, results[i].Body, body)
						}
						if !results[i].Replayed {
							fresh++
						}
					case tc.wait:
						t.Fatalf("round %d: waiting caller %d: %v", round, i, errs[i])
					case !errors.Is(errs[i], ErrConflict):
						t.Fatalf("round %d: caller %d: %v; want a result or ErrConflict", round, i, errs[i])
					}
				}
				if fresh != 1 {
					t.Fatalf("round %d: %d fresh results; want 1", round, fresh)
				}
			}
		})
	}
}

// A worker whose session lease really expires (its link to etcd is cut for
// longer than the TTL) is fenced out: its work's context is cancelled with
// ErrSessionLost, another process takes the key over and saves its outcome,
// and the first worker's late save fails and changes nothing.
func TestSessionExpiryMidWorkFencesOutTheWorker(t *testing.T) {
	ctx := testCtx(t)
	proxy := newProxy(t, single.Members[0].ClientURL)
	cutCli := single.MustClient(t, proxy.URL())
	prefix := testPrefix(t)
	slow := newStore(t, cutCli, prefix, WithSessionTTL(2*time.Second))
	healthy := newStore(t, client(t), prefix)
	key := Key{ID: "k"}

	started := make(chan struct{})
	newOwnerDone := make(chan struct{})
	var workCause error
	var slowRes Result
	var slowErr error
	slowFinished := make(chan struct{})
	go func() {
		defer close(slowFinished)
		slowRes, slowErr = slow.Do(ctx, key, nil, func(wctx context.Context, c *Claim) ([]byte, error) {
			close(started)
			<-wctx.Done() // the session is lost while the work runs
			workCause = context.Cause(wctx)
			<-newOwnerDone // it keeps going anyway, and finishes late
			return []byte("slow"), nil
		})
	}()
	<-started
	proxy.Blackhole()

	// The new owner waits (on a Watch of the owner key) until etcd expires
	// the session, then takes over.
	res, err := healthy.Do(ctx, key, nil, func(ctx context.Context, c *Claim) ([]byte, error) {
		if !c.TookOver() {
			t.Error("the new owner did not take over")
		}
		return []byte("healthy"), nil
	}, WithWait())
	if err != nil {
		t.Fatalf("takeover: %v", err)
	}
	close(newOwnerDone)
	proxy.Heal()
	<-slowFinished

	if !errors.Is(workCause, ErrSessionLost) {
		t.Fatalf("slow work's context cause = %v; want ErrSessionLost", workCause)
	}
	if !errors.Is(slowErr, ErrFenced) || string(slowRes.Body) != "slow" {
		t.Fatalf("slow Do = %q, %v; want its own body and ErrFenced", slowRes.Body, slowErr)
	}
	if res.Token <= slowRes.Token {
		t.Fatalf("new token %d not above the old %d", res.Token, slowRes.Token)
	}
	rec, err := healthy.Get(ctx, key)
	if err != nil || string(rec.Outcome.Body) != "healthy" {
		t.Fatalf("outcome = %+v, %v; want the new owner's", rec, err)
	}
	if proxy.Dropped.Load() == 0 {
		t.Fatal("the blackhole dropped nothing: the fault did not fire")
	}
}

// With etcd unreachable, calls fail with ErrUnavailable after the request
// timeout (and the store's own retries), not when the caller gives up.
func TestUnreachableEtcdIsUnavailable(t *testing.T) {
	ctx := testCtx(t)
	proxy := newProxy(t, single.Members[0].ClientURL)
	cli := single.MustClient(t, proxy.URL())
	s := newStore(t, cli, testPrefix(t), WithRequestTimeout(200*time.Millisecond))
	proxy.Blackhole()
	_, _, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Claim with etcd blackholed = %v; want ErrUnavailable", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the claim waited for the caller's context")
	}
	if _, err := s.Get(ctx, Key{ID: "k"}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Get = %v; want ErrUnavailable", err)
	}
	proxy.Heal()
	if _, err := s.Do(ctx, Key{ID: "k"}, nil, func(context.Context, *Claim) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatalf("after healing: %v", err)
	}
}
