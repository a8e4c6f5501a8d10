package main

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// The completion went from completeScript.Run (EVALSHA, then EVAL on
// NOSCRIPT) to a bare EVALSHA of a script loaded once at open: a server
// whose script cache is emptied (a restart, a failover to a replica, SCRIPT
// FLUSH) fails every completion for the rest of the run.
func TestReviewRedisCompletionSurvivesAnEmptiedScriptCache(t *testing.T) {
	port, _ := startRedis(t, "--appendonly", "no")
	var err error
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
