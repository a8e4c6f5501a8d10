package main

import (
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/tlsfiles"
	"github.com/idem-dev/idem/jobs"
)

const serveUsage = `usage: idem serve [flags]

Runs the idempotency service. Without --endpoints it starts an embedded
single-node etcd in --data-dir and uses it; with --endpoints it uses that
etcd cluster and starts none.

With --upstream it is a reverse proxy (a sidecar): POST and PATCH requests
with an Idempotency-Key are claimed, forwarded once, and their response
saved and replayed to every retry. Without --upstream it serves the JSON
worker API under /v1/ (api/openapi.yaml).

Every flag can also be set with an environment variable: IDEM_ and the
flag's name in capitals, dashes as underscores (IDEM_UPSTREAM).

Flags:
`

// serveConfig is everything idem serve is told.
type serveConfig struct {
	jobsLog *slog.Logger // the process's logger, for the job queues it makes

	hubsMu     sync.Mutex
	hubs       map[string]*jobs.Hub // by tenant: the declared kinds' hubs (/v1/work)
	hubsClosed bool
	schedules  *jobs.DeclaredSchedulers // the declared kinds' schedules (worker API)

	// tracer is set when the OpenTelemetry environment asks for traces.
	tracer trace.TracerProvider

	etcd etcdFlags

	listen, adminListen string
	maxConnections      int
	upstream            string
	upstreamTimeout     time.Duration
	methods             listFlag
	requireKey          listFlag
	release5xx          listFlag
	onStatus            listFlag
	replayDeny          listFlag
	replayAllow         listFlag
	problemDocs         string
	onUnknownOutcome    string
	fingerprintHeaders  listFlag
	maxRequestBody      int64
	maxResponseBody     int
	maxWait             time.Duration
	claimDeadline       time.Duration
	apiDeadline         time.Duration
	zone                string
	maxCheckpoint       int
	limits              idemhttp.Limits
	tenantHeader        string
	trustedProxies      listFlag
	fixedTenant         string

	tlsCertFile, tlsKeyFile, tlsClientCAFile                string
	adminTLSCertFile, adminTLSKeyFile, adminTLSClientCAFile string
	tokensFile                                              string
	readHeaderTimeout, readTimeout                          time.Duration
	// Loaded by load: the listeners' TLS (nil: plain HTTP) and the tokens.
	mainTLS, adminTLS *tls.Config
	tokens            *idemhttp.Tokens

	retention      time.Duration
	bucketWidth    time.Duration
	sessionTTL     time.Duration
	requestTimeout time.Duration
	cacheSize      int64
	cacheStaleness time.Duration
	readyWhenFull  bool
	keysPerLease   int64
	recordFormat   int
	batching       bool
	expirySweep    bool
	batchMembers   int
	batchBytes     int
	shardsFile     string
	shardNames     []string // from --shards-file, in its order

	dataDir           string
	embeddedClientURL string
	embeddedPeerURL   string
	quotaBytes        int64
	compaction        string
	unsafeNoFsync     bool

	logFormat, logLevel string
	logKeys             bool
	pprof               bool
	console             bool
	consoleHosts        listFlag
	shutdownGrace       time.Duration
}

