package explore

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/idemgrpc"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// The etcd every schedule runs on: one member, shared; each schedule has
// its own key prefix.
var cluster *etcdtest.Cluster

func TestMain(m *testing.M) {
	// Package jobs logs to the process's logger by default: the explorer's
	// thousands of worlds would flood the test's output.
	slog.SetDefault(slog.New(slog.DiscardHandler))
	dir, err := os.MkdirTemp("", "idem-explore-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := func() int {
		defer os.RemoveAll(dir)
		c, err := etcdtest.New(dir, 1, etcdtest.Options{})
		if err != nil {
			fmt.Fprintln(os.Stderr, "start etcd:", err)
			return 1
		}
		defer c.Close()
		cluster = c
		// The explorer allocates much and briefly (contexts, records,
		// gRPC messages): collect less often.
		debug.SetGCPercent(300)
		return m.Run()
	}()
	os.Exit(code)
}

// config is what a world draws of how its processes are built: each as
// idem serve builds its store by default (group commit, the expiry
// sweeper, compressed records, the session's TTL, the request timeout),
// with the options a deployment sets: the retention (per process: they may
// differ on one prefix), the replay cache, shard epochs; and each process's
// clock skew.
type config struct {
	retention []time.Duration // per process slot
	cache     []bool
	skew      []time.Duration
	epochs    bool
	restores  bool // the nemesis may snapshot and restore the prefix
	// claimDeadline is the edges' ClaimDeadline (idem serve
	// --claim-deadline; idemgrpc.Config.ClaimDeadline): 0, none.
	claimDeadline time.Duration
	// batchMembers is idem serve's --batch-max-writes, when a world sets it
	// low enough for its few writers to fill a batch: 0, the default.
	batchMembers int
	shards       bool // a shard world: a shard set over sub-prefixes, its placement changed by the nemesis
}

var worlds atomic.Int64

// world is one schedule.
type world struct {
	seed uint64
	// broken lists promises an actor saw broken while the schedule ran
	// (invariant 17), checked with the others at its end.
	broken  []string
	s       *sched
	rng     *rand.Rand // scripts and faults, drawn in the deterministic order of the run
	prefix  string
	cfg     config
	admin   *clientv3.Client // fault-free, for the nemesis and the checks
	decoder *etcdstore.Admin // reads the records of the history
	procs   []*process
	sink    *sink
	up      *httptest.Server
	start   int64 // etcd revision before the schedule
	ledger  *ledger

	faults     faults
	jobs       jobsConfig   // how the schedule's jobs fail
	durable    waitsConfig  // a wait world's sleeps and awaits
	waitLog    []waitEv     // what the wait jobs and signals did
	limits     limitsConfig // a limit world's limit
	limitLog   []limitEv    // the steps the limited jobs' attempts reached
	histEnd    int64        // the revision the history ends at
	zoned      bool         // each process is a data centre of its own (jobs.WithZone)
	healed     bool         // no more faults
	faultCount int          // faults injected
	attempts   int          // attempt ids handed out

	mu     sync.Mutex
	events []event // the log the invariants are checked on
	waits  []event // what Wait observers saw, outside the schedule's order
	seq    int
	trace  []string // what happened, printed when a schedule fails
	leases map[clientv3.LeaseID]*leaseState
	stamps []stamp // revisions etcd was seen at, with the simulated time
	// lastWrite is the revision of the world's latest write: the revision
	// its processes see in the header of every answer that wrote nothing
	// (see revisions in faults_test.go).
	lastWrite int64
	metrics   []etcdstore.Metrics // of processes that ended

	observers sync.WaitGroup

	feed     *feed       // every event of the world's prefix: the watches' source and the history
	restores []restore   // the nemesis's snapshots and restores
	plans    []plan      // a shard world's shard files, in the order the nemesis wrote them
	sched    *schedWorld // a schedule world's schedule, nil in others
	slotPlan map[int]int // the shard file each process slot runs with

	shardDecoders map[string]*etcdstore.Admin // per shard, for the history
	deletes       map[string]deleter          // who deleted a record: by "revision key" (invariant 18)
	copies        dictCopies                  // the dictionaries' copies, from the history (invariant 21)
}

