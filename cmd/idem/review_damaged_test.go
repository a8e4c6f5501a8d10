package main

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
)

// CHANGELOG: "idem serve refuses a damaged embedded data directory ...
// with a 'could not start' line instead of dying in etcd". CheckDataDir
// checks the meta pages and the file's length only; a database whose root
// page is damaged (the meta pages valid, nothing truncated) passes it, and
// etcd then dies on it.
func TestReviewServeRefusesADamagedRootPage(t *testing.T) {
	dir := tempDir(t)
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := c.MustClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 50 {
		if _, err := cli.Put(ctx, "/idem/x/"+strings.Repeat("k", i+1), strings.Repeat("v", 1000)); err != nil {
			t.Fatal(err)
		}
	}
	snap := filepath.Join(dir, "snap.db")
	if out, err := runCmd(t, "snapshot", "save", "--endpoints", c.Endpoints()[0], "--file", snap); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	restored := filepath.Join(dir, "restored")
	peer := "unix://peer-review-damaged.sock"
	if out, err := runCmd(t, "snapshot", "restore", "--file", snap, "--data-dir", restored, "--embedded-peer-url", peer); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	db := filepath.Join(restored, "member", "snap", "db")
	b, err := os.ReadFile(db)
	if err != nil {
		t.Fatal(err)
	}
	// bbolt: page header 16 bytes, then the meta: magic, version, page
	// size (u32 each), flags, root bucket {root pgid, sequence}, freelist,
	// pgid, txid, checksum. The meta with the greater txid is current.
	pageSize := int(binary.LittleEndian.Uint32(b[24:]))
	meta := func(i int) []byte { return b[i*pageSize : (i+1)*pageSize] }
	cur := meta(0)
	if binary.LittleEndian.Uint64(meta(1)[64:]) > binary.LittleEndian.Uint64(cur[64:]) {
		cur = meta(1)
	}
	root := int(binary.LittleEndian.Uint64(cur[32:]))
	if root < 2 || (root+1)*pageSize > len(b) {
		t.Fatalf("root page %d of %d bytes", root, len(b))
	}
	clear(b[root*pageSize : (root+1)*pageSize])
	if err := os.WriteFile(db, b, 0o600); err != nil {
		t.Fatal(err)
	}

	if out, err := serveUntilExit(t, dir, "--data-dir", restored, "--embedded-peer-url", peer); exitCode1(err) != 1 || !strings.Contains(out, "idem could not start") {
		t.Fatalf("idem serve on a database with a damaged root page: %v; want exit 1 with a \"could not start\" line:\n%.1200s", err, out)
	}
}