func (c *serveConfig) flags(stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, serveUsage)
		fs.PrintDefaults()
	}
	c.etcd.register(fs, nil)
	fs.StringVar(&c.listen, "listen", "127.0.0.1:8080", "address of the idempotency edge (proxy or JSON API)")
	fs.StringVar(&c.adminListen, "admin-listen", "127.0.0.1:8081", "address of /livez, /readyz, /metrics (and /debug/pprof with --pprof, /console/ with --console)")
	fs.IntVar(&c.maxConnections, "max-connections", 0, "connections the edge serves at once; more wait in the kernel's backlog instead of exhausting file descriptors (0: from the open-file limit, half of what is left after 128 for etcd and idem; the admin listener has 32 of its own)")
	fs.StringVar(&c.upstream, "upstream", "", "upstream URL: run as a reverse proxy (sidecar) in front of it")
	fs.DurationVar(&c.upstreamTimeout, "upstream-timeout", 30*time.Second, "how long to wait for the upstream's response headers")
	c.methods = listFlag{"POST", "PATCH"}
	fs.Var(list(&c.methods), "methods", "methods whose keyed requests are claimed, comma-separated")
	fs.Var(list(&c.requireKey), "require-key", "path prefixes whose claimed methods must carry an Idempotency-Key (400 otherwise); repeatable")
	fs.Var(list(&c.release5xx), "release-5xx", "path prefixes where a 5xx response releases the key (retry runs again) instead of being saved; repeatable")
	fs.Var(list(&c.onStatus), "on-status", "how an upstream status ends its key: STATUS[:retry-after]=save|release|abandon, STATUS a code (429) or class (5xx); first match wins, then the defaults (429=release, 503:retry-after=release, everything else saved); repeatable")
	c.replayDeny = listFlag{"Set-Cookie"}
	fs.Var(list(&c.replayDeny), "replay-deny-headers", "response headers never saved or replayed, comma-separated (\"none\": deny none)")
	fs.Var(list(&c.replayAllow), "replay-allow-headers", "when set, the only response headers saved and replayed, comma-separated")
	fs.StringVar(&c.problemDocs, "problem-docs-url", idemhttp.DefaultProblemDocs, "where idem's problem answers point (Link: <URL>; rel=\"describedby\"); \"none\": no Link")
	fs.StringVar(&c.onUnknownOutcome, "on-unknown-outcome", "save", "when the upstream may have acted but no whole answer came back (timeout, broken connection, cut-off body): save (a 502/504 problem, replayed to every retry), release or abandon (the retry reaches the upstream again: only for upstreams that dedupe by key or check the fencing token); a request that never reached the upstream is always released")
	fs.Var(list(&c.fingerprintHeaders), "fingerprint-headers", "request headers that are part of the fingerprint, comma-separated")
	fs.Int64Var(&c.maxRequestBody, "max-request-body", idemhttp.DefaultMaxRequestBody, "largest request body with a key, bytes (413 past it)")
	fs.IntVar(&c.maxResponseBody, "max-response-body", idemhttp.DefaultMaxResponseBody, "largest response body saved for replay, bytes")
	fs.DurationVar(&c.maxWait, "max-wait", idemhttp.DefaultMaxWait, "cap on Prefer: wait=N")
	fs.DurationVar(&c.claimDeadline, "claim-deadline", 0, "deadline of a proxied claim (0: none; only the owner's death makes it stale): at least 5/4 of --upstream-timeout; the request is cancelled a fifth of it before the deadline")
	fs.DurationVar(&c.apiDeadline, "api-deadline", idemhttp.DefaultAPIDeadline, "default deadline of a claim made through the JSON API")
	fs.StringVar(&c.zone, "zone", "", "the data centre (zone) this process runs in: jobs submitted through its worker API are run by a worker of this zone while it has one (package jobs, WithZone)")
	fs.IntVar(&c.maxCheckpoint, "max-checkpoint-bytes", idemhttp.DefaultMaxCheckpoint, "largest checkpoint a worker of the JSON API may save, bytes (413 past it)")
	fs.Float64Var(&c.limits.ClaimsPerSecond, "tenant-claims-per-second", 0, "keyed requests (claims, replays included) one tenant may make per second in this process (429 past it; 0: no limit)")
	fs.IntVar(&c.limits.ClaimBurst, "tenant-claim-burst", 0, "burst of --tenant-claims-per-second (0: one second's worth)")
	fs.Float64Var(&c.limits.BytesPerSecond, "tenant-bytes-per-second", 0, "bytes of saved outcomes and checkpoints one tenant may have written per second in this process (429 on its next claims past it; 0: no limit)")
	fs.Int64Var(&c.limits.BytesBurst, "tenant-bytes-burst", 0, "burst of --tenant-bytes-per-second (0: ten seconds' worth, at least 1 MiB)")
	fs.StringVar(&c.fixedTenant, "tenant", etcdstore.DefaultTenant, "tenant of every key when idem authenticates no request (no --tokens-file, --tls-client-ca-file or --tenant-header): a sidecar serving one service (jobs stay in their own tenant, jobs)")
	fs.StringVar(&c.tenantHeader, "tenant-header", "", "request header naming the tenant, honoured only from --trusted-proxies")
	fs.Var(list(&c.trustedProxies), "trusted-proxies", "CIDRs of authenticating proxies whose --tenant-header is trusted")
	fs.StringVar(&c.tlsCertFile, "tls-cert-file", "", "serve --listen over TLS with this certificate (PEM; reloaded when it changes)")
	fs.StringVar(&c.tlsKeyFile, "tls-key-file", "", "key of --tls-cert-file")
	fs.StringVar(&c.tlsClientCAFile, "tls-client-ca-file", "", "require client certificates on --listen signed by this CA; the tenant is the certificate's common name")
	fs.StringVar(&c.adminTLSCertFile, "admin-tls-cert-file", "", "serve --admin-listen over TLS with this certificate")
	fs.StringVar(&c.adminTLSKeyFile, "admin-tls-key-file", "", "key of --admin-tls-cert-file")
	fs.StringVar(&c.adminTLSClientCAFile, "admin-tls-client-ca-file", "", "require client certificates on --admin-listen signed by this CA")
	fs.DurationVar(&c.readHeaderTimeout, "read-header-timeout", 10*time.Second, "time a client has to send its request headers (slow clients, slowloris)")
	fs.DurationVar(&c.readTimeout, "read-timeout", time.Minute, "time a client has to send its whole request, body included")
	fs.StringVar(&c.tokensFile, "tokens-file", "", "bearer tokens: lines of \"tenant token\"; a request's Authorization: Bearer token names its tenant")
	fs.DurationVar(&c.retention, "retention", etcdstore.DefaultRetention, "how long keys are kept after their last write; clients must stop retrying well inside it")
	fs.DurationVar(&c.bucketWidth, "bucket-width", etcdstore.DefaultBucketWidth, "width of a retention bucket (one shared lease each)")
	fs.DurationVar(&c.sessionTTL, "session-ttl", etcdstore.DefaultSessionTTL, "TTL of this process's liveness lease: its claims are taken over this long after it dies")
	fs.DurationVar(&c.requestTimeout, "request-timeout", etcdstore.DefaultRequestTimeout, "bound on each etcd request; past it a request gets 503 (raise across data centres)")
	fs.Int64Var(&c.cacheSize, "cache-size", 0, "bytes of done records kept in memory, fed by an etcd Watch, so replays need no etcd round trip (0: no cache; worth it when retries are frequent)")
	fs.BoolVar(&c.readyWhenFull, "ready-when-full", false, "keep /readyz at 200 while etcd is out of space (NOSPACE): for sidecars, whose pod must keep serving the traffic idem passes through, and replays")
	fs.DurationVar(&c.cacheStaleness, "cache-staleness", etcdstore.DefaultCacheStaleness, "with --cache-size: the cache answers only while it provably lags etcd by less than this (a cut-off process stops replaying from memory after it)")
	fs.Int64Var(&c.keysPerLease, "keys-per-lease", 20000, "writes this process attaches to one retention lease before its bucket rolls to a fresh lease (a lease's expiry deletes its keys in one raft entry)")
	fs.StringVar(&c.shardsFile, "shards-file", "", "spread keys over several etcd clusters, as this YAML file says (docs/OPERATIONS.md, \"Sharding\"); instead of --endpoints")
	fs.BoolVar(&c.expirySweep, "expiry-sweep", true, "delete expired records a few at a time (one process at a time per lease), instead of leaving them to etcd's lease expiry, which deletes a lease's keys in one raft entry and stalls every request meanwhile")
	fs.BoolVar(&c.batching, "batching", true, "group commit: send the writes of concurrent requests to etcd together, as one Txn of Txns (etcd 3.3 or later)")
	fs.IntVar(&c.batchMembers, "batch-max-writes", etcdstore.DefaultBatchMembers, "most writes in one batch: at most 127, under etcd's --max-txn-ops (default 128)")
	fs.IntVar(&c.batchBytes, "batch-max-bytes", etcdstore.DefaultBatchBytes, "most request bytes in one batch, under etcd's --max-request-bytes (default 1.5 MiB); a larger write goes alone")
	fs.IntVar(&c.recordFormat, "record-format", 3, "format of the records written (every format is read): 1 or 2 while older idem processes (0.1, 0.2) still run, then 3 (compressed against a shared dictionary where that saves space)")
	fs.StringVar(&c.dataDir, "data-dir", "idem-data", "data directory of the embedded etcd (without --endpoints)")
	fs.StringVar(&c.embeddedClientURL, "embedded-client-url", "", "client URL of the embedded etcd (default: the unix socket DATA-DIR/etcd.sock, mode 0600 in a 0700 directory: no other local user reaches it; an http:// URL has no TLS and no auth)")
	fs.StringVar(&c.embeddedPeerURL, "embedded-peer-url", "http://127.0.0.1:2380", "peer URL of the embedded etcd")
	fs.Int64Var(&c.quotaBytes, "quota-backend-bytes", 2<<30, "backend quota of the embedded etcd, bytes")
	fs.StringVar(&c.compaction, "auto-compaction-retention", "1h", "periodic auto-compaction window of the embedded etcd")
	fs.BoolVar(&c.unsafeNoFsync, "unsafe-no-fsync", false, "embedded etcd without fsync: loses acknowledged data on a crash; benchmarks only")
	fs.StringVar(&c.logFormat, "log-format", "json", "log format: json or text")
	fs.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.BoolVar(&c.logKeys, "log-keys", false, "log idempotency keys in clear (default: a hash)")
	fs.BoolVar(&c.pprof, "pprof", false, "serve /debug/pprof on the admin address")
	fs.Var(list(&c.consoleHosts), "console-hosts", "host names the console answers to over plain HTTP, comma-separated, besides IP addresses and localhost (against DNS rebinding; over TLS, any)")
	fs.BoolVar(&c.console, "console", false, "serve the console (keys, jobs, schedules, the cluster) under /console/ on the admin address, behind its TLS and client certificates")
	fs.DurationVar(&c.shutdownGrace, "shutdown-grace", 30*time.Second, "on SIGTERM, how long in-flight requests may take to finish")
	return fs
}

