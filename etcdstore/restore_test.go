package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	etcdutl "go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/internal/embedded"
)

// restoreWorld is one etcd member behind a proxy (the address clients
// know), that a test snapshots, stops, and replaces by a cluster restored
// from the snapshot with etcdutl, as an operator does.
type restoreWorld struct {
	t     *testing.T
	dir   string
	peer  string
	token string
	etcd  *embed.Etcd
	proxy *etcdtest.Proxy
	cli   *clientv3.Client
	snap  string
}

func newRestoreWorld(t *testing.T) *restoreWorld {
	ports, err := etcdtest.FreePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	w := &restoreWorld{t: t, dir: t.TempDir(), peer: fmt.Sprintf("http://127.0.0.1:%d", ports[1]), token: "before"}
	w.etcd = w.start(filepath.Join(w.dir, "a"), fmt.Sprintf("http://127.0.0.1:%d", ports[0]))
	if w.proxy, err = etcdtest.NewProxy(strings.TrimPrefix(w.etcd.Config().ListenClientUrls[0].String(), "http://")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.proxy.Close)
	if w.cli, err = clientv3.New(clientv3.Config{Endpoints: []string{w.proxy.URL()}, DialTimeout: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.cli.Close() })
	return w
}

func (w *restoreWorld) start(dir, clientURL string) *embed.Etcd {
	ctx, cancel := context.WithTimeout(context.Background(), embedded.ReadyTimeout)
	defer cancel()
	e, err := embedded.Start(ctx, embedded.Config{Name: "r", Dir: dir, ClientURL: clientURL, PeerURL: w.peer,
		InitialCluster: "r=" + w.peer, ClusterToken: w.token, NoFsync: true, Logger: zap.NewNop()})
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(closeOnce(e))
	return e
}

var closed sync.Map // *embed.Etcd -> func()

// closeOnce returns e's Close, run at most once however often it is called.
func closeOnce(e *embed.Etcd) func() {
	f, _ := closed.LoadOrStore(e, sync.OnceFunc(e.Close))
	return f.(func())
}

// snapshot saves the member's snapshot.
func (w *restoreWorld) snapshot(ctx context.Context) {
	rc, err := w.cli.Snapshot(ctx)
	if err != nil {
		w.t.Fatal(err)
	}
	defer rc.Close()
	w.snap = filepath.Join(w.dir, "snap.db")
	f, err := os.Create(w.snap)
	if err != nil {
		w.t.Fatal(err)
	}
	if _, err := f.ReadFrom(rc); err != nil {
		w.t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		w.t.Fatal(err)
	}
}

// restore stops the member and starts one restored from the snapshot
// (with cluster token token: the same makes the same cluster ID; without
// --bump-revision), behind the same address, and returns once the client
// reaches it (as an operator waits for the member to answer).
func (w *restoreWorld) restore(token string) {
	closeOnce(w.etcd)()
	w.token = token
	dir := filepath.Join(w.dir, "b")
	if err := etcdutl.NewV3(zap.NewNop()).Restore(etcdutl.RestoreConfig{SnapshotPath: w.snap, Name: "r", OutputDataDir: dir,
		PeerURLs: []string{w.peer}, InitialCluster: "r=" + w.peer, InitialClusterToken: token}); err != nil {
		w.t.Fatal(err)
	}
	ports, err := etcdtest.FreePorts(1)
	if err != nil {
		w.t.Fatal(err)
	}
	w.etcd = w.start(dir, fmt.Sprintf("http://127.0.0.1:%d", ports[0]))
	w.proxy.Retarget(strings.TrimPrefix(w.etcd.Config().ListenClientUrls[0].String(), "http://"))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w.reachable(ctx)
}

// reachable waits until the client reaches the restored member through
// the proxy (gRPC backs off reconnecting while nothing answered).
func (w *restoreWorld) reachable(ctx context.Context) {
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := w.cli.Get(cctx, "reachable")
		cancel()
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			w.t.Fatalf("the restored member never answered: %v", err)
		}
	}
}

// claimDone claims key and completes it, retrying while the store says
// etcd is unavailable (a restore being handled); it returns the claim's
// token and the errors it met.
func claimDone(t *testing.T, s *Store, key string) (int64, []error) {
	var errs []error
	// Bounded by time, not tries: under load the new session takes a few
	// seconds after the restore (CI once needed more than 100 tries).
	for give := time.Now().Add(time.Minute); time.Now().Before(give); {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, _, err := s.Claim(ctx, Key{ID: key}, fpOf(t, key))
		if err == nil {
			err = c.Complete(ctx, Outcome{Body: []byte(key)})
			cancel()
			if err == nil {
				return int64(c.Token()), errs
			}
		}
		cancel()
		errs = append(errs, err)
		if !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrConflict) && !errors.Is(err, ErrFenced) {
			t.Fatalf("claim %s: %v", key, err)
		}
		time.Sleep(50 * time.Millisecond) // a retrying client's backoff
	}
	t.Fatalf("claim %s: still failing after a minute (%d tries): %v", key, len(errs), errs[len(errs)-1])
	return 0, nil
}