// process is one idem process incarnation: an etcd client with the fault
// injector, a store, and a proxy in front of the shared upstream.
type process struct {
	slot, gen int
	name      string
	cli       *clientv3.Client
	watcher   *simWatcher
	clock     *simClock
	store     *etcdstore.Store // nil in a shard world
	keys      keyStore         // what actors use: store, or set
	set       *shard.Store     // in a shard world: the process's shard set
	plan      int              // in a shard world: the shard file it was started with (w.plans)
	cut       string           // in a shard world: a shard cut off from the process
	cutCalls  int              // for this many more of its keyed calls
	retention time.Duration
	proxy     http.Handler
	unary     grpc.UnaryServerInterceptor // idemgrpc's, on the process's store
	owner     string                      // the session the explorer last saw
	outage    int                         // the next calls through it that all fail or lose their reply
	dead      bool                        // crashed or closed: its calls fail
	closing   bool                        // a graceful close is under way
	stalled   time.Time                   // its watches deliver nothing until then (a lagging member)
}

func newWorld(seed uint64) (*world, error) {
	w := &world{
		seed:   seed,
		rng:    rand.New(rand.NewPCG(seed^0x5bd1e995, seed)),
		prefix: fmt.Sprintf("/explore/%d-%d/", seed, worlds.Add(1)), // a replay of the seed may run meanwhile
		ledger: newLedger(),
		leases: make(map[clientv3.LeaseID]*leaseState),

		shardDecoders: map[string]*etcdstore.Admin{},
	}
	w.s = newSched(seed, w.pickSchedule(w.rng))
	w.faults = faults{
		activation: []float64{0, 0.1, 0.25, 0.25, 0.5}[w.rng.IntN(5)],
		fire:       []float64{0.1, 0.25, 0.5}[w.rng.IntN(3)],
		sites:      map[string]bool{},
	}
	w.pickConfig()
	w.pickJobs()
	w.pickWaits()
	w.pickLimits()
	w.zoned = w.rng.IntN(2) == 0
	admin, err := cluster.Client()
	if err != nil {
		return nil, err
	}
	w.admin = admin
	if w.decoder, err = etcdstore.NewAdmin(admin, etcdstore.WithPrefix(w.prefix)); err != nil {
		admin.Close()
		return nil, err
	}
	resp, err := admin.Get(context.Background(), "/")
	if err != nil {
		admin.Close()
		return nil, err
	}
	w.start = resp.Header.Revision
	w.lastWrite = w.start
	startsMu.Lock()
	starts[w] = w.start
	startsMu.Unlock()
	w.feed = newFeed(admin, w.prefix, w.start+1)
	w.sink = newSink()
	w.up = httptest.NewServer(http.HandlerFunc(w.upstream))
	for i := 0; i < 3; i++ {
		p, err := w.newProcess(i, 0)
		if err != nil {
			w.close()
			return nil, err
		}
		w.procs = append(w.procs, p)
	}
	return w, nil
}