// validate checks what flag parsing cannot.
func (c *serveConfig) validate() error {
	if c.upstream != "" {
		u, err := url.Parse(c.upstream)
		if err != nil || u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
			return fmt.Errorf("--upstream %q: must be an absolute http or https URL", c.upstream)
		}
	}
	if _, ok := ends[c.onUnknownOutcome]; !ok {
		return fmt.Errorf("--on-unknown-outcome %q: must be save, release or abandon", c.onUnknownOutcome)
	}
	if c.zone != "" {
		if err := jobs.ValidateName(c.zone); err != nil {
			return fmt.Errorf("--zone: %w", err)
		}
	}
	if c.logFormat != "json" && c.logFormat != "text" {
		return fmt.Errorf("--log-format %q: must be json or text", c.logFormat)
	}
	if _, err := parseLevel(c.logLevel); err != nil {
		return err
	}
	if (c.tenantHeader == "") != (len(c.trustedProxies) == 0) {
		return errors.New("--tenant-header and --trusted-proxies go together")
	}
	if err := etcdstore.ValidateTenant(c.fixedTenant); err != nil {
		return fmt.Errorf("--tenant: %w", err)
	}
	if c.fixedTenant != etcdstore.DefaultTenant && (c.tokensFile != "" || c.tlsClientCAFile != "" || c.tenantHeader != "") {
		return errors.New("--tenant names the tenant of requests idem does not authenticate; with --tokens-file, --tls-client-ca-file or --tenant-header each request names its own")
	}
	if _, err := c.trusted(); err != nil {
		return err
	}
	if _, err := c.statusRules(); err != nil {
		return fmt.Errorf("--on-status: %w", err)
	}
	for flagName, names := range map[string][]string{"--replay-deny-headers": c.replayDeny, "--replay-allow-headers": c.replayAllow} {
		for _, k := range names {
			if k == "none" && flagName == "--replay-deny-headers" && len(names) == 1 {
				continue
			}
			if !httpguts.ValidHeaderFieldName(k) {
				return fmt.Errorf("%s: %q is not a header name", flagName, k)
			}
		}
	}
	if len(c.consoleHosts) > 0 && !c.console {
		return errors.New("--console-hosts needs --console")
	}
	for _, h := range c.consoleHosts {
		if h == "" || strings.ContainsAny(h, ":/ @[]") || strings.Trim(h, ".") == "" {
			return fmt.Errorf("--console-hosts: %q is not a host name (no scheme, port or path: idem.internal.example)", h)
		}
	}
	if c.problemDocs != "none" {
		if u, err := url.Parse(c.problemDocs); err != nil || !u.IsAbs() || u.Host == "" {
			return fmt.Errorf("--problem-docs-url %q: must be an absolute URL, or none", c.problemDocs)
		}
	}
	for _, p := range append(append([]string{}, c.requireKey...), c.release5xx...) {
		if !strings.HasPrefix(p, "/") {
			return fmt.Errorf("route prefix %q must start with /", p)
		}
	}
	if _, err := idemhttp.NewLimiter(c.limits); err != nil {
		return fmt.Errorf("--tenant-*: %w", err)
	}
	if c.embeddedClientURL == "" {
		c.embeddedClientURL = socketURL(c.dataDir)
	}
	if sock, ok := unixSocket(c.embeddedClientURL); ok && len(sock) > 100 {
		return fmt.Errorf("--data-dir %q: the embedded etcd's socket path %q is over the 100 bytes a unix socket may have; use a shorter path or --embedded-client-url", c.dataDir, sock)
	}
	if c.shardsFile != "" {
		if len(c.etcd.endpoints) > 0 {
			return errors.New("--shards-file and --endpoints: give one (the shards file names each cluster's endpoints)")
		}
		if err := checkShards(c.shardsFile, c.etcd); err != nil {
			return err
		}
		_, names, _, _ := readShards(c.shardsFile, c.etcd)
		c.shardNames = names
	}
	// The store's own checks, flag by flag, then together (bucket width
	// against retention): a value the store would refuse exits 2 here,
	// before anything talks to etcd.
	for _, f := range []struct {
		flag  string
		value any
		opt   etcdstore.Option
	}{
		{"--retention", c.retention, etcdstore.WithRetention(c.retention)},
		{"--session-ttl", c.sessionTTL, etcdstore.WithSessionTTL(c.sessionTTL)},
		{"--request-timeout", c.requestTimeout, etcdstore.WithRequestTimeout(c.requestTimeout)},
		{"--cache-size", c.cacheSize, etcdstore.WithCache(c.cacheSize)},
		{"--keys-per-lease", c.keysPerLease, etcdstore.WithKeysPerLease(c.keysPerLease)},
		{"--bucket-width", c.bucketWidth, etcdstore.WithBucketWidth(min(c.bucketWidth, c.retention))},
	} {
		if err := etcdstore.CheckOptions(f.opt); err != nil {
			return fmt.Errorf("%s %v: %w", f.flag, f.value, err)
		}
	}
	if err := etcdstore.CheckOptions(c.storeOptions(nil)...); err != nil {
		return err
	}
	if c.claimDeadline < 0 {
		return fmt.Errorf("--claim-deadline %v must not be negative", c.claimDeadline)
	}
	upstream := c.upstreamTimeout
	if upstream <= 0 {
		upstream = 30 * time.Second // what the proxy waits for a value of 0 or less
	}
	if c.claimDeadline > 0 && c.claimDeadline-c.claimDeadline/5 < upstream {
		// Past a claim's deadline the next retry takes the key over and
		// reaches the upstream again, while the first request may still run.
		return fmt.Errorf("--claim-deadline %v is shorter than the upstream may take (--upstream-timeout %v, which waits %v, and a request is cancelled a fifth of the claim deadline before it): a retry could reach the upstream while the first request still runs; raise --claim-deadline above %v or lower --upstream-timeout",
			c.claimDeadline, c.upstreamTimeout, upstream, upstream*5/4)
	}
	if limit := idemhttp.MaxResponseBodyFor(etcdstore.DefaultMaxRecordSize); c.maxResponseBody > limit {
		return fmt.Errorf("--max-response-body %d: over the %d bytes a saved response may have (etcd's records hold %d bytes, less room for headers)",
			c.maxResponseBody, limit, etcdstore.DefaultMaxRecordSize)
	}
	if c.recordFormat < 1 || c.recordFormat > 3 {
		return fmt.Errorf("--record-format %d: must be 1, 2 or 3", c.recordFormat)
	}
	if c.batchMembers < 1 || c.batchMembers > 127 {
		return fmt.Errorf("--batch-max-writes %d: must be between 1 and 127", c.batchMembers)
	}
	if c.batchBytes < 4096 {
		return fmt.Errorf("--batch-max-bytes %d: must be at least 4096", c.batchBytes)
	}
	if c.maxConnections < 0 {
		return fmt.Errorf("--max-connections %d must not be negative", c.maxConnections)
	}
	if c.maxCheckpoint <= 0 {
		return fmt.Errorf("--max-checkpoint-bytes %d must be positive", c.maxCheckpoint)
	}
	if c.cacheStaleness < 100*time.Millisecond {
		return fmt.Errorf("--cache-staleness %v must be at least 100ms", c.cacheStaleness)
	}
	if c.shutdownGrace <= 0 {
		return fmt.Errorf("--shutdown-grace %v must be positive", c.shutdownGrace)
	}
	if c.readHeaderTimeout <= 0 || c.readTimeout <= 0 {
		return errors.New("--read-header-timeout and --read-timeout must be positive: without them one slow client holds a connection forever")
	}
	if (c.tlsCertFile == "") != (c.tlsKeyFile == "") {
		return errors.New("--tls-cert-file and --tls-key-file go together")
	}
	if c.tlsClientCAFile != "" && c.tlsCertFile == "" {
		return errors.New("--tls-client-ca-file needs --tls-cert-file: client certificates need TLS")
	}
	if (c.adminTLSCertFile == "") != (c.adminTLSKeyFile == "") {
		return errors.New("--admin-tls-cert-file and --admin-tls-key-file go together")
	}
	if c.adminTLSClientCAFile != "" && c.adminTLSCertFile == "" {
		return errors.New("--admin-tls-client-ca-file needs --admin-tls-cert-file")
	}
	return nil
}

