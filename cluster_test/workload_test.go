package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
)

// Timings of the clients: short, so faults make them time out and retry.
const (
	sessionTTL     = 2 * time.Second
	requestTimeout = time.Second
	attemptTimeout = 1500 * time.Millisecond
)

// env is one scenario's world: a cluster, a sink, client processes and the
// history of everything they did.
type env struct {
	t       *testing.T
	cluster *etcdtest.Cluster
	sink    *sink
	hist    *history
	prefix  string

	mu      sync.Mutex
	clients []*client
	runs    map[string]int // order -> work invocations
	takes   map[string]int // order -> takeovers
	extra   []string       // orders made outside the load, settled with it
	errs    []error

	fresh, replays, conflicts, unknown atomic.Int64
	faultOps                           atomic.Int64 // operations that failed while a fault was on
	faultOn                            atomic.Bool
}

// client is one idem process: its own etcd client and store.
type client struct {
	id       int
	pinned   int // member whose client proxy it talks through; -1: every member, directly
	cli      *clientv3.Client
	store    *etcdstore.Store
	failures atomic.Int64
	closed   atomic.Bool
}

func newEnv(t *testing.T, members int, opts etcdtest.Options) *env {
	opts.Proxies = true
	if opts.TickMs == 0 {
		opts.TickMs, opts.ElectionMs = 50, 500
	}
	c, err := etcdtest.New(t.TempDir(), members, opts)
	if err != nil {
		t.Fatalf("start %d-member cluster: %v", members, err)
	}
	t.Cleanup(c.Close)
	e := &env{
		t: t, cluster: c, sink: newSink(t, true), hist: newHistory(),
		prefix: fmt.Sprintf("/idem-%d/", time.Now().UnixNano()),
		runs:   map[string]int{}, takes: map[string]int{},
	}
	// Before the cluster closes: open client streams make etcd's graceful
	// stop wait.
	t.Cleanup(e.closeClients)
	return e
}

// newClient starts an idem process talking to etcd through the client
// proxy of member pinned, or to every member directly when pinned is -1.
func (e *env) newClient(pinned int) *client {
	e.t.Helper()
	var eps []string
	if pinned < 0 {
		eps = e.cluster.Endpoints()
	} else {
		eps = []string{e.cluster.Members[pinned].ClientProxy.URL()}
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: eps, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(e.prefix), etcdstore.WithSessionTTL(sessionTTL),
		etcdstore.WithRequestTimeout(requestTimeout), etcdstore.WithEndTimeout(3*time.Second), etcdstore.WithLogger(storeLogger()))
	if err != nil {
		cli.Close()
		e.t.Fatalf("client on member %d: %v", pinned, err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	c := &client{id: len(e.clients), pinned: pinned, cli: cli, store: st}
	e.clients = append(e.clients, c)
	return c
}

// closeClients ends every client process: sessions are revoked, so claims
// they left in flight can be taken over at once.
func (e *env) closeClients() {
	e.mu.Lock()
	cs := e.clients
	e.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range cs {
		if c.closed.Swap(true) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.store.Close()
			c.cli.Close()
		}()
	}
	wg.Wait()
}

// work is the operation behind an order: charge with the order's own key
// (the sink dedupes it), then capture with a fenced write.
func (e *env) work(order, proposal string) etcdstore.Work {
	return func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
		e.mu.Lock()
		e.runs[order]++
		if c.Previous() != nil {
			e.takes[order]++
		}
		e.mu.Unlock()
		for _, step := range []string{"/charge/", "/capture/"} {
			if err := post(ctx, e.sink.URL+step+order, c.Token()); err != nil {
				return nil, err
			}
		}
		return []byte(proposal), nil
	}
}

func post(ctx context.Context, url string, tok fencing.Token) error {
	req, err := http.NewRequestWithContext(ctx, "POST", url, nil)
	if err != nil {
		return err
	}
	fencing.SetHeader(req.Header, tok)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusConflict:
		return errStale
	case resp.StatusCode >= 300:
		return fmt.Errorf("sink: %s", resp.Status)
	}
	return nil
}

