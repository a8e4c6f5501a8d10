package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/shard"
)

// How idem serve reaches etcd: at start, and in the background when etcd
// cannot be reached then.

// current returns the store, or nil before it exists.
func (s *server) current() backend {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.store
}

// storeOptions are the store's options the flags say (serveConfig.validate
// checks them before anything talks to etcd).
func (c *serveConfig) storeOptions(log *slog.Logger) []etcdstore.Option {
	opts := []etcdstore.Option{
		etcdstore.WithPrefix(c.etcd.prefix),
		etcdstore.WithRetention(c.retention),
		etcdstore.WithBucketWidth(min(c.bucketWidth, c.retention)),
		etcdstore.WithSessionTTL(c.sessionTTL),
		etcdstore.WithRequestTimeout(c.requestTimeout),
		etcdstore.WithCache(c.cacheSize),
		etcdstore.WithCacheStaleness(c.cacheStaleness),
		etcdstore.WithKeysPerLease(c.keysPerLease),
		etcdstore.WithRecordFormat(c.recordFormat),
		etcdstore.WithBatching(c.batching),
		etcdstore.WithExpirySweep(c.expirySweep),
		etcdstore.WithBatchLimits(c.batchMembers, c.batchBytes),
		etcdstore.WithLogger(log),
	}
	if c.tracer != nil {
		opts = append(opts, etcdstore.WithTracerProvider(c.tracer))
	}
	return opts
}

// connect makes the etcd clients (one, or one per shard) and the store,
// within timeout, and puts the edge in place. A failed try closes its
// clients: the next one starts afresh, without gRPC's reconnect backoff of
// a connection that hung.
func (s *server) connect(ctx context.Context, timeout time.Duration) error {
	c := s.cfg
	opts := c.storeOptions(s.log)
	opts = append(opts, storex.WithTxnObserver(func(d time.Duration) { s.txnSeconds.Observe(d.Seconds()) }))
	where := strings.Join(c.etcd.endpoints, ",")
	var clis []*clientv3.Client
	closeAll := func() {
		for _, cli := range clis {
			cli.Close()
		}
	}
	sctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var store backend
	if c.shardsFile != "" {
		flags, _, cfg, err := readShards(c.shardsFile, c.etcd)
		if err != nil {
			return err
		}
		where = "shards " + strings.Join(c.shardNames, ",")
		for i := range flags {
			flags[i].dialOptions = c.etcd.dialOptions // tracing
		}
		// Every shard that answers now is used at once; the others are
		// connected to in the background, and only their keys get 503.
		shardConnects(flags, &cfg)
		cfg.Log = s.log
		st, err := shard.New(sctx, cfg, opts...)
		if err != nil {
			return s.notYet(fmt.Errorf("idem store on %s: %w", where, err))
		}
		store = st
	} else {
		cli, err := c.etcd.client()
		if err != nil {
			return s.notYet(fmt.Errorf("etcd client on %s: %w", where, c.etcd.explain(err)))
		}
		clis = []*clientv3.Client{cli}
		if s.restored != "" {
			if err := s.raiseRestoredEpoch(sctx, cli); err != nil {
				closeAll()
				return s.notYet(err)
			}
		}
		st, err := etcdstore.New(sctx, cli, opts...)
		if err != nil {
			closeAll()
			return s.notYet(fmt.Errorf("idem store on %s: %w", where, c.etcd.explain(err)))
		}
		store = st
	}
	edge, err := c.edge(store, s.metrics, s.log)
	if err != nil {
		store.Close()
		closeAll()
		return err
	}
	if st, ok := store.(*etcdstore.Store); ok && c.upstream == "" {
		c.runDeclaredSchedules(st) // the worker API's declared kinds' schedules
	}
	s.mu.Lock()
	s.clis, s.store = clis, store
	s.mu.Unlock()
	s.edge.Store(&edge)
	s.why.Store(nil)
	return nil
}

// notYet records why the server has no store yet, for /readyz.
func (s *server) notYet(err error) error {
	why := err.Error()
	s.why.Store(&why)
	return err
}

