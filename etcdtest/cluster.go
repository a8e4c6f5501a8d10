package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/types"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/internal/embedded"
)

// Options adjust a cluster. The zero value is a fast, fsync-less cluster.
type Options struct {
	// Fsync keeps fsync on. Off by default: most tests are not about disk
	// durability, and fsync on a shared CI disk dominates their run time.
	Fsync bool
	// TickMs and ElectionMs override raft timings (defaults 100 and 1000).
	TickMs, ElectionMs uint
	// Configure adjusts every member's embed.Config last.
	Configure func(*embed.Config)
	// Proxies puts a Proxy in front of every member's peer port (advertised
	// to the other members, so all traffic to the member crosses it) and
	// one in front of its client port (Member.ClientProxy), for fault
	// injection.
	Proxies bool
}

// Cluster is a running embedded etcd cluster.
type Cluster struct {
	Members   []*Member
	opts      Options
	memberIDs map[int]types.ID // known even while a member is stopped
	mu        sync.Mutex
	clients   []*clientv3.Client
}

// Member is one embedded etcd member.
type Member struct {
	Name      string
	Dir       string
	ClientURL string
	PeerURL   string
	cfg       embedded.Config

	// PeerProxy carries all raft traffic to this member, when the cluster
	// was started with Proxies. ClientProxy is a proxy to its client port.
	PeerProxy, ClientProxy *Proxy

	mu   sync.Mutex
	etcd *embed.Etcd // nil while stopped
}

// New starts an n-member cluster with data under dir. The caller must Close
// it.
func New(dir string, n int, opts Options) (*Cluster, error) {
	var lastErr error
	for try := 0; try < 3; try++ {
		c, err := start(dir, try, n, opts)
		if err == nil {
			return c, nil
		}
		lastErr = err
		if !errors.Is(err, syscall.EADDRINUSE) && !strings.Contains(err.Error(), "address already in use") {
			break
		}
		// Another process took a port between our probe and etcd's bind: pick
		// new ports and try again.
	}
	return nil, lastErr
}

func start(dir string, try, n int, opts Options) (*Cluster, error) {
	c := &Cluster{opts: opts}
	var initial []string
	for i := 0; i < n; i++ {
		ports, err := FreePorts(2)
		if err != nil {
			return nil, err
		}
		m := &Member{
			Name:      fmt.Sprintf("m%d", i),
			Dir:       filepath.Join(dir, fmt.Sprintf("try%d", try), fmt.Sprintf("m%d", i)),
			ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[0]),
			PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		}
		c.Members = append(c.Members, m)
		advertised := m.PeerURL
		if opts.Proxies {
			var err error
			if m.PeerProxy, err = NewProxy(strings.TrimPrefix(m.PeerURL, "http://")); err != nil {
				c.Close()
				return nil, err
			}
			if m.ClientProxy, err = NewProxy(strings.TrimPrefix(m.ClientURL, "http://")); err != nil {
				c.Close()
				return nil, err
			}
			advertised = m.PeerProxy.URL()
		}
		initial = append(initial, m.Name+"="+advertised)
	}
	for _, m := range c.Members {
		m.cfg = embedded.Config{
			Name:      m.Name,
			Dir:       m.Dir,
			ClientURL: m.ClientURL,
			PeerURL:   m.PeerURL,
			AdvertisePeerURL: func() string {
				if m.PeerProxy != nil {
					return m.PeerProxy.URL()
				}
				return ""
			}(),
			InitialCluster: strings.Join(initial, ","),
			ClusterToken:   filepath.Base(dir),
			NoFsync:        !opts.Fsync,
			TickMs:         opts.TickMs,
			ElectionMs:     opts.ElectionMs,
			Logger:         zap.NewNop(),
			Configure:      opts.Configure,
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), embedded.ReadyTimeout)
	defer cancel()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, m := range c.Members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = m.start(ctx)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		c.Close()
		return nil, err
	}
	c.memberIDs = make(map[int]types.ID)
	for i, m := range c.Members {
		c.memberIDs[i] = m.Etcd().Server.MemberID()
	}
	return c, nil
}

func (m *Member) start(ctx context.Context) error {
	e, err := embedded.Start(ctx, m.cfg)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.etcd = e
	m.mu.Unlock()
	return nil
}

// Etcd returns the running member, or nil while it is stopped.
func (m *Member) Etcd() *embed.Etcd {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.etcd
}

// Stop stops the member gracefully. Its data stays for Restart.
func (m *Member) Stop() {
	m.mu.Lock()
	e := m.etcd
	m.etcd = nil
	m.mu.Unlock()
	if e != nil {
		e.Close()
	}
}

// Kill stops the member at once, as a crash would: raft stops without
// handing leadership over or draining requests. Its data stays for Restart.
func (m *Member) Kill() {
	m.mu.Lock()
	e := m.etcd
	m.etcd = nil
	m.mu.Unlock()
	if e != nil {
		e.Server.HardStop()
		e.Close()
	}
}

// Restart starts a stopped member again on its data directory and waits until
// it serves.
func (m *Member) Restart(ctx context.Context) error {
	cfg := m.cfg
	cfg.Existing = true
	e, err := embedded.Start(ctx, cfg)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.etcd = e
	m.mu.Unlock()
	return nil
}

// Endpoints returns every member's client URL.
func (c *Cluster) Endpoints() []string {
	eps := make([]string, len(c.Members))
	for i, m := range c.Members {
		eps[i] = m.ClientURL
	}
	return eps
}

// Client returns a new client connected to the given endpoints (every
// member when none are given), balancing its requests over them as
// production clients do (etcd's round robin): a member cut off but still
// reachable over TCP costs the requests sent to it, not all of them. The
// cluster closes it.
func (c *Cluster) Client(endpoints ...string) (*clientv3.Client, error) {
	if len(endpoints) == 0 {
		endpoints = c.Endpoints()
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.clients = append(c.clients, cli)
	c.mu.Unlock()
	return cli, nil
}

// MustClient is Client for tests.
func (c *Cluster) MustClient(t testing.TB, endpoints ...string) *clientv3.Client {
	t.Helper()
	cli, err := c.Client(endpoints...)
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	return cli
}

// Leader returns the index of the member that is leader now, or -1 when no
// running member knows a leader.
func (c *Cluster) Leader() int {
	for _, m := range c.Members {
		if e := m.Etcd(); e != nil {
			if l := c.indexOf(e.Server.Leader()); l >= 0 {
				return l
			}
		}
	}
	return -1
}

// Close stops every member, followers first and the leader last (closing
// the leader first makes the followers wait out an election), then closes
// the clients it handed out.
func (c *Cluster) Close() {
	c.mu.Lock()
	clients := c.clients
	c.clients = nil
	c.mu.Unlock()
	for _, cli := range clients {
		cli.Close()
	}
	lead := c.Leader()
	var wg sync.WaitGroup
	for i, m := range c.Members {
		if i == lead {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.Stop()
		}()
	}
	wg.Wait()
	if lead >= 0 {
		c.Members[lead].Stop()
	}
	for _, m := range c.Members {
		for _, p := range []*Proxy{m.PeerProxy, m.ClientProxy} {
			if p != nil {
				p.Close()
			}
		}
	}
}

// FreePorts asks the kernel for n free TCP ports on loopback. A port is only
// known to be free when it is returned; callers that bind later must handle
// "address already in use" by asking again.
func FreePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
