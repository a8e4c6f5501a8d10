package explore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/idemgrpc"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/sim"
)

// The etcd every schedule runs on: one member, shared; each schedule has
// its own key prefix.
var cluster *etcdtest.Cluster

func TestMain(m *testing.M) {
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
		return m.Run()
	}()
	os.Exit(code)
}

// world is one schedule.
type world struct {
	seed    uint64
	s       *sched
	rng     *rand.Rand // scripts and faults, drawn in the deterministic order of the run
	prefix  string
	admin   *clientv3.Client // fault-free, for the nemesis and the checks
	decoder *etcdstore.Admin // reads the records of the history
	procs   []*process
	sink    *sink
	up      *httptest.Server
	start   int64 // etcd revision before the schedule

	faultRate float64    // share of actor calls that get a fault
	jobs      jobsConfig // how the schedule's jobs fail
	healed    bool       // no more faults
	faults    int        // faults injected

	mu     sync.Mutex
	events []event // the log the invariants are checked on
	waits  []event // what Wait observers saw, outside the schedule's order
	seq    int
	trace  []string // what happened, printed when a schedule fails

	observers sync.WaitGroup

	hist     chan clientv3.WatchResponse
	stopHist context.CancelFunc
}

// process is one idem process incarnation: an etcd client with the fault
// injector, a store, and a proxy in front of the shared upstream.
type process struct {
	slot, gen int
	name      string
	cli       *clientv3.Client
	store     *etcdstore.Store
	proxy     http.Handler
	unary     grpc.UnaryServerInterceptor // idemgrpc's, on the process's store
	renew     chan struct{}
	owner     string // the session the explorer last saw
	outage    int    // the next calls through it that all fail or lose their reply
	dead      bool   // crashed or closed: its calls fail
	tasks     []*task
	unreg     func()
}

// task is one of a store's background writes, run as an actor.
type task struct {
	name    string
	try     func(context.Context) bool
	done    bool
	running bool // a try is under way (perhaps held inside an etcd call)
	a       *actor
	proc    *process
}

// call is what an etcd call's context says about who makes it.
type call struct {
	a      *actor
	p      *process
	noHold bool // the driver's own calls (Close's flush): it cannot yield
}

type callKey struct{}

func withCall(ctx context.Context, c *call) context.Context {
	return context.WithValue(sim.WithoutWaits(ctx), callKey{}, c)
}

func (w *world) ctx(a *actor, p *process) context.Context {
	return withCall(context.Background(), &call{a: a, p: p})
}

var errInjected = status.Error(codes.Unavailable, "explore: injected fault")

func newWorld(seed uint64) (*world, error) {
	w := &world{
		seed:   seed,
		s:      newSched(seed, time.Unix(1_800_000_000, 0)),
		rng:    rand.New(rand.NewPCG(seed^0x5bd1e995, seed)),
		prefix: fmt.Sprintf("/explore/%d/", seed),
	}
	w.faultRate = []float64{0, 0.05, 0.15, 0.3}[w.rng.IntN(4)]
	w.pickJobs()
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
	w.watchHistory()
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

// newProcess starts incarnation gen of process slot.
func (w *world) newProcess(slot, gen int) (*process, error) {
	p := &process{slot: slot, gen: gen, name: fmt.Sprintf("p%d.%d", slot, gen), renew: make(chan struct{}, 1)}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   cluster.Endpoints(),
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(w.inject(p))},
	})
	if err != nil {
		return nil, err
	}
	p.cli = cli
	p.unreg = sim.Register(cli, &sim.Hooks{
		Now:       w.s.Now,
		AfterFunc: w.s.afterFunc,
		Spawn:     func(name string, try func(context.Context) bool) { w.spawnTask(p, name, try) },
		Flush:     func() { w.flush(p, 20) },
		Renew:     p.renew,
	})
	opts := []etcdstore.Option{etcdstore.WithPrefix(w.prefix), etcdstore.WithRetention(time.Hour), etcdstore.WithSessionTTL(10 * time.Second)}
	if w.rng.IntN(3) == 0 {
		opts = append(opts, etcdstore.WithCache(1<<20))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := etcdstore.New(ctx, cli, opts...)
	if err != nil {
		cli.Close()
		return nil, err
	}
	p.store = st
	p.owner = st.Owner()
	mw, err := idemhttp.New(idemhttp.Config{Store: st, OnUnknownOutcome: etcdstore.EndSave})
	if err != nil {
		return nil, err
	}
	icp, err := idemgrpc.New(idemgrpc.Config{Store: st})
	if err != nil {
		return nil, err
	}
	p.unary = icp.Unary()
	up, _ := url.Parse(w.up.URL)
	rp, err := idemhttp.ReverseProxy(up, idemhttp.ProxyOptions{
		Transport: &refusing{next: &http.Transport{ResponseHeaderTimeout: 10 * time.Millisecond}},
	})
	if err != nil {
		return nil, err
	}
	// Between the middleware and the reverse proxy, log the claim each
	// request runs under.
	p.proxy = mw.Wrap(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		tok, _, _ := fencing.FromHeader(r.Header)
		c, _ := r.Context().Value(callKey{}).(*call)
		key := r.Header.Get(idemhttp.HeaderKey)
		w.log(event{kind: evGrant, key: key, token: int64(tok), proc: p.name, actor: c.a.name, via: "proxy"})
		// The work is the upstream call: once it returns, what is left
		// is saving its answer (a pending save keeps the hold, below).
		defer w.log(event{kind: evHoldEnd, key: key, token: int64(tok), actor: c.a.name, via: "proxy"})
		rp.ServeHTTP(rw, r)
	}))
	return p, nil
}

