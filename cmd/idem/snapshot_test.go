package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idem-dev/idem/etcdstore"
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
	if want := fmt.Sprintf("raised by 1 to %d", etcdstore.DefaultRestoreEpochBump+1); err != nil || !strings.Contains(out, want) {
		t.Fatalf("bump-epoch after the restore: %v %q; want %q (idem serve raised it by %d first)", err, out, want, etcdstore.DefaultRestoreEpochBump)
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