// pickConfig draws how the world's processes are built.
func (w *world) pickConfig() {
	retentions := []time.Duration{20 * time.Second, time.Minute, time.Hour, 24 * time.Hour}
	base := retentions[w.rng.IntN(len(retentions))]
	mixed := w.rng.IntN(3) == 0 // processes with different retentions on one prefix
	for range 3 {
		r := base
		if mixed {
			r = retentions[w.rng.IntN(len(retentions))]
		}
		w.cfg.retention = append(w.cfg.retention, r)
		w.cfg.cache = append(w.cfg.cache, w.rng.IntN(3) == 0)
		// Skew stays under the sweeper's margin (5 s), which is what it is
		// for; deadlines and expiry compare clocks.
		w.cfg.skew = append(w.cfg.skew, []time.Duration{0, 0, time.Second, -time.Second, 3 * time.Second, -3 * time.Second}[w.rng.IntN(6)])
	}
	w.cfg.epochs = w.rng.IntN(4) == 0
	w.cfg.restores = w.rng.IntN(8) == 0
	if w.rng.IntN(3) == 0 {
		w.cfg.claimDeadline = []time.Duration{40 * time.Second, 2 * time.Minute}[w.rng.IntN(2)]
		w.ledger.hit("config:claim deadline on the edges")
	}
	if w.rng.IntN(4) == 0 {
		w.cfg.batchMembers = 2 + w.rng.IntN(2)
		w.ledger.hit("config:small batches (--batch-max-writes)")
	}
	if w.cfg.shards = w.rng.IntN(4) == 0; w.cfg.shards {
		w.pickShards()
		if w.sched != nil && w.sched.spec.Overlap != jobs.OverlapAllowAll {
			// A policy that keeps occurrences apart fences their
			// submission with the cursor in one Txn: one cluster only
			// (NewScheduler refuses it on a shard set).
			w.sched.spec.Overlap = jobs.OverlapAllowAll
		}
	}
	if mixed {
		w.ledger.hit("config:mixed retentions")
	}
	if w.cfg.epochs {
		w.ledger.hit("config:epochs")
	}
}

// newProcess starts incarnation gen of process slot, as idem serve does.
func (w *world) newProcess(slot, gen int) (*process, error) {
	p := &process{slot: slot, gen: gen, name: fmt.Sprintf("p%d.%d", slot, gen), retention: w.cfg.retention[slot]}
	p.clock = &simClock{w: w, p: p, skew: w.cfg.skew[slot]}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   cluster.Endpoints(),
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(w.inject(p)), grpc.WithChainStreamInterceptor(w.injectStream(p))},
		// clientv3 retries a failed read itself, after a real-time
		// backoff (25 ms); its count is the schedule's, its pause is not.
		BackoffWaitBetween: time.Microsecond,
	})
	if err != nil {
		return nil, err
	}
	p.cli = cli
	p.watcher = &simWatcher{w: w, p: p}
	cli.Watcher = p.watcher
	opts := []etcdstore.Option{etcdstore.WithPrefix(w.prefix), etcdstore.WithRetention(p.retention), etcdstore.WithClock(p.clock),
		etcdstore.WithLogger(slog.New(&ledgerLog{w: w, p: p}))}
	if w.cfg.cache[slot] {
		opts = append(opts, etcdstore.WithCache(1<<20))
	}
	if w.cfg.epochs {
		opts = append(opts, storex.WithEpochs())
	}
	if w.jobs.tight {
		opts = append(opts, etcdstore.WithMaxRecordSize(4096))
	}
	if w.cfg.batchMembers > 0 {
		opts = append(opts, etcdstore.WithBatchLimits(w.cfg.batchMembers, etcdstore.DefaultBatchBytes))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if w.cfg.shards {
		set, err := w.newShardSet(ctx, p, opts)
		if err != nil {
			cli.Close()
			return nil, err
		}
		p.set, p.keys = set, set
	} else {
		st, err := etcdstore.New(ctx, cli, opts...)
		if err != nil {
			cli.Close()
			return nil, err
		}
		p.store, p.keys = st, st
	}
	p.owner = p.keys.Owner()
	w.startScheduler(p)
	w.startWaitWorker(p)
	w.startLimitWorker(p)
	mw, err := idemhttp.New(idemhttp.Config{Store: p.keys, OnUnknownOutcome: etcdstore.EndSave, ClaimDeadline: w.cfg.claimDeadline, Logger: slog.New(&ledgerLog{w: w, p: p})})
	if err != nil {
		return nil, err
	}
	icp, err := idemgrpc.New(idemgrpc.Config{Store: p.keys, ClaimDeadline: w.cfg.claimDeadline})
	if err != nil {
		return nil, err
	}
	p.unary = icp.Unary()
	up, _ := url.Parse(w.up.URL)
	// A connection per request: whether a reused one was closed by the
	// upstream meanwhile is a matter of real time.
	rp, err := idemhttp.ReverseProxy(up, idemhttp.ProxyOptions{Transport: &upstreamTransport{next: &http.Transport{DisableKeepAlives: true}}})
	if err != nil {
		return nil, err
	}
	// Between the middleware and the reverse proxy, log the claim each
	// request runs under.
	p.proxy = mw.Wrap(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		tok, _, _ := fencing.FromHeader(r.Header)
		a := w.s.currentCtx(r.Context())
		key := r.Header.Get(idemhttp.HeaderKey)
		w.log(event{kind: evGrant, key: key, token: int64(tok), proc: p.name, actor: a.name, via: "proxy"})
		// The work is the upstream call: once it returns, what is left
		// is saving its answer (a pending save keeps the hold, below).
		defer w.log(event{kind: evHoldEnd, key: key, token: int64(tok), actor: a.name, via: "proxy"})
		rp.ServeHTTP(rw, r)
	}))
	return p, nil
}