// Issue 38: a cluster restored with etcdutl (no --bump-revision, the same
// cluster ID) took fencing tokens back unless the operator remembered idem
// snapshot bump-epoch. A running store sees etcd's revision go back, raises
// the epoch by itself, and hands out greater tokens.
func TestARunningStoreRaisesTheEpochAfterARestore(t *testing.T) {
	w := newRestoreWorld(t)
	ctx := testCtx(t)
	s := newStore(t, w.cli, testPrefix(t))
	claimDone(t, s, "before")
	w.snapshot(ctx)
	var high int64
	for i := range 20 {
		tok, _ := claimDone(t, s, "after-"+strconv.Itoa(i))
		high = max(high, tok)
	}
	w.restore("before")
	tok, errs := claimDone(t, s, "after-restore")
	if tok <= high {
		t.Fatalf("after the restore, token %d; before it, up to %d: tokens went back", tok, high)
	}
	saw := false
	for _, err := range errs {
		saw = saw || errors.Is(err, ErrRestored) && strings.Contains(err.Error(), "revision went back")
	}
	if !saw {
		t.Fatalf("no write said that etcd was restored (errors: %v)", errs)
	}
	// The key claimed after the snapshot is gone with the restore; claimed
	// again, its token too is above every one before.
	if tok, _ := claimDone(t, s, "after-0"); tok <= high {
		t.Fatalf("a key lost with the restore, claimed again: token %d, not above %d", tok, high)
	}
}

// A store that starts on a restored cluster (a new cluster token, as the
// procedure says: a new cluster ID) never saw the tokens before it: the
// prefix's record of the cluster it was served from tells it, and it
// raises the epoch before it serves.
func TestAStoreStartingOnARestoredClusterRaisesTheEpoch(t *testing.T) {
	w := newRestoreWorld(t)
	ctx := testCtx(t)
	prefix := testPrefix(t)
	s := newStore(t, w.cli, prefix)
	claimDone(t, s, "before")
	w.snapshot(ctx)
	var high int64
	for i := range 20 {
		tok, _ := claimDone(t, s, "after-"+strconv.Itoa(i))
		high = max(high, tok)
	}
	s.Close()
	w.restore("after")
	fresh := newStore(t, w.cli, prefix)
	if tok, _ := claimDone(t, fresh, "after-0"); tok <= high {
		t.Fatalf("a store started after the restore: token %d, not above %d", tok, high)
	}
	// And once: a second store on it raises nothing more.
	e := fresh.currentEpoch()
	second := newStore(t, w.cli, prefix)
	if second.currentEpoch() != e {
		t.Fatalf("a second store raised the epoch again: %d, after %d", second.currentEpoch(), e)
	}
}

// While the epoch cannot be raised (here: it is at its greatest), the
// store refuses to write, saying what happened; it never hands out a
// token lower than one before.
func TestAStoreThatCannotRaiseTheEpochRefusesToWrite(t *testing.T) {
	w := newRestoreWorld(t)
	ctx := testCtx(t)
	prefix := testPrefix(t)
	top := int64(1<<(63-epochShift) - 10)
	if _, err := w.cli.Put(ctx, prefix+"epoch", strconv.FormatInt(top, 10)); err != nil {
		t.Fatal(err)
	}
	s := newStore(t, w.cli, prefix)
	claimDone(t, s, "before")
	w.snapshot(ctx)
	for i := range 20 {
		claimDone(t, s, "after-"+strconv.Itoa(i))
	}
	w.restore("before")
	var last error
	restored := 0 // tries refused as after a restore
	deadline := time.Now().Add(time.Minute)
	for restored < 3 && time.Now().Before(deadline) {
		// The first claim refused may have landed (its answer showed the
		// restore); the later ones are never sent.
		key := "refused"
		if restored > 0 {
			key = "later"
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, _, err := s.Claim(cctx, Key{ID: key}, fpOf(t, key))
		cancel()
		if err == nil {
			t.Fatalf("a claim after a restore the store cannot handle was granted, token %d", c.Token())
		}
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("claim after the restore = %v; want ErrUnavailable", err)
		}
		if errors.Is(err, ErrRestored) {
			restored, last = restored+1, err
		} else if last == nil {
			time.Sleep(100 * time.Millisecond) // the session reconnects meanwhile: a client's backoff
		}
	}
	if !errors.Is(last, ErrRestored) || !strings.Contains(last.Error(), "revision went back") {
		t.Fatalf("a claim refused after the restore says %v; want ErrRestored, naming what was seen", last)
	}
	if resp, err := w.cli.Get(ctx, s.ks.record(Key{ID: "later"})); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("a claim refused while the epoch is not raised wrote its record: %v, %v", resp, err)
	}
}
