package cluster_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/internal/embedded"
)

// runMember runs one etcd member in this process, as a separate process
// of its own, so that a test can pause it for real (SIGSTOP): it keeps its
// connections open and answers nothing, which no proxy fault reproduces
// exactly. It stops on SIGTERM or when its stdin closes.
func runMember() int {
	var cfg memberConfig
	if err := json.Unmarshal([]byte(os.Getenv("IDEM_CLUSTER_MEMBER")), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "member config:", err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), embedded.ReadyTimeout)
	e, err := embedded.Start(ctx, embedded.Config{Name: cfg.Name, Dir: cfg.Dir, ClientURL: cfg.ClientURL, PeerURL: cfg.PeerURL,
		InitialCluster: cfg.InitialCluster, NoFsync: true})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("ready")
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)
	eof := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(eof) }()
	select {
	case <-stop:
	case <-eof:
	case <-e.Err():
	}
	e.Close()
	return 0
}

// memberConfig is what a member subprocess is told, in its environment.
type memberConfig struct {
	Name, Dir, ClientURL, PeerURL, InitialCluster string
}

// member is an etcd member running as a subprocess.
type member struct {
	cmd       *exec.Cmd
	clientURL string
}

// startMembers starts an n-member cluster, each member its own process.
func startMembers(t *testing.T, n int) []*member {
	t.Helper()
	dir := t.TempDir()
	cfgs := make([]memberConfig, n)
	var initial []string
	for i := range cfgs {
		ports, err := etcdtest.FreePorts(2)
		if err != nil {
			t.Fatal(err)
		}
		cfgs[i] = memberConfig{
			Name:      fmt.Sprintf("m%d", i),
			Dir:       filepath.Join(dir, fmt.Sprintf("m%d", i)),
			ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[0]),
			PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		}
		initial = append(initial, cfgs[i].Name+"="+cfgs[i].PeerURL)
	}
	ms := make([]*member, n)
	ready := make(chan error, n)
	for i, cfg := range cfgs {
		cfg.InitialCluster = strings.Join(initial, ",")
		b, err := json.Marshal(cfg)
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "IDEM_CLUSTER_MEMBER="+string(b))
		in, _ := cmd.StdinPipe() // closed by the cleanup: the member stops
		out, _ := cmd.StdoutPipe()
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		ms[i] = &member{cmd: cmd, clientURL: cfg.ClientURL}
		t.Cleanup(func() {
			cmd.Process.Signal(syscall.SIGCONT)
			in.Close()
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		})
		go func() {
			sc := bufio.NewScanner(out)
			if sc.Scan() && sc.Text() == "ready" {
				ready <- nil
			} else {
				ready <- fmt.Errorf("member %d did not start", i)
			}
			io.Copy(io.Discard, out)
		}()
	}
	for range ms {
		select {
		case err := <-ready:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(embedded.ReadyTimeout):
			t.Fatal("members did not start")
		}
	}
	return ms
}

func endpoints(ms []*member) []string {
	var eps []string
	for _, m := range ms {
		eps = append(eps, m.clientURL)
	}
	return eps
}

// newProductionClient is an etcd client configured as idem serve's:
// gRPC keepalive on, every member as an endpoint.
func newProductionClient(t *testing.T, eps []string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: eps, DialTimeout: 5 * time.Second,
		DialKeepAliveTime: 10 * time.Second, DialKeepAliveTimeout: 5 * time.Second,
		Logger: zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// A gray failure: each member of three in turn is paused (SIGSTOP) for
// pauseFor: it keeps its connections open and answers nothing. Two idem
// processes (stores with the default timeouts) keep serving new keys
// throughout. Correctness must hold (every key's work runs once); the test
// reports the longest stretch without a successful request and the p99
// latency (the goal, checked by reading the report rather than asserted:
// these machines are noisy, is at most 5 s and 6 s).
func TestPausedMember(t *testing.T) {
	if testing.Short() {
		t.Skip("fault scenarios skipped in -short mode")
	}
	pauseFor := 12 * time.Second
	if !*soak {
		pauseFor = 6 * time.Second
	}
	ms := startMembers(t, 3)
	eps := endpoints(ms)
	prefix := fmt.Sprintf("/gray-%d/", time.Now().UnixNano())
	var stores []*etcdstore.Store
	for i := 0; i < 2; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		st, err := etcdstore.New(ctx, newProductionClient(t, eps), etcdstore.WithPrefix(prefix))
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stores = append(stores, st)
	}

	type sample struct {
		start, end time.Time
		ok         bool
	}
	var (
		mu      sync.Mutex
		samples []sample
		errs    = map[string]int{}
		runs    = map[string]int{}
		seq     atomic.Int64
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	for _, st := range stores {
		for c := 0; c < 8; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					key := fmt.Sprintf("o%d", seq.Add(1))
					start := time.Now()
					ok := false
					// A client retries its key until it gets the outcome.
					for try := 0; try < 20 && !ok; try++ {
						ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
						res, err := st.Do(ctx, etcdstore.Key{ID: key}, nil, func(context.Context, *etcdstore.Claim) ([]byte, error) {
							mu.Lock()
							runs[key]++
							mu.Unlock()
							return []byte(key), nil
						})
						cancel()
						ok = err == nil && string(res.Body) == key
						if err != nil {
							mu.Lock()
							errs[errClass(err)]++
							mu.Unlock()
						}
						if !ok && try == 0 {
							// A failed first try is a failed request; the retries
							// only make sure the key ends.
							mu.Lock()
							samples = append(samples, sample{start, time.Now(), false})
							mu.Unlock()
						}
					}
					if ok {
						mu.Lock()
						samples = append(samples, sample{start, time.Now(), true})
						mu.Unlock()
					}
				}
			}()
		}
	}

	time.Sleep(2 * time.Second) // steady load before the first pause
	windowStart := time.Now()
	for _, m := range ms {
		if err := m.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		time.Sleep(pauseFor)
		if err := m.cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * time.Second) // recovery, still under load
	}
	windowEnd := time.Now()
	close(stop)
	wg.Wait()

	for key, n := range runs {
		if n != 1 {
			t.Errorf("key %s ran %d times", key, n)
		}
	}
	var okEnds []time.Time
	var lat []time.Duration
	failed := 0
	for _, s := range samples {
		if s.start.Before(windowStart) {
			continue
		}
		if s.ok {
			okEnds = append(okEnds, s.end)
			lat = append(lat, s.end.Sub(s.start))
		} else {
			failed++
		}
	}
	if len(okEnds) == 0 {
		t.Fatal("no request succeeded during the pauses")
	}
	sort.Slice(okEnds, func(i, j int) bool { return okEnds[i].Before(okEnds[j]) })
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	longest, prev := time.Duration(0), windowStart
	for _, e := range append(okEnds, windowEnd) {
		longest = max(longest, e.Sub(prev))
		prev = e
	}
	p := func(q float64) time.Duration { return lat[int(math.Ceil(q*float64(len(lat))))-1] }
	t.Logf("errors: %v", errs)
	t.Logf("members paused %v each: %d requests succeeded, %d first tries failed; longest stretch without a success %v; latency p50 %v p99 %v max %v",
		pauseFor, len(lat), failed, longest.Round(time.Millisecond), p(0.5).Round(time.Millisecond), p(0.99).Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond))
}

// errClass shortens an error to its kind, for the report.
func errClass(err error) string {
	s := err.Error()
	if i := strings.Index(s, ": "); i >= 0 {
		s = s[i+2:] // drop "claim key"
	}
	if len(s) > 80 {
		s = s[:80]
	}
	return s
}