// ledgerLog is a process's logger: the store's log lines are paths of the
// ledger, and go to the trace.
type ledgerLog struct {
	w *world
	p *process
}

func (l *ledgerLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *ledgerLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *ledgerLog) WithGroup(string) slog.Handler            { return l }

func (l *ledgerLog) Handle(_ context.Context, r slog.Record) error {
	msg := strings.TrimPrefix(r.Message, "idem: ")
	var attrs []string
	var owner, key string
	var token int64
	r.Attrs(func(a slog.Attr) bool {
		attrs = append(attrs, a.String())
		switch a.Key {
		case "pending_final_writes":
			if a.Value.Int64() > 0 {
				l.w.ledger.hit("path:session lost with a final write pending")
			}
		case "owner":
			owner = a.Value.String()
		case "key":
			key = a.Value.String()
		case "token":
			if a.Value.Kind() == slog.KindInt64 {
				token = a.Value.Int64()
			} // (package jobs logs a fencing.Token)
		}
		return true
	})
	// What a process knows and does, as events the invariants check.
	switch {
	case msg == "schedule: skipped missed occurrences" && l.w.sched != nil:
		l.w.sched.skip(r)
		var after, latest time.Time
		outage := false
		r.Attrs(func(a slog.Attr) bool {
			switch {
			case a.Key == "skipped":
				l.w.sched.skipped += int(a.Value.Int64())
			case a.Key == "after" && a.Value.Kind() == slog.KindTime:
				after = a.Value.Time()
			case a.Key == "latest" && a.Value.Kind() == slog.KindTime:
				latest = a.Value.Time()
			case a.Key == "after_outage":
				outage = a.Value.Bool()
			}
			return true
		})
		l.w.sched.early = append(l.w.sched.early, l.w.sched.judgeSkip(l.p.name, after, latest, outage, l.w.s.Now(), l.p.clock.Now(), l.w.ledger)...)
	case msg == "schedule: skipping an occurrence that cannot be submitted" && l.w.sched != nil:
		l.w.sched.skipped++
		l.w.sched.skip(r)
	case strings.HasPrefix(msg, "schedule: skipped an occurrence: ") && l.w.sched != nil:
		// Skipped by the overlap policy: on time, not late.
		l.w.sched.skipped++
		l.w.sched.skip(r)
		if strings.Contains(msg, "may have been forgotten") {
			l.w.ledger.hit("path:decided occurrence not there past the retention")
		} else {
			l.w.ledger.hit("path:occurrence skipped: another ran (" + l.w.sched.spec.Overlap.String() + ")")
		}
	case msg == "schedule: skipped occurrences: the schedule is paused" && l.w.sched != nil:
		l.w.sched.skip(r)
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "skipped" {
				l.w.sched.skipped += int(a.Value.Int64())
			}
			return true
		})
		l.w.ledger.hit("path:occurrences skipped while paused")
	case msg == "job taken in its preferred worker's place":
		l.w.ledger.hit("path:job taken in its preferred worker's place")
	case msg == "job's rate slot was taken too late to start in: the job waits for the slot's time":
		l.w.ledger.hit("path:rate slot taken too late: the attempt waits")
	case msg == "job waits for a limit":
		l.w.ledger.hit("path:job held back by a limit")
	case msg == "placed value handed over":
		l.w.ledger.hit("path:placed value (a schedule's cursor) handed over to its new shard")
	case msg == "schedule: submitting the buffered occurrence: the previous one ended":
		l.w.ledger.hit("path:buffered occurrence submitted when the previous ended")
	case strings.HasPrefix(msg, "schedule: the previous occurrence's job was forgotten"):
		l.w.ledger.hit("path:schedule deleted a forgotten job's record before the next occurrence")
	case msg == "schedule: submitting an occurrence decided to run but not submitted":
		l.w.ledger.hit("path:occurrence decided but not submitted, submitted by a later tick")
	case strings.HasPrefix(msg, "idem session lost"):
		l.w.log(event{kind: evSessionLost, proc: l.p.name, owner: owner})
	case msg == "store closing":
		l.w.log(event{kind: evCloseStart, proc: l.p.name})
	case msg == "store closed", msg == "gave up a final write at close; the key will be taken over":
		left := int64(1) // a final write given up
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "left" {
				left = a.Value.Int64()
			}
			return true
		})
		if left > 0 {
			l.w.log(event{kind: evCloseLoses, proc: l.p.name, key: l.w.keyOfDigest(key), body: msg})
		}
	case msg == "abandoned a claim whose write had an unknown outcome":
		l.w.log(event{kind: evReaped, proc: l.p.name, key: l.w.keyOfDigest(key), token: token})
	case msg == "shard drained":
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "stale_records_deleted" && a.Value.Int64() > 0 {
				l.w.ledger.hit("path:drain deleted an expired record")
			}
			return true
		})
	}
	if r.Level >= slog.LevelInfo {
		l.w.ledger.hit("log:" + msg)
	}
	l.w.note("%s log: %s %s", l.p.name, msg, strings.Join(attrs, " "))
	return nil
}

