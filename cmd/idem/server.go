package main

import (
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"

	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"net/url"
	"os"
	"path/filepath"
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
	"go.uber.org/zap/zapcore"
	"golang.org/x/net/netutil"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/embedded"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// server is a running idem serve: its etcd (embedded or a client of the
// given cluster), its store, and its two listeners. newServer starts every
// part; Run serves until its context ends, then shuts down in order; Close
// releases whatever is still held, and may be called more than once.
//
// When the etcd cluster cannot be reached at start, the server starts all
// the same and connects in the background: until it has a store, keyed
// requests get 503 (they cannot be claimed), requests idem only passes
// through still reach the upstream, and /readyz says 503. A cluster that
// answers but refuses idem (a TLS or authentication error) is a
// misconfiguration, which no waiting mends: the server refuses to start.
type server struct {
	cfg        *serveConfig
	txnSeconds prometheus.Histogram
	log        *slog.Logger

	etcd     *embed.Etcd // nil with --endpoints
	restored string      // the embedded etcd's restore marker, while its epoch is not raised yet

	mu    sync.Mutex
	clis  []*clientv3.Client // none until connected; one per shard with --shards-file
	store backend
	edge  atomic.Pointer[http.Handler] // the edge, once there is a store
	why   atomic.Pointer[string]       // why not connected yet

	reg      *prometheus.Registry
	metrics  *idemhttp.Metrics
	waiting  http.Handler // serves requests before the store exists
	connectC context.CancelFunc
	connectW sync.WaitGroup

	main, admin     *http.Server
	mainLn, adminLn net.Listener

	console *console // with --console

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
	if len(c.etcd.endpoints) == 0 && c.shardsFile == "" {
		if s.etcd, err = c.startEmbedded(ctx); err != nil {
			return nil, err
		}
		if sock, ok := unixSocket(c.embeddedClientURL); ok {
			// etcd made the data dir 0700; the socket is the owner's too.
			if err = os.Chmod(sock, 0o600); err != nil {
				return nil, fmt.Errorf("embedded etcd socket: %w", err)
			}
		}
		c.etcd.endpoints = listFlag{c.embeddedClientURL}
		log.Info("embedded etcd started", "data_dir", c.dataDir, "client_url", c.embeddedClientURL)
		if m := filepath.Join(c.dataDir, restoredMarker); fileExists(m) {
			s.restored = m
		}
	}

	s.registerMetrics(c.cacheSize > 0)
	if s.waiting, err = c.waitingEdge(s.metrics); err != nil {
		return nil, err
	}

	// The first try is bounded by --dial-timeout alone, so that an etcd
	// that cannot be reached delays the listeners by that much, not more.
	first := c.etcd.dialTimeout + c.sessionTTL
	if s.etcd == nil {
		first = c.etcd.dialTimeout
	}
	err = s.connect(ctx, first)
	switch {
	case err != nil && s.etcd == nil && retryable(err):
		log.Error("etcd cannot be reached; serving without it and connecting in the background: keyed requests get 503 until then",
			"etcd", strings.Join(c.etcd.endpoints, ","), "err", err)
		cctx, cancel := context.WithCancel(context.Background())
		s.connectC = cancel
		s.connectW.Add(1)
		go s.connectLater(cctx)
	case err != nil:
		return nil, err
	}

	var handler http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if edge := s.edge.Load(); edge != nil {
			(*edge).ServeHTTP(w, r)
			return
		}
		s.waiting.ServeHTTP(w, r)
	})
	if c.tenantHeader != "" {
		trusted, _ := c.trusted() // validated
		handler = idemhttp.GuardTenantHeader(c.tenantHeader, trusted, handler)
	}
	if c.tracer != nil {
		// A server span per request, a child of the caller's trace
		// context when it sends one (W3C traceparent).
		// The worker API's GET /v1/keys/{key} is not traced: its path is a
		// key, and spans record paths.
		handler = otelhttp.NewHandler(handler, "idem", otelhttp.WithTracerProvider(c.tracer),
			otelhttp.WithFilter(func(r *http.Request) bool { return !strings.HasPrefix(r.URL.Path, "/v1/keys/") }))
	}
	s.main = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.inflight.Add(1)
			defer s.inflight.Done()
			handler.ServeHTTP(w, r)
		}),
		TLSConfig:         c.mainTLS,
		ReadHeaderTimeout: c.readHeaderTimeout, // slowloris
		ReadTimeout:       c.readTimeout,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	if c.console {
		if s.console, err = newConsole(s); err != nil {
			return nil, err
		}
	}
	s.admin = &http.Server{
		Handler:           s.adminMux(),
		TLSConfig:         c.adminTLS,
		ReadHeaderTimeout: c.readHeaderTimeout,
		ReadTimeout:       c.readTimeout,
		IdleTimeout:       time.Minute, // browsers on the console keep connections: idle ones must not fill adminConnLimit
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	// Both listeners accept no more connections than they may hold: past
	// the limit, connections wait in the kernel's backlog, and accept never
	// runs out of file descriptors (which would also starve etcd's).
	if s.mainLn, err = net.Listen("tcp", c.listen); err != nil {
		return nil, fmt.Errorf("--listen: %w", err)
	}
	s.mainLn = netutil.LimitListener(s.mainLn, c.connLimit())
	if s.adminLn, err = net.Listen("tcp", c.adminListen); err != nil {
		return nil, fmt.Errorf("--admin-listen: %w", err)
	}
	s.adminLn = netutil.LimitListener(s.adminLn, adminConnLimit)
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
		"etcd", strings.Join(c.etcd.endpoints, ","), "connected", s.current() != nil, "max_connections", c.connLimit())
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
	hubsClosed := make(chan struct{})
	go func() { c.closeHubs(); close(hubsClosed) }() // its long polls end now
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
	<-hubsClosed
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
	if s.connectC != nil {
		s.connectC()
		s.connectW.Wait()
	}
	s.cfg.closeHubs()
	var err error
	if st := s.current(); st != nil {
		if err = st.Close(); err != nil {
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
	if s.console != nil {
		s.console.Close()
	}
	s.mu.Lock()
	clis := s.clis
	s.mu.Unlock()
	for _, cli := range clis {
		cli.Close()
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
func (c *serveConfig) edge(store backend, metrics *idemhttp.Metrics, log *slog.Logger) (http.Handler, error) {
	tenant := c.tenant()
	limiter, err := idemhttp.NewLimiter(c.limits)
	if err != nil {
		return nil, err
	}
	if c.upstream == "" {
		jc := &idemhttp.JobsConfig{Queue: func(t string) (*jobs.Queue, error) { return c.queue(store, t) },
			Hub: func(t string) (*jobs.Hub, error) { return c.hub(store, t) }}
		if c.tlsClientCAFile != "" || c.tokens != nil || c.tenantHeader != "" {
			jc.Tenant = tenant // the caller's tenant, as for keys
		}
		return idemhttp.NewAPI(idemhttp.APIConfig{
			Store: store, Tenant: tenant, Deadline: c.apiDeadline, MaxWait: c.maxWait, Metrics: metrics, ProblemDocs: c.problemDocs,
			MaxCheckpoint: c.maxCheckpoint, Limiter: limiter, Jobs: jc,
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
		Limiter:            limiter,
	}
	if len(c.requireKey) > 0 {
		cfg.RequireKey = pathPrefixes(c.requireKey)
	}
	rules, _ := c.statusRules() // validated
	cfg.OnStatus = idemhttp.Rules(nil, rules...)
	if len(c.release5xx) > 0 {
		release, next := pathPrefixes(c.release5xx), cfg.OnStatus
		cfg.OnStatus = func(r *http.Request, status int, h http.Header) etcdstore.End {
			if status >= 500 && release(r) {
				return etcdstore.EndRelease
			}
			return next(r, status, h)
		}
	}
	cfg.OnUnknownOutcome = ends[c.onUnknownOutcome]
	cfg.DenyHeaders, cfg.AllowHeaders = c.replayDeny, c.replayAllow
	if len(c.replayDeny) == 1 && c.replayDeny[0] == "none" {
		cfg.DenyHeaders = []string{}
	}
	cfg.ProblemDocs = c.problemDocs
	mw, err := idemhttp.New(cfg)
	if err != nil {
		return nil, err
	}
	up, _ := url.Parse(c.upstream)
	return idemhttp.NewProxy(up, mw, idemhttp.ProxyOptions{Timeout: c.upstreamTimeout, Logger: log, ProblemDocs: c.problemDocs, WrapTransport: c.wrapUpstream()})
}

// queue is tenant's job queue on store: each job on its key's shard on a
// shard set. The worker API and the console use it.
func (c *serveConfig) queue(store backend, tenant string) (*jobs.Queue, error) {
	opts := []jobs.Option{jobs.WithTenant(tenant)}
	if c.jobsLog != nil {
		opts = append(opts, jobs.WithLogger(c.jobsLog))
	}
	if c.zone != "" {
		opts = append(opts, jobs.WithZone(c.zone))
	}
	switch st := store.(type) {
	case *etcdstore.Store:
		return jobs.New(st, opts...)
	case *shard.Store:
		return jobs.NewOnShards(st, opts...)
	}
	return nil, fmt.Errorf("no job queue on a %T", store)
}

// hub is tenant's hub on store, which runs its declared kinds for the
// workers of /v1/work; made at its first use, closed with the server.
func (c *serveConfig) hub(store backend, tenant string) (*jobs.Hub, error) {
	c.hubsMu.Lock()
	defer c.hubsMu.Unlock()
	if c.hubsClosed {
		return nil, fmt.Errorf("%w: idem is shutting down", etcdstore.ErrUnavailable)
	}
	if h := c.hubs[tenant]; h != nil {
		return h, nil
	}
	q, err := c.queue(store, tenant)
	if err != nil {
		return nil, err
	}
	h, err := jobs.NewHub(q, jobs.HubDrainTimeout(c.shutdownGrace))
	if err != nil {
		return nil, err
	}
	if c.hubs == nil {
		c.hubs = map[string]*jobs.Hub{}
	}
	c.hubs[tenant] = h
	return h, nil
}

// runDeclaredSchedules runs the schedules of the declared kinds of every
// tenant on store (closed with the hubs).
func (c *serveConfig) runDeclaredSchedules(store *etcdstore.Store) {
	c.hubsMu.Lock()
	defer c.hubsMu.Unlock()
	if c.hubsClosed || c.schedules != nil {
		return
	}
	c.schedules = jobs.RunDeclaredSchedules(store, func(t string) (*jobs.Queue, error) { return c.queue(store, t) }, c.jobsLog)
}

// closeHubs stops every hub and the declared schedules: waiting workers
// are answered at once, and running steps get the shutdown grace to end.
func (c *serveConfig) closeHubs() {
	c.hubsMu.Lock()
	c.hubsClosed = true
	hubs := c.hubs
	c.hubs = nil
	sched := c.schedules
	c.schedules = nil
	c.hubsMu.Unlock()
	if sched != nil {
		sched.Close()
	}
	var wg sync.WaitGroup
	for _, h := range hubs {
		wg.Go(func() { h.Close() })
	}
	wg.Wait()
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

// readyTimeout bounds the whole of /readyz's answer: every shard is asked
// at once, each within it. The readiness probes in deploy/ wait longer
// (timeoutSeconds), so that a shard that hangs makes the pod degraded, not
// unready.
const readyTimeout = 2 * time.Second

// adminMux serves /livez, /readyz, /metrics and, opted in, /debug/pprof.
func (s *server) adminMux() http.Handler {
	c := s.cfg
	mux := http.NewServeMux()
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok") // the process runs; no dependencies
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		store := s.current()
		switch {
		case s.draining.Load():
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		case store == nil:
			why := "connecting"
			if p := s.why.Load(); p != nil {
				why = *p
			}
			http.Error(w, "etcd not reached yet: "+why, http.StatusServiceUnavailable)
			return
		case c.shardsFile == "" && !store.Metrics().Live:
			http.Error(w, "no live etcd session", http.StatusServiceUnavailable)
			return
		}
		// The whole answer takes at most readyTimeout (the probes'
		// timeoutSeconds in deploy/ are above it): the space check and the
		// reads run at once.
		ctx, cancel := context.WithTimeout(r.Context(), readyTimeout)
		defer cancel()
		fullc := make(chan bool, 1)
		go func() {
			full, _ := store.CheckFull(ctx)
			fullc <- full
		}()
		// A linearizable read: answers only with a quorum behind it. With
		// shards, every shard is asked at once, each within its own
		// deadline, and the process is ready while one answers: the
		// others' keys get 503, the answering ones' are served.
		var down []string
		n := 1
		if set, ok := store.(*shard.Store); ok {
			checks := set.Check(ctx, readyTimeout)
			n = len(checks)
			for _, name := range set.Shards() {
				if err := checks[name]; err != nil {
					down = append(down, "shard "+name+" unreachable: "+err.Error())
				}
			}
		} else {
			s.mu.Lock()
			clis := s.clis
			s.mu.Unlock()
			if _, err := clis[0].Get(ctx, c.etcd.prefix+"readyz", clientv3.WithCountOnly()); err != nil {
				down = append(down, "etcd unreachable: "+err.Error())
			}
		}
		if <-fullc && !c.readyWhenFull {
			http.Error(w, "etcd is out of space (NOSPACE alarm): new keys are refused, replays still work; see docs/OPERATIONS.md", http.StatusServiceUnavailable)
			return
		}
		if len(down) == n {
			http.Error(w, strings.Join(down, "; "), http.StatusServiceUnavailable)
			return
		}
		if len(down) > 0 {
			fmt.Fprintln(w, "degraded: "+strings.Join(down, "; "))
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg}))
	mux.HandleFunc("GET /{$}", s.adminIndex)
	if s.console != nil {
		mux.Handle("/console", http.RedirectHandler("/console/", http.StatusMovedPermanently))
		mux.Handle("/console/", s.console)
	}
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
	// The data dir is the owner's alone (etcd wants it so), and holds the
	// client socket: made before etcd listens on it.
	if err := os.MkdirAll(c.dataDir, 0o700); err != nil {
		return nil, fmt.Errorf("--data-dir: %w", err)
	}
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
		Logger:              etcdLogger(),
	})
	if err != nil {
		return nil, fmt.Errorf("embedded etcd in %s: %w", c.dataDir, err)
	}
	return e, nil
}

// etcdLogger is the embedded etcd's logger: its errors (and above all a
// fatal error, after which etcd exits the process) on stderr as JSON, so
// that idem never stops without saying why; nothing below error.
func etcdLogger() *zap.Logger {
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.RFC3339NanoTimeEncoder
	core := zapcore.NewCore(zapcore.NewJSONEncoder(enc), zapcore.Lock(os.Stderr), zap.ErrorLevel)
	return zap.New(quietClose{core}, zap.AddStacktrace(zap.FatalLevel)).With(zap.String("component", "embedded-etcd"))
}

// quietClose drops what etcd logs as errors when it is closed on purpose:
// its listeners' "server closed" and "use of closed network connection".
type quietClose struct{ zapcore.Core }

func (q quietClose) With(fields []zapcore.Field) zapcore.Core { return quietClose{q.Core.With(fields)} }

func (q quietClose) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if q.Enabled(e.Level) {
		return ce.AddCore(e, q)
	}
	return ce
}

func (q quietClose) Write(e zapcore.Entry, fields []zapcore.Field) error {
	if e.Level < zapcore.DPanicLevel {
		for _, f := range fields {
			if err, ok := f.Interface.(error); ok && f.Type == zapcore.ErrorType && closedOnPurpose(err.Error()) {
				return nil
			}
		}
	}
	return q.Core.Write(e, fields)
}

func closedOnPurpose(msg string) bool {
	for _, s := range []string{"server closed", "Server closed", "use of closed network connection"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// unixSocket returns the path of a unix:// URL's socket, as etcd reads it
// (host and path together: unix://dir/etcd.sock is relative).
func unixSocket(rawURL string) (string, bool) {
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme != "unix" {
		return "", false
	}
	return u.Host + u.Path, true
}

// socketURL is the default client URL of the embedded etcd: a unix socket
// in its data directory.
func socketURL(dataDir string) string {
	return "unix://" + filepath.ToSlash(filepath.Join(dataDir, "etcd.sock"))
}

// wrapUpstream gives the proxy's upstream calls client spans and the trace
// context (traceparent) of the request they serve, when tracing. Without
// tracing, a client's traceparent passes through to the upstream as any
// other header does.
func (c *serveConfig) wrapUpstream() func(http.RoundTripper) http.RoundTripper {
	if c.tracer == nil {
		return nil
	}
	return func(rt http.RoundTripper) http.RoundTripper {
		return otelhttp.NewTransport(rt, otelhttp.WithTracerProvider(c.tracer))
	}
}

// registerMetrics makes the process's Prometheus registry: every metric
// docs/CLI.md lists (TestMetricsTableMatchesTheRegistry), the cache's when
// the cache is on.
func (s *server) registerMetrics(cache bool) {
	s.reg = prometheus.NewRegistry()
	s.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	gauge := func(name, help string, f func(backend) float64) {
		s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
			if st := s.current(); st != nil {
				return f(st)
			}
			return 0
		}))
	}
	metric := func(f func(etcdstore.Metrics) float64) func(backend) float64 {
		return func(st backend) float64 { return f(st.Metrics()) }
	}
	bit := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	counter := func(name, help string, f func(etcdstore.Metrics) int64) {
		s.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 {
			if st := s.current(); st != nil {
				return float64(f(st.Metrics()))
			}
			return 0
		}))
	}
	gauge("idem_claims_running", "Claims this process holds and has not ended.", metric(func(m etcdstore.Metrics) float64 { return float64(m.Running) }))
	gauge("idem_session_live", "1 while this process has a live etcd session.", metric(func(m etcdstore.Metrics) float64 { return bit(m.Live) }))
	gauge("idem_store_full", "1 while etcd refuses this process's writes for lack of space (the NOSPACE alarm).", metric(func(m etcdstore.Metrics) float64 { return bit(m.Full) }))
	gauge("idem_final_writes_pending", "Final writes (outcomes of finished work) etcd has not acknowledged yet; retried in the background.",
		metric(func(m etcdstore.Metrics) float64 { return float64(m.Pending) }))
	if cache {
		counter("idem_cache_hits_total", "Replays answered from the done-record cache.", func(m etcdstore.Metrics) int64 { return m.Cache.Hits })
		counter("idem_cache_stale_total", "Lookups the cache did not answer because it could not prove itself current within --cache-staleness.",
			func(m etcdstore.Metrics) int64 { return m.Cache.Stale })
		gauge("idem_cache_lag_seconds", "How long ago the cache last proved itself current (an etcd progress notification); past --cache-staleness it answers nothing.",
			metric(func(m etcdstore.Metrics) float64 { return m.Cache.Lag.Seconds() }))
	}
	counter("idem_etcd_batches_total", "etcd Txns that carried the store's writes (group commit): idem_etcd_batched_writes_total over this is the mean batch size.",
		func(m etcdstore.Metrics) int64 { return m.Batch.Batches })
	counter("idem_etcd_batched_writes_total", "The store's writes sent in those Txns.", func(m etcdstore.Metrics) int64 { return m.Batch.Members })
	counter("idem_etcd_batches_beside_total", "Batches sent while others of this process flew: once a full batch waited, or once the hold had passed.",
		func(m etcdstore.Metrics) int64 { return m.Batch.Beside })
	gauge("idem_etcd_batch_round_trip_seconds", "Smoothed round trip of the store's batches, as group commit measures it.",
		metric(func(m etcdstore.Metrics) float64 { return m.Batch.RoundTrip.Seconds() }))
	gauge("idem_etcd_batch_hold_seconds", "How long a write that finds a batch in flight waits for company before a further batch may go (group commit derives it from the round trips it measures).",
		metric(func(m etcdstore.Metrics) float64 { return m.Batch.Hold.Seconds() }))
	counter("idem_etcd_batches_split_total", "Batches etcd refused as a whole, whose writes went again one by one.", func(m etcdstore.Metrics) int64 { return m.Batch.Split })
	counter("idem_expired_records_swept_total", "Expired records this process deleted (the expiry sweeper), a few per etcd Txn.", func(m etcdstore.Metrics) int64 { return m.Sweep.Records })
	counter("idem_expired_leases_swept_total", "Retention leases this process emptied and revoked.", func(m etcdstore.Metrics) int64 { return m.Sweep.Leases })
	counter("idem_claims_reaped_total", "Claims whose claim write had an unknown outcome, fenced or abandoned in the background so that no key stays held by nobody.",
		func(m etcdstore.Metrics) int64 { return m.Reaped })
	s.reg.MustRegister(etcdCollector{s})
	s.txnSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "idem_etcd_txn_duration_seconds",
		Help:    "The store's conditional write transactions to etcd (claims, completes, checkpoints; batched or not), as the store timed them: etcd's latency without the work or any wait.",
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	})
	s.reg.MustRegister(s.txnSeconds)
	s.metrics = idemhttp.NewMetrics(s.reg)
}