var seq atomic.Int64

// attempt runs one Do of order on c and records it. It reports whether the
// order got its outcome.
func (e *env) attempt(c *client, order string, timeout time.Duration, opts ...etcdstore.RunOption) bool {
	proposal := fmt.Sprintf("%s/p%d/%d", order, c.id, seq.Add(1))
	call := e.hist.now()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	opts = append(opts, etcdstore.OnError(etcdstore.EndAbandon))
	res, err := c.store.Do(ctx, etcdstore.Key{ID: order}, []byte(order), e.work(order, proposal), opts...)
	cancel()
	var out opOutput
	switch {
	case err == nil && res.Replayed:
		out = opOutput{outReplay, string(res.Body)}
		e.replays.Add(1)
	case err == nil:
		out = opOutput{outFresh, string(res.Body)}
		e.fresh.Add(1)
	case errors.Is(err, etcdstore.ErrConflict):
		out = opOutput{Kind: outConflict}
		e.conflicts.Add(1)
	case errors.Is(err, etcdstore.ErrMismatch):
		e.fail(fmt.Errorf("order %s: mismatch with the same params: %w", order, err))
		out = opOutput{Kind: outUnknown}
	default:
		if testing.Verbose() && timeout > 10*time.Second {
			e.t.Logf("attempt %s on client %d: %v", order, c.id, err)
		}
		out = opOutput{Kind: outUnknown}
		e.unknown.Add(1)
		c.failures.Add(1)
		if e.faultOn.Load() {
			e.faultOps.Add(1)
		}
	}
	e.hist.add(c.id, opInput{order, proposal}, call, out)
	return out.Kind == outFresh || out.Kind == outReplay
}

func (e *env) fail(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.errs = append(e.errs, err)
}

// load submits new orders until stop is closed; each order is sent
// concurrently by two client processes, each retrying (with a client
// timeout per attempt) until it gets the outcome or the load ends.
func (e *env) load(stop <-chan struct{}, submitters int) []string {
	var mu sync.Mutex
	var orders []string
	var wg sync.WaitGroup
	e.mu.Lock()
	clients := e.clients
	e.mu.Unlock()
	for s := 0; s < submitters; s++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				order := fmt.Sprintf("order-%d-%d", s, n)
				mu.Lock()
				orders = append(orders, order)
				mu.Unlock()
				var both sync.WaitGroup
				for d := 0; d < 2; d++ {
					c := clients[(s+d)%len(clients)]
					both.Add(1)
					go func() {
						defer both.Done()
						for try := 0; !e.attempt(c, order, attemptTimeout); try++ {
							select {
							case <-stop:
								return // the settle phase finishes it
							case <-time.After(time.Duration(50+25*min(try, 8)) * time.Millisecond):
							}
						}
					}()
				}
				both.Wait()
			}
		}()
	}
	wg.Wait()
	sort.Strings(orders)
	return orders
}

