package etcdstore

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdtest"
)

// One single-member cluster for the whole package (each member preallocates
// WAL and takes a while to start); a three-member one is started on first
// use. Every test works under its own key prefix.
var (
	single *etcdtest.Cluster

	threeOnce sync.Once
	three     *etcdtest.Cluster
	threeDir  string
	threeErr  error
)

func TestMain(m *testing.M) {
	code := etcdtest.Main(m, 1, etcdtest.Options{}, &single)
	if three != nil {
		three.Close()
	}
	if threeDir != "" {
		os.RemoveAll(threeDir)
	}
	os.Exit(code)
}

// threeMembers returns the shared three-member cluster.
func threeMembers(t testing.TB) *etcdtest.Cluster {
	t.Helper()
	threeOnce.Do(func() {
		if threeDir, threeErr = os.MkdirTemp("", "etcdstore-three-"); threeErr == nil {
			three, threeErr = etcdtest.New(threeDir, 3, etcdtest.Options{})
		}
	})
	if threeErr != nil {
		t.Fatalf("start three-member cluster: %v", threeErr)
	}
	return three
}

// client returns a client of the single-member cluster.
func client(t testing.TB) *clientv3.Client {
	t.Helper()
	return single.MustClient(t)
}

// testPrefix returns a key prefix no other test, and no other run of this
// test (-count), uses.
func testPrefix(t testing.TB) string {
	return fmt.Sprintf("/t/%s/%d/", strings.ReplaceAll(t.Name(), "/", "_"), prefixSeq.Add(1))
}

var prefixSeq atomic.Int64

// newStore returns a store under prefix, closed when the test ends.
func newStore(t testing.TB, cli *clientv3.Client, prefix string, opts ...Option) *Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := New(ctx, cli, append([]Option{WithPrefix(prefix), WithSessionTTL(5 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// revision returns the cluster's current revision.
func revision(t testing.TB, cli *clientv3.Client) int64 {
	t.Helper()
	resp, err := cli.Get(context.Background(), "/no-such-key")
	if err != nil {
		t.Fatalf("read revision: %v", err)
	}
	return resp.Header.Revision
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func fpOf(t testing.TB, params string) Fingerprint {
	t.Helper()
	fp, err := FingerprintOf([]byte(params))
	if err != nil {
		t.Fatalf("FingerprintOf(%q): %v", params, err)
	}
	return fp
}

// newProxy starts a proxy to an etcd client URL, closed when the test ends.
func newProxy(t testing.TB, clientURL string) *etcdtest.Proxy {
	t.Helper()
	p, err := etcdtest.NewProxy(strings.TrimPrefix(clientURL, "http://"))
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}
