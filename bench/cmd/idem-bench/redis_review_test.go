package main

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// The completion went from completeScript.Run (EVALSHA, then EVAL on
// NOSCRIPT) to a bare EVALSHA of a script loaded once at open: a server
// whose script cache is emptied (a restart, a failover to a replica, SCRIPT
// FLUSH) fails every completion for the rest of the run.
func TestReviewRedisCompletionSurvivesAnEmptiedScriptCache(t *testing.T) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("no redis-server")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	srv := exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", t.TempDir(), "--save", "", "--appendonly", "no")
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r *redisSeed
	for {
		if r, err = openRedis(ctx, "127.0.0.1:"+strconv.Itoa(port), 2, time.Minute); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("redis-server never answered: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer r.close()
	if err := r.cli.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if got, err := r.run(ctx, "k", []byte("p"), []byte("resp")); err != nil || got != "claimed" {
		t.Fatalf("run after the script cache was emptied: %q %v", got, err)
	}
}
