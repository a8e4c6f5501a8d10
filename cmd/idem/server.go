package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/embedded"
)

// server is a running idem serve: its etcd (embedded or a client of the
// given cluster), its store, and its two listeners. newServer starts every
// part; Run serves until its context ends, then shuts down in order; Close
// releases whatever is still held, and may be called more than once.
type server struct {
	cfg *serveConfig
	log *slog.Logger

	etcd  *embed.Etcd // nil with --endpoints
	cli   *clientv3.Client
	store *etcdstore.Store

	main, admin     *http.Server
	mainLn, adminLn net.Listener

	draining atomic.Bool
	inflight sync.WaitGroup
	closed   bool
}

// newServer starts etcd (embedded unless --endpoints), the store, and the
// listeners. On error nothing is left running.
func newServer(ctx context.Context, c *serveConfig, log *slog.Logger) (_ *server, err error) {
	s := &server{cfg: c, log: log}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if len(c.etcd.endpoints) == 0 {
		if s.etcd, err = c.startEmbedded(ctx); err != nil {
			return nil, err
		}
		c.etcd.endpoints = listFlag{c.embeddedClientURL}
		log.Info("embedded etcd started", "data_dir", c.dataDir, "client_url", c.embeddedClientURL)
	}
	if s.cli, err = c.etcd.client(); err != nil {
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	sctx, cancel := context.WithTimeout(ctx, c.etcd.dialTimeout+c.sessionTTL)
	s.store, err = etcdstore.New(sctx, s.cli,
		etcdstore.WithPrefix(c.etcd.prefix),
		etcdstore.WithRetention(c.retention),
		etcdstore.WithBucketWidth(min(c.bucketWidth, c.retention)),
		etcdstore.WithSessionTTL(c.sessionTTL),
		etcdstore.WithRequestTimeout(c.requestTimeout),
		etcdstore.WithCache(c.cacheSize),
		etcdstore.WithKeysPerLease(c.keysPerLease),
		etcdstore.WithRecordFormat(c.recordFormat),
		etcdstore.WithLogger(log),
	)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("idem store on %s: %w", strings.Join(c.etcd.endpoints, ","), c.etcd.explain(err))
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "idem_claims_running", Help: "Claims this process holds and has not ended.",
	}, func() float64 { return float64(s.store.Running()) }))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "idem_session_live", Help: "1 while this process has a live etcd session.",
	}, func() float64 {
		if s.store.Live() {
			return 1
		}
		return 0
	}))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "idem_final_writes_pending", Help: "Final writes (outcomes of finished work) etcd has not acknowledged yet; retried in the background.",
	}, func() float64 { return float64(s.store.Pending()) }))
	edge, err := c.edge(s.store, idemhttp.NewMetrics(reg), log)
	if err != nil {
		return nil, err
	}
	s.main = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.inflight.Add(1)
			defer s.inflight.Done()
			edge.ServeHTTP(w, r)
		}),
		TLSConfig:         c.mainTLS,
		ReadHeaderTimeout: c.readHeaderTimeout, // slowloris
		ReadTimeout:       c.readTimeout,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	s.admin = &http.Server{
		Handler:           c.adminMux(s.cli, s.store, reg, &s.draining),
		TLSConfig:         c.adminTLS,
		ReadHeaderTimeout: c.readHeaderTimeout,
		ReadTimeout:       c.readTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	if s.mainLn, err = net.Listen("tcp", c.listen); err != nil {
		return nil, fmt.Errorf("--listen: %w", err)
	}
	if s.adminLn, err = net.Listen("tcp", c.adminListen); err != nil {
		return nil, fmt.Errorf("--admin-listen: %w", err)
	}
	return s, nil
}

// Run serves until ctx ends (or a listener or the embedded etcd fails),
// then shuts down: it stops taking requests, lets in-flight ones finish
// within --shutdown-grace (their claims are completed, released or
// abandoned by the middleware), closes the store (which waits for pending
// final writes, then revokes the session so that other processes may take
// over anything left at once), and stops the embedded etcd.
func (s *server) Run(ctx context.Context) error {
	c := s.cfg
	mode := "api"
	if c.upstream != "" {
		mode = "proxy"
	}
	s.log.Info("idem listening", "listen", s.mainLn.Addr().String(), "admin", s.adminLn.Addr().String(),
		"mode", mode, "tls", c.mainTLS != nil, "admin_tls", c.adminTLS != nil, "upstream", c.upstream,
		"etcd", strings.Join(c.etcd.endpoints, ","), "owner", s.store.Owner())
	errc := make(chan error, 2)
	go func() { errc <- serveOn(s.main, s.mainLn) }()
	go func() { errc <- serveOn(s.admin, s.adminLn) }()
	var etcdErr <-chan error
	if s.etcd != nil {
		etcdErr = s.etcd.Err()
	}
	select {
	case <-ctx.Done():
		s.log.Info("shutting down", "grace", c.shutdownGrace.String())
	case err := <-errc:
		return fmt.Errorf("http server: %w", err)
	case err := <-etcdErr:
		return fmt.Errorf("embedded etcd: %w", err)
	}
	s.draining.Store(true)
	grace, cancel := context.WithTimeout(context.Background(), c.shutdownGrace)
	defer cancel()
	if err := s.main.Shutdown(grace); err != nil {
		s.log.Warn("grace period over; closing remaining connections", "err", err)
		s.main.Close() // cancels the remaining requests' contexts
	}
	done := make(chan struct{})
	go func() { s.inflight.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(etcdstore.DefaultEndTimeout):
		s.log.Warn("requests still running after the grace period; their claims will be taken over")
	}
	return s.Close()
}