// inject is the fault injector of one process's etcd client.
func (w *world) inject(p *process) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		c, _ := ctx.Value(callKey{}).(*call)
		if c == nil || sim.Tag(ctx) == "session" {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		if p.dead {
			return errInjected // the process is gone
		}
		invoke := func() error { return invoker(ctx, method, req, reply, cc, opts...) }
		if w.healed {
			return invoke()
		}
		name := method[strings.LastIndexByte(method, '/')+1:]
		holdable := !c.noHold && c.a != nil && onRecord(w.prefix, req)
		f, rate := w.rng.Float64(), w.faultRate
		if p.outage > 0 {
			// A connection outage: every call fails or loses its reply.
			p.outage--
			f, rate = 0.6*w.rng.Float64(), 1
		}
		if f < rate {
			w.faults++
		}
		switch {
		case f >= rate:
			return invoke()
		case f < rate*0.3:
			w.note("%s: %s fails before etcd", who(c), name)
			return errInjected
		case f < rate*0.6 || !holdable:
			err := invoke()
			w.note("%s: %s applied, reply lost (err %v)", who(c), name, err)
			if err != nil {
				return err
			}
			return errInjected
		case f < rate*0.8:
			w.note("%s: %s held before etcd", who(c), name)
			if !w.hold(c, p) {
				return errInjected
			}
			return invoke()
		default:
			err := invoke()
			w.note("%s: %s applied, reply held", who(c), name)
			if !w.hold(c, p) {
				return errInjected
			}
			return err
		}
	}
}

func who(c *call) string {
	if c.a == nil {
		return c.p.name + "/driver"
	}
	return c.a.name + "@" + c.p.name
}

// onRecord reports whether an etcd request touches a record key (a hold
// there cannot block another actor on a lock: lease and bucket calls may).
func onRecord(prefix string, req any) bool {
	rec := prefix + "k/"
	switch r := req.(type) {
	case *pb.TxnRequest:
		for _, c := range r.Compare {
			if strings.HasPrefix(string(c.Key), rec) {
				return true
			}
		}
	case *pb.RangeRequest:
		return strings.HasPrefix(string(r.Key), rec)
	}
	return false
}

// hold parks the calling actor in the middle of an etcd call while others
// run. It reports false when the call's process died meanwhile.
func (w *world) hold(c *call, p *process) bool {
	c.a.inProc = p
	ok := w.s.yield(c.a)
	c.a.inProc = nil
	return ok && !p.dead
}

// spawnTask runs a store's background write as an actor of its process.
func (w *world) spawnTask(p *process, name string, try func(context.Context) bool) {
	if p.dead {
		return // the process is gone, and its pending writes with it
	}
	t := &task{name: name, try: try, proc: p}
	p.tasks = append(p.tasks, t)
	w.log(event{kind: evTaskStart, proc: p.name, task: name})
	t.a = w.s.spawn(p.name+"/"+name, p, func(a *actor) {
		for !t.done {
			w.s.step(a)
			if t.done { // finished by a flush meanwhile
				return
			}
			t.running = true
			ok := try(w.ctx(a, p))
			t.running = false
			if ok {
				w.taskDone(t)
			}
		}
	})
}

func (w *world) taskDone(t *task) {
	t.done = true
	w.log(event{kind: evTaskDone, proc: t.proc.name, task: t.name})
}