// upstreamTransport is the proxy's transport: a request marked "refuse"
// never leaves, as when nothing listens upstream; one marked "timeout" is
// sent (the upstream acts on it) and then times out awaiting its answer,
// at once, whatever real time does.
type upstreamTransport struct{ next http.RoundTripper }

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "net/http: timeout awaiting response headers" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func (u *upstreamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	switch req.Header.Get(hdrBehaviour) {
	case "refuse":
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	case "timeout":
		resp, err := u.next.RoundTrip(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return nil, timeoutErr{}
	}
	return u.next.RoundTrip(req)
}

const hdrBehaviour = "X-Explore-Upstream"

// The upstream: an effect per request that reaches it, as the request's
// marker says, then an answer, a cut-off answer, no answer, or a failure.
func (w *world) upstream(rw http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	key := r.Header.Get(idemhttp.HeaderKey)
	tok, _, _ := fencing.FromHeader(r.Header)
	if r.Header.Get(hdrBehaviour) == "busy" {
		// Too busy to take the request: no effect, try later.
		rw.Header().Set("Retry-After", "1")
		rw.WriteHeader(http.StatusTooManyRequests)
		return
	}
	accepted := w.sink.apply(key, 1, int64(tok), "proxy")
	w.log(event{kind: evEffect, key: key, step: 1, token: int64(tok), accepted: accepted, via: "proxy"})
	out := body(key, int64(tok))
	switch r.Header.Get(hdrBehaviour) {
	case "cut":
		rw.Header().Set("Content-Length", "1000")
		rw.WriteHeader(http.StatusCreated)
		rw.Write([]byte(`{"charge":`))
		rc := http.NewResponseController(rw)
		rc.Flush()
		if conn, _, err := rc.Hijack(); err == nil {
			conn.Close()
		}
	case "drop":
		if conn, _, err := http.NewResponseController(rw).Hijack(); err == nil {
			conn.Close()
		}
	case "fail":
		http.Error(rw, "upstream failed after its effect", http.StatusInternalServerError)
	default:
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusCreated)
		rw.Write(out)
	}
}

// note adds a line to the schedule's trace.
func (w *world) note(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.trace = append(w.trace, fmt.Sprintf("%4d ", w.seq)+fmt.Sprintf(format, args...))
}

