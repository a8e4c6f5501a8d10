package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisSeed is the pattern idempotency-key libraries build on Redis: SET
// NX PX claims a key (its value names the claim), a Lua script completes it
// only while the claim is still ours, and GET replays.
type redisSeed struct {
	cli       *redis.Client
	addr      string
	appendOn  string // CONFIG appendonly
	fsync     string // CONFIG appendfsync
	retention time.Duration
	// replicas connected to this primary, and how many of them each write
	// waits for (WAIT): a majority of the nodes, as a raft quorum.
	replicas, wait int
}

// redisRecord is what a key holds.
type redisRecord struct {
	FP       string `json:"fp"`
	State    string `json:"state"`
	Claim    string `json:"claim,omitempty"`
	Response []byte `json:"response,omitempty"`
}

// completeScript saves the response if the key still holds this claim.
var completeScript = redis.NewScript(`
if redis.call("GET", KEYS[1]) == ARGV[1] then
  redis.call("SET", KEYS[1], ARGV[2], "PX", ARGV[3])
  return 1
end
return 0`)

func openRedis(ctx context.Context, addr string, conns int, retention time.Duration) (*redisSeed, error) {
	cli := redis.NewClient(&redis.Options{Addr: addr, PoolSize: conns, MinIdleConns: conns / 4})
	r := &redisSeed{cli: cli, addr: addr, retention: retention}
	for _, c := range []struct {
		name string
		dst  *string
	}{{"appendonly", &r.appendOn}, {"appendfsync", &r.fsync}} {
		v, err := cli.ConfigGet(ctx, c.name).Result()
		if err != nil {
			cli.Close()
			return nil, fmt.Errorf("--redis %s: %w", addr, err)
		}
		*c.dst = v[c.name]
	}
	info, err := cli.Info(ctx, "replication").Result()
	if err != nil {
		cli.Close()
		return nil, fmt.Errorf("--redis %s: %w", addr, err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "connected_slaves:"); ok {
			r.replicas, _ = strconv.Atoi(v)
		}
	}
	r.wait = (r.replicas + 1) / 2 // with the primary, a majority of the nodes
	if err := completeScript.Load(ctx, cli).Err(); err != nil {
		cli.Close()
		return nil, fmt.Errorf("--redis %s: %w", addr, err)
	}
	if err := cli.FlushDB(ctx).Err(); err != nil {
		cli.Close()
		return nil, fmt.Errorf("--redis %s: %w", addr, err)
	}
	return r, nil
}

func (r *redisSeed) close() { r.cli.Close() }

// name is the side's name: its durability setting.
func (r *redisSeed) name() string {
	n := "redis, no AOF"
	if r.appendOn == "yes" {
		n = "redis, appendfsync " + r.fsync
	}
	if r.wait > 0 {
		n += fmt.Sprintf(", WAIT %d of %d replicas", r.wait, r.replicas)
	}
	return n
}

// replicated waits, on the connection that wrote, until r.wait replicas
// have the write (the pipeline sends both in one round trip).
func (r *redisSeed) replicated(ctx context.Context, write func(redis.Pipeliner) redis.Cmder) (redis.Cmder, error) {
	if r.wait == 0 {
		var c redis.Cmder
		_, err := r.cli.Pipelined(ctx, func(p redis.Pipeliner) error { c = write(p); return nil })
		return c, err
	}
	var c redis.Cmder
	var w *redis.Cmd
	_, err := r.cli.Pipelined(ctx, func(p redis.Pipeliner) error {
		c = write(p)
		w = p.Do(ctx, "WAIT", r.wait, 2000) // under the client's 3 s read timeout
		return nil
	})
	if err != nil {
		return nil, err
	}
	if n, _ := w.Int64(); n < int64(r.wait) {
		return nil, fmt.Errorf("WAIT %d: %d replicas acknowledged within 2 s", r.wait, n)
	}
	return c, nil
}

// run claims with SET NX PX, runs the work, completes fenced on the claim;
// or replays, refuses a mismatch, or answers a conflict.
func (r *redisSeed) run(ctx context.Context, key string, params, resp []byte) (string, error) {
	fp := strconv.FormatUint(hash(params), 16)
	claim, _ := json.Marshal(redisRecord{FP: fp, State: "in_flight", Claim: strconv.FormatUint(rand.Uint64(), 36)})
	k := "idem:" + key
	set, err := r.replicated(ctx, func(p redis.Pipeliner) redis.Cmder { return p.SetNX(ctx, k, claim, r.retention) })
	if err != nil {
		return "", err
	}
	if set.(*redis.BoolCmd).Val() {
		done, _ := json.Marshal(redisRecord{FP: fp, State: "done", Response: resp})
		complete := func(p redis.Pipeliner) redis.Cmder {
			return p.EvalSha(ctx, completeScript.Hash(), []string{k}, claim, done, r.retention.Milliseconds())
		}
		ran, err := r.replicated(ctx, complete)
		if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			// The server lost its scripts (a restart, a failover, SCRIPT
			// FLUSH): load it again; EVALSHA of an unknown script ran nothing.
			if err = completeScript.Load(ctx, r.cli).Err(); err == nil {
				ran, err = r.replicated(ctx, complete)
			}
		}
		if err != nil {
			return "", err
		}
		n, err := ran.(*redis.Cmd).Int()
		if err != nil {
			return "", err
		}
		if n != 1 {
			return "", errors.New("fenced out")
		}
		return "claimed", nil
	}
	raw, err := r.cli.Get(ctx, k).Bytes()
	switch {
	case errors.Is(err, redis.Nil):
		return "conflict", nil // expired between the two calls
	case err != nil:
		return "", err
	}
	var rec redisRecord
	if err := json.Unmarshal(raw, &rec); err != nil {
		return "", err
	}
	switch {
	case rec.FP != fp:
		return "mismatch", nil
	case rec.State == "done":
		return "replayed", nil
	}
	return "conflict", nil
}

// redisGuarantees says what a Redis side buys, beside its figure.
func redisGuarantees(rs []*redisSeed) string {
	var ss []string
	for _, r := range rs {
		g := "an acknowledged claim may be lost by a crash (no AOF)"
		switch {
		case r.appendOn == "yes" && r.fsync == "always":
			g = "an acknowledged claim is on its disk (fsync per write), on one node: a failover to a replica can lose it"
		case r.appendOn == "yes" && r.fsync == "everysec":
			g = "an acknowledged claim may be lost by a crash within a second (fsync every second), and by a failover"
		}
		if r.wait > 0 {
			g = fmt.Sprintf("an acknowledged claim is on the primary's disk and in the memory of %d of %d replicas (WAIT: not on their disks, and Redis documents that a failover can still lose it: replication is asynchronous, WAIT does not make it a consensus)", r.wait, r.replicas)
		}
		ss = append(ss, r.name()+": "+g)
	}
	return strings.Join(ss, "; ") + "; idem: a raft quorum (fsync on a majority), linearizable across processes and data centres, fencing tokens"
}