// flush runs p's pending background writes on the driver, up to rounds
// tries each: what Store.Close does before it revokes the session.
func (w *world) flush(p *process, rounds int) {
	for r := 0; r < rounds; r++ {
		pending := false
		for _, t := range p.tasks {
			if t.done || p.dead {
				continue
			}
			pending = true
			if t.running {
				// A try is held inside an etcd call: Close waits for it, so
				// let its actor run until that try is over.
				for t.running && !t.a.finished {
					if err := w.s.resume(t.a, true); err != nil {
						panic(err)
					}
				}
				continue
			}
			if t.try(withCall(context.Background(), &call{p: p, noHold: true})) {
				w.taskDone(t)
			}
		}
		if !pending {
			return
		}
	}
}

// refusing is the proxy's transport: a request marked "refuse" never
// leaves, as when nothing listens upstream.
type refusing struct{ next http.RoundTripper }

func (r *refusing) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Header.Get(hdrBehaviour) == "refuse" {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	return r.next.RoundTrip(req)
}

const hdrBehaviour = "X-Explore-Upstream"

// The upstream: an effect per request that reaches it, as the request's
// marker says, then an answer, a cut-off answer, no answer, or none in time.
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
	body := fmt.Sprintf(`{"charge":%q,"token":%d}`, key, tok)
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
	case "timeout":
		<-r.Context().Done()
	case "fail":
		http.Error(rw, "upstream failed after its effect", http.StatusInternalServerError)
	default:
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusCreated)
		rw.Write([]byte(body))
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

// The nemesis.

// endSession revokes p's session lease, as an expiry would, and waits
// until p has noticed and started a new session.
func (w *world) endSession(p *process) error {
	old := p.store.Owner()
	if old == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := w.admin.Get(ctx, w.prefix+"o/"+old)
	if err != nil {
		return err
	}
	if len(resp.Kvs) == 1 {
		if _, err := w.admin.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
			return err
		}
	}
	w.log(event{kind: evSessionEnd, proc: p.name, owner: old})
	select {
	case p.renew <- struct{}{}:
	default:
	}
	for o := p.store.Owner(); o == old || o == ""; o = p.store.Owner() {
		if ctx.Err() != nil {
			return fmt.Errorf("%s did not replace its session: %w", p.name, ctx.Err())
		}
		time.Sleep(time.Millisecond)
	}
	p.owner = p.store.Owner()
	return nil
}

// crash stops p as kill -9 would (and as its session's expiry then would):
// its actors stop at once, its session is gone, its pending writes are
// lost. A new incarnation takes its place.
func (w *world) crash(p *process) error {
	w.log(event{kind: evCrash, proc: p.name, owner: p.store.Owner()})
	p.dead = true
	if err := w.killActors(p); err != nil {
		return err
	}
	if err := w.revokeSession(p); err != nil {
		return err
	}
	p.store.Close() // stops its goroutines; its session is already gone
	p.cli.Close()
	p.unreg()
	return w.replace(p)
}

// shutdown closes p as SIGTERM would: Close flushes its pending final
// writes, then revokes its session; whatever still ran is stopped.
func (w *world) shutdown(p *process) error {
	owner := p.store.Owner()
	w.log(event{kind: evClose, proc: p.name})
	if err := p.store.Close(); err != nil {
		w.note("%s: close: %v", p.name, err)
	}
	w.log(event{kind: evSessionEnd, proc: p.name, owner: owner, body: "closed"})
	p.dead = true
	if err := w.killActors(p); err != nil {
		return err
	}
	p.cli.Close()
	p.unreg()
	return w.replace(p)
}

func (w *world) revokeSession(p *process) error {
	o := p.store.Owner()
	if o == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := w.admin.Get(ctx, w.prefix+"o/"+o)
	if err != nil || len(resp.Kvs) == 0 {
		return err
	}
	_, err = w.admin.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	return err
}

// killActors ends p's actors, and fails the calls other actors are held
// in at p.
func (w *world) killActors(p *process) error {
	for _, a := range w.s.runnable() {
		switch {
		case a.proc == p:
			a.dead = true
			if err := w.s.resume(a, false); err != nil {
				return err
			}
			a.finished = true
		case a.inProc == p:
			if err := w.s.resume(a, false); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *world) replace(p *process) error {
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
		if o := p.store.Owner(); o != p.owner {
			w.log(event{kind: evSessionEnd, proc: p.name, owner: p.owner})
			p.owner = o
		}
	}
}

// close ends every process and the shared parts.
func (w *world) close() {
	w.observers.Wait()
	for _, p := range w.procs {
		if !p.dead {
			p.store.Close()
			p.cli.Close()
			p.unreg()
		}
	}
	w.up.Close()
	if w.stopHist != nil {
		w.stopHist()
	}
	w.admin.Close()
}

func itoa(n int) string { return strconv.Itoa(n) }

var _ = errors.Is
