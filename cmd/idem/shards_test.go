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

// idem serve over two etcd clusters: keys spread over both, replays and
// the admin commands find them, the worker API works across them, and a
// shard cut off makes only its own keys unavailable.
func TestServeShards(t *testing.T) {
	dir := tempDir(t)
	file, proxies := twoShards(t, "")
	up := newShop(t)
	idem := startIdem(t, filepath.Join(dir, "work"), "--shards-file", file, "--upstream", up.URL, "--request-timeout", "2s")
	keys := map[string]string{} // key -> first body
	for i := 0; i < 12; i++ {
		k := fmt.Sprintf("order-%d", i)
		r := send(t, "POST", idem.listen+"/pay", k, `{}`)
		again := send(t, "POST", idem.listen+"/pay", k, `{}`)
		if r.status != 201 || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("%s: %d %q then %q", k, r.status, r.body, again.body)
		}
		keys[k] = r.body
	}
	if _, effects := up.counts(); effects != 12 {
		t.Fatalf("%d effects for 12 keys", effects)
	}
	out, err := runCmd(t, "status", "--shards-file", file)
	if err != nil || !strings.Contains(out, "shard a\n") || !strings.Contains(out, "shard b\n") {
		t.Fatalf("idem status over shards = %q, %v", out, err)
	}
	var perShard []int
	for _, line := range strings.Split(out, "\n") {
		var n int
		if _, err := fmt.Sscanf(line, "keys=%d", &n); err == nil {
			perShard = append(perShard, n)
		}
	}
	if len(perShard) != 2 || perShard[0] == 0 || perShard[1] == 0 || perShard[0]+perShard[1] != 12 {
		t.Fatalf("keys per shard %v; want 12 spread over both", perShard)
	}
	for k := range keys {
		if out, err := runCmd(t, "get", "--shards-file", file, k); err != nil || !strings.Contains(out, "state=done") {
			t.Fatalf("idem get %s over shards = %q, %v", k, out, err)
		}
	}
	if out, err := runCmd(t, "ls", "--shards-file", file, "-w", "json"); err != nil || strings.Count(out, `"key":`) != 12 {
		t.Fatalf("idem ls over shards = %q, %v", out, err)
	}

	// The worker API over the same shards.
	api := startIdem(t, dir, "--shards-file", file)
	r := send(t, "POST", api.listen+"/v1/claim", "", `{"key":"job-1","params":{}}`)
	var c struct{ Handle json.RawMessage }
	if r.status != 201 || json.Unmarshal([]byte(r.body), &c) != nil {
		t.Fatalf("claim over shards = %d %q", r.status, r.body)
	}
	if r := send(t, "POST", api.listen+"/v1/complete", "", `{"handle":`+string(c.Handle)+`,"outcome":{"body":"b2s="}}`); r.status != 200 {
		t.Fatalf("complete over shards = %d %q", r.status, r.body)
	}

	// Jobs over the same shards: submitted through the worker API and the
	// command line, each on its key's shard, found, signalled, cancelled.
	for i := 0; i < 8; i++ {
		id := fmt.Sprintf("job-%d", i)
		if r := send(t, "POST", api.listen+"/v1/jobs", "", `{"id":"`+id+`","kind":"report","params":{"n":`+fmt.Sprint(i)+`}}`); r.status != 201 {
			t.Fatalf("submit %s over shards = %d %q", id, r.status, r.body)
		}
		if r := send(t, "GET", api.listen+"/v1/jobs/"+id, "", ""); r.status != 200 || !strings.Contains(r.body, `"queued"`) {
			t.Fatalf("get %s over shards = %d %q", id, r.status, r.body)
		}
		if r := send(t, "POST", api.listen+"/v1/jobs/"+id+"/signals/go", "", `{"payload":{"ok":true}}`); r.status != 202 {
			t.Fatalf("signal %s over shards = %d %q", id, r.status, r.body)
		}
	}
	if out, err := runCmd(t, "jobs", "ls", "--shards-file", file, "-w", "json"); err != nil || strings.Count(out, `"id":`) != 8 {
		t.Fatalf("idem jobs ls over shards = %q, %v; want the 8 jobs", out, err)
	}
	if out, err := runCmd(t, "jobs", "submit", "--shards-file", file, "--params", `{"n":3}`, "job-3", "report"); err != nil || !strings.Contains(out, "job-3") {
		t.Fatalf("idem jobs submit of an existing job over shards = %q, %v; want it returned", out, err)
	}
	if out, err := runCmd(t, "jobs", "submit", "--shards-file", file, "--params", `{"n":4}`, "job-3", "report"); !errors.Is(err, etcdstore.ErrMismatch) {
		t.Fatalf("idem jobs submit with other params over shards = %q, %v; want a mismatch", out, err)
	}
	if out, err := runCmd(t, "jobs", "signal", "--shards-file", file, "--payload", `{"ok":true}`, "job-5", "go"); err != nil {
		t.Fatalf("idem jobs signal over shards = %q, %v", out, err)
	}
	if out, err := runCmd(t, "jobs", "cancel", "--shards-file", file, "job-5"); err != nil || !strings.Contains(out, "cancelled") {
		t.Fatalf("idem jobs cancel over shards = %q, %v", out, err)
	}
	if out, err := runCmd(t, "jobs", "get", "--shards-file", file, "job-5"); err != nil || !strings.Contains(out, "cancelled") {
		t.Fatalf("idem jobs get over shards = %q, %v", out, err)
	}
	if out, err := runCmd(t, "jobs", "schedules", "--shards-file", file, "-w", "json"); err != nil || strings.TrimSpace(out) != "[]" {
		t.Fatalf("idem jobs schedules over shards = %q, %v; want none", out, err)
	}

	// Shard a (the first: checks used to run one after another under one
	// deadline, and a hung first shard failed them all) cut off: its keys
	// 503, b's keep working; /readyz degraded, naming a only.
	proxies[0].Blackhole()
	onA, onB := 0, 0
	for i := 100; i < 110; i++ {
		k := fmt.Sprintf("order-%d", i)
		r := send(t, "POST", idem.listen+"/pay", k, `{}`)
		switch r.status {
		case 201:
			onB++
		case 503:
			onA++
		default:
			t.Fatalf("%s with shard a cut off = %d %q", k, r.status, r.body)
		}
	}
	if onA == 0 || onB == 0 {
		t.Fatalf("with a cut off: %d served, %d refused; want both", onB, onA)
	}
	if r := send(t, "GET", idem.admin+"/readyz", "", ""); r.status != 200 || !strings.Contains(r.body, "degraded: shard a") || strings.Contains(r.body, "shard b") {
		t.Fatalf("/readyz with a cut off = %d %q; want 200 degraded, naming a only", r.status, r.body)
	}
	// idem status reports b, and a as not answering.
	out, err = runCmd(t, "status", "--shards-file", file, "--command-timeout", "2s")
	if err != nil || !strings.Contains(out, "shard a\n") || !strings.Contains(out, "does not answer") || !strings.Contains(out, "shard b\n") || !strings.Contains(out, "keys=") {
		t.Fatalf("idem status with a cut off = %q, %v; want b reported and a marked", out, err)
	}
	// A process started while a is down serves b's keys at once.
	if err := os.MkdirAll(filepath.Join(dir, "late"), 0o755); err != nil {
		t.Fatal(err)
	}
	late := startIdem(t, filepath.Join(dir, "late"), "--shards-file", file, "--upstream", up.URL, "--request-timeout", "2s")
	served := 0
	for i := 200; i < 210; i++ {
		k := fmt.Sprintf("order-%d", i)
		switch r := send(t, "POST", late.listen+"/pay", k, `{}`); r.status {
		case 201:
			served++
		case 503:
		default:
			t.Fatalf("%s on a process started with a down = %d %q", k, r.status, r.body)
		}
	}
	if served == 0 {
		t.Fatal("a process started with shard a down served none of b's keys")
	}
	proxies[0].Heal()

	// After a restore of shard b alone, its epoch goes above the set's.
	if out, err := runCmd(t, "snapshot", "bump-epoch", "--shards-file", file); exitCode(err) != 2 {
		t.Fatalf("bump-epoch --shards-file without --shard: %v %q; want exit 2", err, out)
	}
	out, err = runCmd(t, "snapshot", "bump-epoch", "--shards-file", file, "--shard", "b", "--by", "5")
	var from, to, high int64
	if _, serr := fmt.Sscanf(out, "shard epoch of shard b raised from %d to %d (the set's greatest was %d)", &from, &to, &high); err != nil || serr != nil || to != high+5 || to <= from {
		t.Fatalf("bump-epoch --shards-file --shard b --by 5: %v %q; want b raised to 5 above the set's greatest epoch", err, out)
	}
}