// etcdCollector reports, at each scrape, what every etcd endpoint says of
// itself: whether it answers, and its database size against its quota (the
// alerts in deploy/ use them: etcd unavailable, quota near full).
type etcdCollector struct{ s *server }

var (
	descEtcdUp = prometheus.NewDesc("idem_etcd_up",
		"1 when the etcd endpoint answered a status request at this scrape (1 s timeout), else 0.", []string{"endpoint"}, nil)
	descEtcdDB = prometheus.NewDesc("idem_etcd_db_size_bytes",
		"Size of the endpoint's backend database file.", []string{"endpoint"}, nil)
	descEtcdInUse = prometheus.NewDesc("idem_etcd_db_size_in_use_bytes",
		"Bytes of the endpoint's backend database in use (the rest is free after compaction, until a defrag).", []string{"endpoint"}, nil)
	descEtcdQuota = prometheus.NewDesc("idem_etcd_db_quota_bytes",
		"The endpoint's backend quota (--quota-backend-bytes) as etcd reports it (etcd 3.6 and later; 0 from older ones).", []string{"endpoint"}, nil)
)

func (etcdCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descEtcdUp
	ch <- descEtcdDB
	ch <- descEtcdInUse
	ch <- descEtcdQuota
}

func (e etcdCollector) Collect(ch chan<- prometheus.Metric) {
	e.s.mu.Lock()
	clis := append([]*clientv3.Client(nil), e.s.clis...)
	e.s.mu.Unlock()
	if len(clis) == 0 {
		// Not connected yet: every configured endpoint is down as far as
		// this process knows, and says so (an alert needs the series).
		for _, ep := range e.s.cfg.etcd.endpoints {
			ch <- prometheus.MustNewConstMetric(descEtcdUp, prometheus.GaugeValue, 0, ep)
		}
		return
	}
	// Every endpoint at once, all within one second: a scrape must not
	// take a second per dead endpoint.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var wg sync.WaitGroup // ch takes concurrent sends
	for _, cli := range clis {
		for _, ep := range cli.Endpoints() {
			wg.Go(func() {
				st, err := cli.Status(ctx, ep)
				if err != nil {
					ch <- prometheus.MustNewConstMetric(descEtcdUp, prometheus.GaugeValue, 0, ep)
					return
				}
				ch <- prometheus.MustNewConstMetric(descEtcdUp, prometheus.GaugeValue, 1, ep)
				ch <- prometheus.MustNewConstMetric(descEtcdDB, prometheus.GaugeValue, float64(st.DbSize), ep)
				ch <- prometheus.MustNewConstMetric(descEtcdInUse, prometheus.GaugeValue, float64(st.DbSizeInUse), ep)
				ch <- prometheus.MustNewConstMetric(descEtcdQuota, prometheus.GaugeValue, float64(st.DbSizeQuota), ep)
			})
		}
	}
	wg.Wait()
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
