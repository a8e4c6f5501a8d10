package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// forwardThenDie sends a request with key through a proxy on store a (a
// process of idem), waits until the upstream works on it, and then kills
// the process as far as etcd can tell: its session lease ends, so its
// claim may be taken over at once.
func forwardThenDie(ctx context.Context, t *testing.T, a *etcdstore.Store, up *upstream, prefix, key string) {
	t.Helper()
	frontA := newFront(t, Config{Store: a}, up, ProxyOptions{})
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", frontA.URL+"/slow", strings.NewReader(`{"amount":5}`))
		req.Header.Set(HeaderKey, key)
		req.Header.Set("Content-Type", "application/json")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close() // its answer never matters: its process "dies"
		}
	}()
	<-up.entered // A forwarded the request: the upstream works on it
	owner, err := a.Client().Get(ctx, prefix+"o/"+a.Owner())
	if err != nil || len(owner.Kvs) != 1 {
		t.Fatalf("A's owner key: %v, %v", owner, err)
	}
	if _, err := a.Client().Revoke(ctx, clientv3.LeaseID(owner.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
}

// Issue 38 (review): a takeover of a dead idem's claim answers the unknown
// outcome instead of forwarding again, judged by the record it takes
// over. But a process whose own takeover's reply was lost has its reaper
// give that claim up (abandoned, or a fence written over the dead claim):
// the record then has no owner, as if abandoned on purpose, and the next
// takeover forwarded the request a second time. The record keeps that an
// earlier attempt was cut short (Record.CutShort) through the abandon.
func TestATakeoverAfterAnAbandonedTakeoverOfADeadClaimDoesNotForward(t *testing.T) {
	prefix := fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
	a, b, c := newStore(t, prefix), newStore(t, prefix), newStore(t, prefix)
	up := newUpstream(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	forwardThenDie(ctx, t, a, up, prefix, "order-1")
	// B takes the claim over; its reply is lost, and its reaper abandons
	// the claim it made (what ReapAbandon writes).
	key := etcdstore.Key{ID: "order-1"}
	rec, err := b.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	cb, _, err := b.Claim(ctx, key, rec.Fingerprint)
	if err != nil || cb == nil || !cb.TookOver() {
		t.Fatalf("B's takeover = %v, %v", cb, err)
	}
	if err := cb.Abandon(ctx); err != nil {
		t.Fatal(err)
	}
	// The client's retry reaches C.
	frontC := newFront(t, Config{Store: c}, up, ProxyOptions{})
	t.Cleanup(func() { close(up.hold) }) // first: A's request ends, and its server closes
	r := do(t, "POST", frontC.URL+"/slow", "order-1", `{"amount":5}`)
	select {
	case <-up.entered:
		t.Fatalf("the retry reached the upstream a second time (answer %d %s)", r.status, r.body)
	default:
	}
	if r.status != http.StatusBadGateway || problemType(t, r) != KindUpstreamUnknown {
		t.Fatalf("the retry after a dead claim, taken over and abandoned = %d %s; want 502 %s", r.status, r.body, KindUpstreamUnknown)
	}
}