// Close releases what the server holds, in order: the listeners, the
// store (its pending final writes, then its session), the etcd client,
// the embedded etcd.
func (s *server) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	if s.main != nil {
		s.main.Close()
	} else if s.mainLn != nil {
		s.mainLn.Close()
	}
	var err error
	if s.store != nil {
		if err = s.store.Close(); err != nil {
			s.log.Warn("closing the session", "err", err)
		}
	}
	if s.admin != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		s.admin.Shutdown(ctx)
		cancel()
	} else if s.adminLn != nil {
		s.adminLn.Close()
	}
	if s.cli != nil {
		s.cli.Close()
	}
	if s.etcd != nil {
		s.etcd.Close()
		s.log.Info("embedded etcd stopped")
	}
	s.log.Info("idem stopped")
	return nil
}

// serveOn serves srv on ln, over TLS when srv has a TLS configuration.
func serveOn(srv *http.Server, ln net.Listener) error {
	if srv.TLSConfig != nil {
		return srv.ServeTLS(ln, "", "")
	}
	return srv.Serve(ln)
}

// edge builds the idempotency edge: the proxy or the JSON API.
func (c *serveConfig) edge(store *etcdstore.Store, metrics *idemhttp.Metrics, log *slog.Logger) (http.Handler, error) {
	tenant := c.tenant()
	if c.upstream == "" {
		return idemhttp.NewAPI(idemhttp.APIConfig{
			Store: store, Tenant: tenant, Deadline: c.apiDeadline, MaxWait: c.maxWait, Metrics: metrics,
		})
	}
	cfg := idemhttp.Config{
		Store:              store,
		Methods:            c.methods,
		Tenant:             tenant,
		FingerprintHeaders: c.fingerprintHeaders,
		MaxRequestBody:     c.maxRequestBody,
		MaxResponseBody:    c.maxResponseBody,
		MaxWait:            c.maxWait,
		ClaimDeadline:      c.claimDeadline,
		Logger:             log,
		LogKeys:            c.logKeys,
		Metrics:            metrics,
	}
	if len(c.requireKey) > 0 {
		cfg.RequireKey = pathPrefixes(c.requireKey)
	}
	if len(c.release5xx) > 0 {
		release := pathPrefixes(c.release5xx)
		cfg.Save5xx = func(r *http.Request) bool { return !release(r) }
	}
	cfg.OnUnknownOutcome = ends[c.onUnknownOutcome]
	mw, err := idemhttp.New(cfg)
	if err != nil {
		return nil, err
	}
	up, _ := url.Parse(c.upstream)
	return idemhttp.NewProxy(up, mw, idemhttp.ProxyOptions{Timeout: c.upstreamTimeout, Logger: log})
}

// ends names the ways a claim ends, as flags spell them.
var ends = map[string]etcdstore.End{"save": etcdstore.EndSave, "release": etcdstore.EndRelease, "abandon": etcdstore.EndAbandon}

func pathPrefixes(prefixes []string) func(*http.Request) bool {
	return func(r *http.Request) bool {
		for _, p := range prefixes {
			if strings.HasPrefix(r.URL.Path, p) {
				return true
			}
		}
		return false
	}
}

// adminMux serves /livez, /readyz, /metrics and, opted in, /debug/pprof.
func (c *serveConfig) adminMux(cli *clientv3.Client, store *etcdstore.Store, reg *prometheus.Registry, draining *atomic.Bool) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok") // the process runs; no dependencies
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		switch {
		case draining.Load():
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		case !store.Live():
			http.Error(w, "no live etcd session", http.StatusServiceUnavailable)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		// A linearizable read: answers only with a quorum behind it.
		if _, err := cli.Get(ctx, c.etcd.prefix+"readyz", clientv3.WithCountOnly()); err != nil {
			http.Error(w, "etcd unreachable: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	if c.pprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// startEmbedded starts the single-node etcd of the default mode.
func (c *serveConfig) startEmbedded(ctx context.Context) (*embed.Etcd, error) {
	sctx, cancel := context.WithTimeout(ctx, embedded.ReadyTimeout)
	defer cancel()
	e, err := embedded.Start(sctx, embedded.Config{
		Name:                "idem",
		Dir:                 c.dataDir,
		ClientURL:           c.embeddedClientURL,
		PeerURL:             c.embeddedPeerURL,
		QuotaBytes:          c.quotaBytes,
		CompactionRetention: c.compaction,
		NoFsync:             c.unsafeNoFsync,
		Logger:              zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("embedded etcd in %s: %w", c.dataDir, err)
	}
	return e, nil
}
