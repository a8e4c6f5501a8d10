package main

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// The Redis side does what idempotency-key libraries on Redis do, against a
// real redis-server: a fresh key is claimed and completed, a retry replays,
// other params are a mismatch, a claim in flight is a conflict, and a
// completion whose claim was replaced is fenced out.
func TestRedisSide(t *testing.T) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("no redis-server on the PATH (.ci/run installs Debian's): the Redis side is not tested here")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	srv := exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", t.TempDir(), "--save", "",
		"--appendonly", "yes", "--appendfsync", "always")
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r *redisSeed
	for {
		if r, err = openRedis(ctx, "127.0.0.1:"+strconv.Itoa(port), 4, time.Minute); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("redis-server never answered: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // the server starting
	}
	defer r.close()
	if r.name() != "redis, appendfsync always" {
		t.Fatalf("name %q", r.name())
	}
	for i, want := range []string{"claimed", "replayed"} {
		if got, err := r.run(ctx, "k1", []byte("p"), []byte("resp")); err != nil || got != want {
			t.Fatalf("call %d: %q %v, want %q", i, got, err, want)
		}
	}
	if got, err := r.run(ctx, "k1", []byte("other"), nil); err != nil || got != "mismatch" {
		t.Fatalf("other params: %q %v, want mismatch", got, err)
	}
	// A claim in flight: written as SET NX would, never completed.
	if err := r.cli.Set(ctx, "idem:k2", `{"fp":"`+strconv.FormatUint(hash([]byte("p")), 16)+`","state":"in_flight","claim":"x"}`, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if got, err := r.run(ctx, "k2", []byte("p"), nil); err != nil || got != "conflict" {
		t.Fatalf("a key in flight: %q %v, want conflict", got, err)
	}
	// The completion script saves only while the key holds the claim.
	n, err := completeScript.Run(ctx, r.cli, []string{"idem:k2"}, "not-the-claim", "done", 60000).Int()
	if err != nil || n != 0 {
		t.Fatalf("a completion with another claim: %d %v, want 0 (fenced out)", n, err)
	}
}