// statusRules parses --on-status.
func (c *serveConfig) statusRules() ([]idemhttp.StatusRule, error) {
	var rules []idemhttp.StatusRule
	for _, s := range c.onStatus {
		r, err := idemhttp.ParseStatusRule(s)
		if err != nil {
			return nil, err
		}
		rules = append(rules, r)
	}
	return rules, nil
}

// load reads the files the flags name (certificates, tokens), so that a bad
// one stops idem before it starts etcd or listens.
func (c *serveConfig) load() error {
	var err error
	if c.tlsCertFile != "" {
		auth := tlsfiles.NoClientCert
		if c.tlsClientCAFile != "" {
			// With bearer tokens too, a client may use either.
			auth = tlsfiles.RequireClientCert
			if c.tokensFile != "" {
				auth = tlsfiles.VerifyClientCertIfGiven
			}
		}
		if c.mainTLS, err = tlsfiles.ServerConfig(c.tlsCertFile, c.tlsKeyFile, c.tlsClientCAFile, auth); err != nil {
			return fmt.Errorf("--tls-cert-file: %w", err)
		}
	}
	if c.adminTLSCertFile != "" {
		auth := tlsfiles.NoClientCert
		if c.adminTLSClientCAFile != "" {
			auth = tlsfiles.RequireClientCert
		}
		if c.adminTLS, err = tlsfiles.ServerConfig(c.adminTLSCertFile, c.adminTLSKeyFile, c.adminTLSClientCAFile, auth); err != nil {
			return fmt.Errorf("--admin-tls-cert-file: %w", err)
		}
	}
	if c.tokensFile != "" {
		fi, err := os.Stat(c.tokensFile)
		if err != nil {
			return fmt.Errorf("--tokens-file: %w", err)
		}
		// Owner- or group-readable only: a Kubernetes Secret reaches a
		// non-root process through its pod's fsGroup (defaultMode 0440).
		if fi.Mode().Perm()&0o037 != 0 {
			return fmt.Errorf("--tokens-file %s: mode %v lets others read or change the tokens; chmod 600 (or 640, 440) it", c.tokensFile, fi.Mode().Perm())
		}
		data, err := os.ReadFile(c.tokensFile)
		if err != nil {
			return fmt.Errorf("--tokens-file: %w", err)
		}
		if c.tokens, err = idemhttp.ParseTokens(data); err != nil {
			return fmt.Errorf("--tokens-file %s: %w", c.tokensFile, err)
		}
	}
	return nil
}

