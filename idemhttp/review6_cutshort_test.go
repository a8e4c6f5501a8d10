package idemhttp

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/etcdstore"
)

// review6LossyClient returns a client of the test cluster that, while lose
// is positive, loses the reply of each claim Txn (one comparing an owner
// key under prefix) that etcd applied: the claim landed, the caller sees
// codes.Unavailable.
func review6LossyClient(t *testing.T, prefix string, lose *atomic.Int32, lost *atomic.Int32) *clientv3.Client {
	t.Helper()
	owners := []byte(prefix + "o/")
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{cluster.Members[0].ClientURL},
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				err := invoker(ctx, method, req, reply, cc, opts...)
				if err != nil || !strings.HasSuffix(method, "/Txn") {
					return err
				}
				tr, ok1 := req.(*pb.TxnRequest)
				resp, ok2 := reply.(*pb.TxnResponse)
				if !ok1 || !ok2 || !resp.Succeeded {
					return err
				}
				claim := false
				for _, c := range tr.Compare {
					claim = claim || bytes.HasPrefix(c.Key, owners)
				}
				if claim && lose.Add(-1) >= 0 {
					lost.Add(1)
					return status.Error(codes.Unavailable, "test: reply lost after the txn was applied")
				}
				return err
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// Promise (CHANGELOG 0.5.0, issue 38; HTTP.md on-unknown-outcome): under
// the default save policy the proxy never forwards a request again once an
// earlier attempt of the key may have reached the upstream; a takeover of
// a dead idem's claim answers and saves a 502 upstream-outcome-unknown.
// Here the takeover is made by a process whose claim Txn's reply is lost
// (a network fault, retried by the claim itself): the claim's retry
// recognises its own landed takeover (same owner and attempt) and wins it
// without a Previous record, so mayHaveRun says nothing although the
// record says TookOver and CutShort, and the request is forwarded a second
// time.
func TestReview6ALostTakeoverReplyDoesNotForwardAgain(t *testing.T) {
	prefix := fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
	a := newStore(t, prefix)
	var lose, lost atomic.Int32
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, err := etcdstore.New(ctx, review6LossyClient(t, prefix, &lose, &lost), etcdstore.WithPrefix(prefix),
		etcdstore.WithSessionTTL(5*time.Second), etcdstore.WithBatching(false))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	up := newUpstream(t)
	forwardThenDie(ctx, t, a, up, prefix, "order-1")
	frontB := newFront(t, Config{Store: b}, up, ProxyOptions{})
	released := false
	t.Cleanup(func() {
		if !released {
			close(up.hold)
		}
	})
	lose.Store(1) // the reply of B's takeover is lost
	answered := make(chan reply, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", frontB.URL+"/slow", strings.NewReader(`{"amount":5}`))
		req.Header.Set(HeaderKey, "order-1")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			answered <- reply{status: -1, body: err.Error()}
			return
		}
		defer resp.Body.Close()
		var buf bytes.Buffer
		buf.ReadFrom(resp.Body)
		answered <- reply{resp.StatusCode, resp.Header, buf.String()}
	}()
	select {
	case <-up.entered:
		released = true
		close(up.hold)
		r := <-answered
		t.Fatalf("the retry reached the upstream a second time (lost claim replies: %d; answer %d %s)", lost.Load(), r.status, r.body)
	case r := <-answered:
		if lost.Load() == 0 {
			t.Fatalf("no claim reply was lost: the fault did not fire (answer %d %s)", r.status, r.body)
		}
		if r.status != http.StatusBadGateway || problemType(t, r) != KindUpstreamUnknown {
			t.Fatalf("the retry after a dead claim = %d %s; want 502 %s", r.status, r.body, KindUpstreamUnknown)
		}
		t.Logf("lost %d; answer %d %s", lost.Load(), r.status, r.body)
	case <-ctx.Done():
		t.Fatal("no answer")
	}
}

// Promise (CHANGELOG 0.5.0; mayHaveRun): a claim given back on purpose (a
// StatusPolicy returning EndAbandon) is run again by the next request, in
// another process too; only a claim cut short is not.
func TestReview6AnAbandonOnPurposeIsForwardedAgain(t *testing.T) {
	prefix := fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
	abandon503 := func(r *http.Request, status int, h http.Header) etcdstore.End {
		if status == http.StatusServiceUnavailable {
			return etcdstore.EndAbandon
		}
		return DefaultStatusPolicy(r, status, h)
	}
	up := newUpstream(t)
	frontA := newFront(t, Config{Store: newStore(t, prefix), OnStatus: abandon503}, up, ProxyOptions{})
	frontB := newFront(t, Config{Store: newStore(t, prefix), OnStatus: abandon503}, up, ProxyOptions{})
	if r := do(t, "POST", frontA.URL+"/status?code=503", "order-2", `{"amount":5}`); r.status != http.StatusServiceUnavailable {
		t.Fatalf("first attempt = %d %s; want the upstream's 503", r.status, r.body)
	}
	r := do(t, "POST", frontB.URL+"/status?code=503", "order-2", `{"amount":5}`)
	if r.status != http.StatusCreated || up.effectsOf("order-2") != 2 {
		t.Fatalf("the retry after an abandon on purpose = %d %s (upstream calls %d); want it forwarded again (201)", r.status, r.body, up.effectsOf("order-2"))
	}
	if r := do(t, "POST", frontA.URL+"/status?code=503", "order-2", `{"amount":5}`); r.status != http.StatusCreated || up.effectsOf("order-2") != 2 {
		t.Fatalf("a later retry = %d %s (upstream calls %d); want the 201 replayed", r.status, r.body, up.effectsOf("order-2"))
	}
}
