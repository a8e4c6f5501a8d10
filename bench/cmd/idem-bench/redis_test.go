package main

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
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

// With replicas, each write of the Redis side waits (WAIT) until a majority
// of the nodes have it: once run returns, the replica holds the outcome.
func TestRedisSideWaitsForAReplica(t *testing.T) {
	var procs []*exec.Cmd
	start := func(args ...string) int {
		port, srv := startRedis(t, append([]string{"--appendonly", "yes", "--appendfsync", "always"}, args...)...)
		procs = append(procs, srv)
		return port
	}
	primary := start("--repl-diskless-sync-delay", "0")
	replica := start("--replicaof", "127.0.0.1", strconv.Itoa(primary))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r *redisSeed
	var err error
	for {
		if r, err = openRedis(ctx, "127.0.0.1:"+strconv.Itoa(primary), 4, time.Minute); err == nil && r.replicas == 1 {
			break
		}
		if r != nil {
			r.close()
		}
		if ctx.Err() != nil {
			t.Fatalf("the replica never connected: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // the replica syncing
	}
	defer r.close()
	if r.name() != "redis, appendfsync always, WAIT 1 of 1 replicas" {
		t.Fatalf("name %q", r.name())
	}
	rep, err := openRedis(ctx, "127.0.0.1:"+strconv.Itoa(replica), 1, time.Minute)
	if err == nil {
		defer rep.close()
	}
	// openRedis flushes: on a replica that is refused (read only).
	if err == nil || !strings.Contains(err.Error(), "READONLY") {
		t.Fatalf("opening the replica: %v, want READONLY", err)
	}
	for i := 0; i < 20; i++ {
		k := "w" + strconv.Itoa(i)
		if got, err := r.run(ctx, k, []byte("p"), []byte("resp")); err != nil || got != "claimed" {
			t.Fatalf("run %s: %q %v", k, got, err)
		}
		raw, err := redisGet(ctx, replica, "idem:"+k)
		if err != nil || !strings.Contains(raw, `"state":"done"`) {
			t.Fatalf("the replica holds %q (%v) for %s once run returned, want the done record", raw, err, k)
		}
	}
	// A replica that does not answer: the write is not acknowledged.
	if err := procs[1].Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer procs[1].Process.Signal(syscall.SIGCONT)
	if got, err := r.run(ctx, "stopped", []byte("p"), nil); err == nil || !strings.Contains(err.Error(), "replicas acknowledged") {
		t.Fatalf("with the replica stopped: %q %v, want WAIT to fail", got, err)
	}
}

// redisGet reads a key from the server on port.
func redisGet(ctx context.Context, port int, key string) (string, error) {
	cli := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port)})
	defer cli.Close()
	return cli.Get(ctx, key).Result()
}

// startRedis starts a throwaway redis-server on a free loopback port with
// args, stopped when the test ends; it skips the test without one.
func startRedis(t *testing.T, args ...string) (int, *exec.Cmd) {
	t.Helper()
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
	srv := exec.Command(bin, append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", t.TempDir(), "--save", ""}, args...)...)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	return port, srv
}