// tenant is how a request's tenant is found. Without authentication every
// request is in the default tenant; with it, a request that proves no
// identity is refused (401), never put in a default tenant. Precedence: a
// trusted proxy's header, then a client certificate, then a bearer token.
func (c *serveConfig) tenant() idemhttp.TenantFunc {
	tenant := idemhttp.FixedTenant(c.fixedTenant)
	if c.tlsClientCAFile != "" || c.tokens != nil {
		tenant = idemhttp.Unauthenticated()
	}
	if c.tokens != nil {
		tenant = idemhttp.BearerTenant(c.tokens, tenant)
	}
	if c.tlsClientCAFile != "" {
		tenant = idemhttp.CertTenant(tenant)
	}
	if c.tenantHeader != "" {
		trusted, _ := c.trusted()
		tenant = idemhttp.TrustedHeaderTenant(c.tenantHeader, trusted, tenant)
	}
	return tenant
}

func (c *serveConfig) trusted() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range c.trustedProxies {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return nil, fmt.Errorf("--trusted-proxies %q: not a CIDR or address", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		out = append(out, p)
	}
	return out, nil
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level %q: must be debug, info, warn or error", s)
	}
	return l, nil
}

func (c *serveConfig) logger(w io.Writer) *slog.Logger {
	level, _ := parseLevel(c.logLevel)
	opts := &slog.HandlerOptions{Level: level}
	if c.logFormat == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

// serve runs idem serve until ctx ends, then shuts down gracefully.
func serve(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c serveConfig
	fs := c.flags(stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := c.validate(); err != nil {
		return usageError{err}
	}
	if err := c.load(); err != nil {
		return err
	}
	log := c.logger(stderr)
	c.jobsLog = log
	tp, err := setupTracing(ctx)
	if err != nil {
		log.Error("idem could not start", "err", err)
		return err
	}
	if tp != nil {
		c.tracer = tp
		c.etcd.dialOptions = append(c.etcd.dialOptions, grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp))))
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := tp.Shutdown(sctx); err != nil {
				log.Warn("idem: flushing traces", "err", err)
			}
		}()
		log.Info("idem: exporting traces over OTLP")
	}
	srv, err := newServer(ctx, &c, log)
	if err != nil {
		log.Error("idem could not start", "err", err)
		return err
	}
	defer srv.Close()
	if err := srv.Run(ctx); err != nil {
		log.Error("idem is exiting", "err", err)
		return err
	}
	log.Info("idem is exiting", "reason", "signal")
	return nil
}

// connLimit is --max-connections, or the default from the open-file limit:
// what is left after 128 descriptors for etcd (embedded or its client) and
// idem itself, halved because a proxied request may hold an upstream
// connection too.
func (c *serveConfig) connLimit() int {
	if c.maxConnections > 0 {
		return c.maxConnections
	}
	return max(16, (openFileLimit()-128)/2)
}

// adminConnLimit bounds the admin listener's connections: probes and
// scrapes need few, and a flood of them must not take the edge's share.
const adminConnLimit = 32