// settle gets every order's outcome from a healthy process that waits for
// in-flight claims, and returns the final outcomes.
func (e *env) settle(orders []string) map[string]string {
	c := e.newClient(-1)
	final := make(map[string]string)
	var mu sync.Mutex
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, o := range orders {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if !e.attempt(c, o, 30*time.Second, etcdstore.WithWait()) {
				e.fail(fmt.Errorf("order %s did not settle", o))
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			rec, err := c.store.Get(ctx, etcdstore.Key{ID: o})
			if err != nil {
				e.fail(fmt.Errorf("order %s: final read: %w", o, err))
				return
			}
			mu.Lock()
			final[o] = string(rec.Outcome.Body)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return final
}

// checkInvariants checks what every scenario must keep.
func (e *env) checkInvariants(orders []string, final map[string]string) {
	t := e.t
	t.Helper()
	for _, err := range e.errs {
		t.Error(err)
	}
	// Every acknowledged outcome is the final one: none lost, every replay
	// identical to the first.
	for _, op := range e.hist.operations() {
		in, out := op.Input.(opInput), op.Output.(opOutput)
		if (out.Kind == outFresh || out.Kind == outReplay) && out.Value != final[in.Key] {
			t.Errorf("order %s: a client got %q, the final outcome is %q", in.Key, out.Value, final[in.Key])
		}
	}
	// Every order took effect once downstream; work ran again only after a
	// takeover.
	effects, _ := e.sink.snapshot()
	e.mu.Lock()
	for _, o := range orders {
		if effects[o] != 1 {
			t.Errorf("order %s: %d charges at the sink; want 1", o, effects[o])
		}
		if e.runs[o] > 1+e.takes[o] {
			t.Errorf("order %s: the work ran %d times with %d takeovers", o, e.runs[o], e.takes[o])
		}
	}
	e.mu.Unlock()
	checkLinearizable(t, e.hist)
	t.Logf("%d orders; operations: %d fresh, %d replays, %d conflicts, %d unknown (%d during the fault)",
		len(orders), e.fresh.Load(), e.replays.Load(), e.conflicts.Load(), e.unknown.Load(), e.faultOps.Load())
}

// totalTakeovers counts takeovers across orders.
func (e *env) totalTakeovers() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, v := range e.takes {
		n += v
	}
	return n
}

func withPrefixCount() []clientv3.OpOption {
	return []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithCountOnly()}
}

// holdClaim makes c claim order with a work that charges and then waits for
// release before it captures: a claim in flight, on c's side of whatever
// fault comes next. It returns once the charge is made. Release lets the
// work finish (its capture comes late, after any takeover) and waits for
// its Do to return.
func (e *env) holdClaim(c *client, order string) (release func()) {
	e.mu.Lock()
	e.extra = append(e.extra, order)
	e.mu.Unlock()
	charged, proceed, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		proposal := fmt.Sprintf("%s/held%d", order, c.id)
		call := e.hist.now()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		res, err := c.store.Do(ctx, etcdstore.Key{ID: order}, []byte(order), func(ctx context.Context, cl *etcdstore.Claim) ([]byte, error) {
			e.mu.Lock()
			e.runs[order]++
			e.mu.Unlock()
			err := post(ctx, e.sink.URL+"/charge/"+order, cl.Token())
			close(charged)
			if err != nil {
				return nil, err
			}
			<-proceed
			if err := post(context.WithoutCancel(ctx), e.sink.URL+"/capture/"+order, cl.Token()); err != nil {
				return nil, err
			}
			return []byte(proposal), nil
		}, etcdstore.OnError(etcdstore.EndAbandon))
		out := opOutput{Kind: outUnknown}
		if err == nil && !res.Replayed {
			out = opOutput{outFresh, string(res.Body)}
		}
		e.hist.add(c.id, opInput{order, proposal}, call, out)
	}()
	<-charged
	return func() { close(proceed); <-done }
}

// takeOver has a healthy client finish order, waiting for the stale claim.
func (e *env) takeOver(order string) error {
	c := e.clients[len(e.clients)-1]
	if c.pinned != -1 {
		return fmt.Errorf("the last client must talk to every member")
	}
	// A client given every endpoint may meet the isolated member and lose
	// its session for a while: it retries, as any client would.
	deadline := time.Now().Add(time.Minute)
	for !e.attempt(c, order, 30*time.Second, etcdstore.WithWait()) {
		if time.Now().After(deadline) {
			return fmt.Errorf("taking %s over failed for a minute", order)
		}
		time.Sleep(100 * time.Millisecond) // the client's retry backoff
	}
	return nil
}

// storeLogger is the stores' logger: silent, or warnings on stderr with
// IDEM_TEST_LOG=1 (session losses and restarts, when a scenario misbehaves).
func storeLogger() *slog.Logger {
	if os.Getenv("IDEM_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