func (w *world) log(e event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq++
	e.seq = w.seq
	e.at = w.s.Now()
	w.events = append(w.events, e)
	w.trace = append(w.trace, fmt.Sprintf("%4d %s", e.seq, e))
}

// pump delivers every process's watches what etcd holds up to now, or
// breaks them.
func (w *world) pump(broken bool) error {
	if slowFlag {
		t0 := time.Now()
		defer func() {
			if d := time.Since(t0); d > 100*time.Millisecond {
				fmt.Printf("slow pump: %v\n", d)
			}
		}()
	}
	w.mu.Lock()
	rev := w.lastWrite
	w.mu.Unlock()
	if err := w.feed.catchUp(rev); err != nil {
		return err
	}
	w.ledger.hit("path:watches pumped")
	for _, p := range w.procs {
		if !p.dead && (broken || !p.isStalled(w.s.Now())) {
			p.watcher.pump(rev, broken)
		}
	}
	return nil
}

// isStalled reports whether p's watches deliver nothing at now.
func (p *process) isStalled(now time.Time) bool { return now.Before(p.stalled) }

// progressWanted reports whether a process whose watches deliver asked
// for progress since the last pump: etcd answers such a request at once,
// so the driver pumps before it lets time pass.
func (w *world) progressWanted() bool {
	for _, p := range w.procs {
		if !p.dead && !p.isStalled(w.s.Now()) && p.watcher.progressWanted() {
			return true
		}
	}
	return false
}

// killActors ends p's actors, and fails the calls other actors are held
// in at p.
func (w *world) killActors(p *process) error {
	for _, a := range w.s.live(func(a *actor) bool { return a.proc == p || a.inProc == p || a.waitIn == p }) {
		// An actor of another process (or a client) waiting on p's clock
		// is a request p serves in the caller's goroutine: it dies with
		// p (its caller sees the connection drop, an unknown outcome).
		gone := a.proc == p || a.waitIn == p
		if gone {
			a.dead = true
		}
		if err := w.s.resume(a, false); err != nil {
			return err
		}
		if gone {
			a.finished = true
		}
	}
	return nil
}

// retire ends what is left of a dead process and starts its next
// incarnation.
func (w *world) retire(p *process) error {
	w.mu.Lock()
	w.metrics = append(w.metrics, p.keys.Metrics())
	w.mu.Unlock()
	if err := w.killActors(p); err != nil {
		return err
	}
	p.watcher.Close()
	p.cli.Close()
	n, err := w.newProcess(p.slot, p.gen+1)
	if err != nil {
		return err
	}
	w.procs[p.slot] = n
	return nil
}

// observeSessions logs a session a process replaced on its own (the
// explorer did not end it).
func (w *world) observeSessions() {
	for _, p := range w.procs {
		if o := p.keys.Owner(); o != p.owner {
			p.owner = o
		}
	}
}

// nextAttempt returns a new attempt id. Ids share a long prefix, as random
// ones of one length share nothing but their length: a compare of a
// prefix would take two for one.
func (w *world) nextAttempt() string {
	w.attempts++
	return "explore-attempt-" + strconv.Itoa(1000000+w.attempts)
}

// close ends every process and the shared parts.
func (w *world) close() {
	defer func() {
		startsMu.Lock()
		delete(starts, w)
		startsMu.Unlock()
	}()
	w.observers.Wait()
	for _, p := range w.procs {
		if !p.dead {
			p.dead = true
			w.killActors(p)
			p.watcher.Close()
			p.cli.Close()
		}
	}
	w.mu.Lock()
	leases := w.leases
	w.leases = nil
	w.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for id, ls := range leases {
		ls.stop()
		w.admin.Revoke(ctx, id)
	}
	w.admin.Delete(ctx, w.prefix, clientv3.WithPrefix())
	w.admin.Delete(ctx, w.effectsPrefix(), clientv3.WithPrefix())
	w.s.drain()
	w.up.Close()
	if w.feed != nil {
		w.feed.close()
	}
	w.admin.Close()
}