// retryable reports whether a failure to connect may mend with time:
// nothing answered, or etcd answered without a leader. A refused TLS
// handshake or authentication is a misconfiguration.
func retryable(err error) bool {
	if errors.Is(err, etcdstore.ErrInvalidArgument) {
		return false // a configuration the store or the edge refuses: no retry mends it
	}
	msg := err.Error()
	for _, fatal := range []string{"tls: ", "x509: ", "certificate", "speaks TLS", "authentication failed", "invalid auth token", "permission denied", "user name"} {
		if strings.Contains(msg, fatal) {
			return false
		}
	}
	return true
}

// connectLater retries connect until it succeeds, fails for good, or the
// server shuts down.
func (s *server) connectLater(ctx context.Context) {
	defer s.connectW.Done()
	for wait := time.Second; ; wait = min(2*wait, maxConnectWait) {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		err := s.connect(ctx, s.cfg.etcd.dialTimeout)
		switch {
		case err == nil:
			s.log.Info("etcd reached; serving keyed requests", "etcd", strings.Join(s.cfg.etcd.endpoints, ","), "owner", s.current().Owner())
			return
		case ctx.Err() != nil:
			return
		case !retryable(err):
			s.log.Error("etcd refuses idem; keyed requests get 503 until the configuration is mended and idem restarted", "err", err)
			return
		}
		s.log.Warn("etcd still cannot be reached", "err", err, "retry_in", min(2*wait, maxConnectWait).String())
	}
}

// maxConnectWait bounds the pause between two tries to reach etcd.
const maxConnectWait = 8 * time.Second

// waitingEdge serves requests while there is no store: a request that
// would be claimed gets 503 (it cannot be claimed, and must not reach the
// upstream unclaimed), and in proxy mode every other request passes
// through, without a client-sent fence header, as it would with a store.
func (c *serveConfig) waitingEdge(metrics *idemhttp.Metrics) (http.Handler, error) {
	unavailable := func(w http.ResponseWriter) {
		// Counted as the edge counts its 503s: an outage before etcd is
		// reached is when the person on call looks at them.
		metrics.Requests.WithLabelValues("unavailable").Inc()
		p := idemhttp.NewProblem(http.StatusServiceUnavailable, idemhttp.KindUnavailable,
			"idem cannot reach etcd yet: retry with the same key")
		p.RetryAfter = 1
		p.Docs = c.problemDocs
		if p.Docs == "none" {
			p.Docs = ""
		}
		p.Write(w)
	}
	if c.upstream == "" {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { unavailable(w) }), nil
	}
	up, _ := url.Parse(c.upstream)
	rp, err := idemhttp.ReverseProxy(up, idemhttp.ProxyOptions{Timeout: c.upstreamTimeout, ProblemDocs: c.problemDocs, WrapTransport: c.wrapUpstream()})
	if err != nil {
		return nil, err
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if slices.Contains(c.methods, r.Method) && len(r.Header.Values(idemhttp.HeaderKey)) > 0 {
			unavailable(w)
			return
		}
		r.Header.Del(fencing.Header)
		metrics.Requests.WithLabelValues("passthrough").Inc()
		rp.ServeHTTP(w, r)
	}), nil
}

// raiseRestoredEpoch raises the shard epoch of an embedded etcd restored
// from a snapshot (idem snapshot restore left its marker), before the
// store hands out a token: the epoch is a key of the snapshot, and tokens
// (epoch<<44 | revision) would otherwise go back below those of keys that
// moved in from other shards after the snapshot. The marker goes once the
// epoch is raised; a failure leaves it for the next try.
func (s *server) raiseRestoredEpoch(ctx context.Context, cli *clientv3.Client) error {
	adm, err := etcdstore.NewAdmin(cli, etcdstore.WithPrefix(s.cfg.etcd.prefix))
	if err != nil {
		return err
	}
	epoch, err := storex.BumpEpoch(adm, ctx, storex.DefaultRestoreEpochBump)
	if err != nil {
		return fmt.Errorf("raise the shard epoch after a restore: %w", err)
	}
	if err := os.Remove(s.restored); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("restore marker: %w", err)
	}
	s.log.Info("raised the shard epoch after a restore", "by", storex.DefaultRestoreEpochBump, "epoch", epoch)
	s.restored = ""
	return nil
}
