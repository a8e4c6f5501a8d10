package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/storex"
)

// A backup and its restore, end to end: idem serve holds saved responses;
// idem snapshot save takes snapshots of its etcd (pruned to --keep); the
// process dies; a snapshot is restored into a new data directory; a new
// idem serve on it replays every key, and the upstream runs nothing again.
func TestSnapshotSaveRestoreReplays(t *testing.T) {
	dir := tempDir(t)
	up := newLedger(t)
	flags := embeddedFlags(t, filepath.Join(dir, "data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL)...)
	const n = 20
	first := map[string]string{}
	for i := range n {
		key := fmt.Sprint("order-", i)
		r := send(t, "POST", idem.listen+"/charges", key, fmt.Sprintf(`{"order":%q}`, key))
		if r.status != 201 {
			t.Fatalf("%s: %d %s", key, r.status, r.body)
		}
		first[key] = r.body
	}
	backups := filepath.Join(dir, "backups")
	endpoint := etcdEndpoint(flags)
	before := tokenOf(t, endpoint, fmt.Sprint("order-", n-1))
	for range 3 {
		out, err := runCmd(t, "snapshot", "save", "--endpoints", endpoint, "--dir", backups, "--keep", "2")
		if err != nil || !strings.Contains(out, "saved ") {
			t.Fatalf("snapshot save: %v\n%s", err, out)
		}
	}
	files, _ := filepath.Glob(filepath.Join(backups, snapshotPrefix+"*.db"))
	if len(files) != 2 {
		t.Fatalf("%d snapshots kept, want 2 (three taken, --keep 2): %v", len(files), files)
	}
	// The names are the ones docs/OPERATIONS.md shows.
	named := regexp.MustCompile(`idem-etcd-\d{8}T\d{6}\.\d{3}Z\.db`)
	ops, err := os.ReadFile("../../docs/OPERATIONS.md")
	if err != nil {
		t.Fatal(err)
	}
	if !named.MatchString(filepath.Base(files[0])) || !named.Match(ops) {
		t.Fatalf("snapshot %s, or the name docs/OPERATIONS.md shows, is not %s", filepath.Base(files[0]), named)
	}
	idem.kill()

	restored := filepath.Join(dir, "restored")
	peer := "unix://peer-restored.sock"
	// Bad input changes nothing.
	if _, err := runCmd(t, "snapshot", "restore", "--file", files[len(files)-1], "--data-dir", filepath.Join(dir, "data")); err == nil {
		t.Fatal("restore into an existing data directory was accepted")
	}
	if _, err := runCmd(t, "snapshot", "restore", "--file", filepath.Join(dir, "nope.db"), "--data-dir", restored); err == nil {
		t.Fatal("restore of a missing file was accepted")
	}
	if _, err := os.Stat(restored); err == nil {
		t.Fatal("a refused restore left a data directory")
	}
	// The restored member's peer URL is the one the new idem serve gives
	// its embedded etcd (a socket relative to its directory).
	out, err := runCmd(t, "snapshot", "restore", "--file", files[len(files)-1], "--data-dir", restored, "--embedded-peer-url", peer)
	if err != nil {
		t.Fatalf("snapshot restore: %v\n%s", err, out)
	}
	again := startIdem(t, filepath.Join(dir, "work"), "--data-dir", restored, "--embedded-peer-url", peer, "--upstream", up.URL)
	for i := range n {
		key := fmt.Sprint("order-", i)
		r := send(t, "POST", again.listen+"/charges", key, fmt.Sprintf(`{"order":%q}`, key))
		if r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" || r.body != first[key] {
			t.Fatalf("%s after restore: %d replayed=%q %s, want the first answer replayed", key, r.status, r.header.Get("Idempotent-Replayed"), r.body)
		}
		if c := up.count(key); c != 1 {
			t.Fatalf("%s charged %d times", key, c)
		}
	}
	// A new key's fencing token is greater than any before the snapshot:
	// the restore moved the revision on (--bump-revision).
	if r := send(t, "POST", again.listen+"/charges", "order-new", `{"order":"order-new"}`); r.status != 201 {
		t.Fatalf("a new key after restore: %d %s", r.status, r.body)
	}
	ep := "unix://" + filepath.Join(restored, "etcd.sock")
	if after := tokenOf(t, ep, "order-new"); after <= before {
		t.Fatalf("token after the restore %d, before %d: tokens went backwards", after, before)
	}
	// The shard epoch, a key of the snapshot, was raised before the
	// restored idem served (tokens of keys moved in from other shards
	// since the snapshot stay below the next), and the marker is gone.
	if _, err := os.Stat(filepath.Join(restored, restoredMarker)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("restore marker after idem serve started: %v; want it removed", err)
	}
	if out, err := runCmd(t, "snapshot", "bump-epoch", "--endpoints", ep, "--by", "0"); exitCode(err) != 2 {
		t.Fatalf("bump-epoch --by 0 was accepted: %s", out)
	}
	out, err = runCmd(t, "snapshot", "bump-epoch", "--endpoints", ep, "--by", "1")
	if want := fmt.Sprintf("raised by 1 to %d", storex.DefaultRestoreEpochBump+1); err != nil || !strings.Contains(out, want) {
		t.Fatalf("bump-epoch after the restore: %v %q; want %q (idem serve raised it by %d first)", err, out, want, storex.DefaultRestoreEpochBump)
	}
}

// tokenOf reads a key's fencing token with idem get.
func tokenOf(t *testing.T, endpoint, key string) int64 {
	t.Helper()
	out, err := runCmd(t, "get", "--endpoints", endpoint, "-w", "json", key)
	if err != nil {
		t.Fatalf("idem get %s: %v\n%s", key, err, out)
	}
	var rec struct{ Token int64 }
	if err := json.Unmarshal([]byte(out), &rec); err != nil || rec.Token <= 0 {
		t.Fatalf("idem get %s: %q: %v", key, out, err)
	}
	return rec.Token
}

// A restore is all or nothing: a truncated or damaged snapshot is refused
// with a short error and leaves no directory behind (the same command
// then works with a good file); save never overwrites a backup; and idem
// serve refuses a damaged data directory with a "could not start" line
// instead of crashing in etcd.
func TestSnapshotRestoreIsAllOrNothing(t *testing.T) {
	dir := tempDir(t)
	up := newLedger(t)
	flags := embeddedFlags(t, filepath.Join(dir, "data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL)...)
	if r := send(t, "POST", idem.listen+"/charges", "order-1", `{"order":"order-1"}`); r.status != 201 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	good := filepath.Join(dir, "good.db")
	if out, err := runCmd(t, "snapshot", "save", "--endpoints", etcdEndpoint(flags), "--file", good); err != nil {
		t.Fatalf("snapshot save: %v\n%s", err, out)
	}
	idem.kill()
	saved, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := runCmd(t, "snapshot", "save", "--endpoints", etcdEndpoint(flags), "--file", good); exitCode(err) != 2 || !strings.Contains(err.Error(), "exists") {
		t.Fatalf("snapshot save over an existing backup: %v\n%s; want exit 2 naming the file", err, out)
	}
	if now, _ := os.ReadFile(good); string(now) != string(saved) {
		t.Fatal("a refused save changed the existing backup")
	}

	truncated, flipped := filepath.Join(dir, "truncated.db"), filepath.Join(dir, "flipped.db")
	if err := os.WriteFile(truncated, saved[:len(saved)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	bad := append([]byte(nil), saved...)
	bad[len(bad)/3] ^= 0xff
	if err := os.WriteFile(flipped, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	restored := filepath.Join(dir, "restored")
	for _, f := range []string{truncated, flipped} {
		out, err := runCmd(t, "snapshot", "restore", "--file", f, "--data-dir", restored)
		if err == nil || !strings.Contains(err.Error(), "not a whole etcd snapshot") || len(err.Error()) > 600 {
			t.Fatalf("restore of %s: %v\n%s; want a short error saying the snapshot is not whole", filepath.Base(f), err, out)
		}
		if _, err := os.Stat(restored); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a failed restore of %s left %s: %v", filepath.Base(f), restored, err)
		}
		if left, _ := filepath.Glob(filepath.Join(dir, ".restored.restoring-*")); len(left) != 0 {
			t.Fatalf("a failed restore of %s left %v", filepath.Base(f), left)
		}
	}
	peer := "unix://peer-allornothing.sock"
	if out, err := runCmd(t, "snapshot", "restore", "--file", good, "--data-dir", restored, "--embedded-peer-url", peer); err != nil {
		t.Fatalf("restore of the good file after the failures: %v\n%s", err, out)
	}

	// Damage the restored database as a disk would: cut it short.
	db := filepath.Join(restored, "member", "snap", "db")
	info, err := os.Stat(db)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(db, info.Size()/2); err != nil {
		t.Fatal(err)
	}
	out, err := serveUntilExit(t, dir, "--data-dir", restored, "--embedded-peer-url", peer, "--upstream", up.URL)
	if exitCode1(err) != 1 || !strings.Contains(out, "idem could not start") || !strings.Contains(out, "damaged") {
		t.Fatalf("idem serve on a truncated database: %v; want exit 1 with a \"could not start\" line naming the damage:\n%s", err, out)
	}
}

// serveUntilExit runs idem serve (the test binary as idem) with args in dir
// until it exits, within 60 s, and returns what it logged and how it
// exited.
func serveUntilExit(t *testing.T, dir string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-format", "json"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "IDEM_TEST_RUN_MAIN=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		return stderr.String(), err
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		<-exited
		t.Fatalf("idem serve %v still runs after 60 s:\n%s", args, stderr.String())
		return "", nil
	}
}

// exitCode1 is a finished process's exit status (0 for nil, -1 when it
// did not exit on its own).
func exitCode1(err error) int {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.ExitCode()
	}
	return -1
}
