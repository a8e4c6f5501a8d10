package cluster_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
)

// TestMain doubles as a worker process: with IDEM_CLUSTER_WORKER=1 the test
// binary runs one order as a separate process, so that a test can pause it
// for real (SIGSTOP stops its lease keepalives too, which pausing a
// goroutine would not). With IDEM_CLUSTER_MEMBER it runs an etcd member.
func TestMain(m *testing.M) {
	// Package jobs logs to the process's logger by default; the suite's
	// own loggers say what it needs.
	slog.SetDefault(slog.New(slog.DiscardHandler))
	if os.Getenv("IDEM_CLUSTER_WORKER") == "1" {
		os.Exit(runWorker())
	}
	if os.Getenv("IDEM_CLUSTER_JOBWORKER") == "1" {
		os.Exit(runJobWorker())
	}
	if os.Getenv("IDEM_CLUSTER_MEMBER") != "" {
		os.Exit(runMember())
	}
	os.Exit(m.Run())
}

// workerReport is the worker's last line on stdout.
type workerReport struct {
	Body  string `json:"body"`
	Error string `json:"error"`
}

// runWorker claims the order, charges, says "charged TOKEN", waits for a
// line on stdin, captures, and reports.
func runWorker() int {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: strings.Split(os.Getenv("WORKER_ENDPOINTS"), ","), Logger: zap.NewNop()})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(os.Getenv("WORKER_PREFIX")),
		etcdstore.WithSessionTTL(sessionTTL), etcdstore.WithRequestTimeout(requestTimeout))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer store.Close()
	order, sinkURL := os.Getenv("WORKER_ORDER"), os.Getenv("WORKER_SINK")
	fmt.Println("owner", store.Owner())
	in := bufio.NewReader(os.Stdin)
	res, err := store.Do(ctx, etcdstore.Key{ID: order}, []byte(order), func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
		if err := post(ctx, sinkURL+"/charge/"+order, c.Token()); err != nil {
			return nil, err
		}
		fmt.Println("charged", c.Token())
		in.ReadString('\n') // the test pauses us here, then says go
		if err := post(context.WithoutCancel(ctx), sinkURL+"/capture/"+order, c.Token()); err != nil {
			return nil, err
		}
		return []byte("worker"), nil
	}, etcdstore.OnError(etcdstore.EndAbandon))
	rep := workerReport{Body: string(res.Body)}
	if err != nil {
		rep.Error = err.Error()
	}
	b, _ := json.Marshal(rep)
	fmt.Println("report", string(b))
	return 0
}

// worker is a running worker process.
type worker struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
}

func startWorker(t *testing.T, e *env, order string) *worker {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "IDEM_CLUSTER_WORKER=1",
		"WORKER_ENDPOINTS="+strings.Join(e.cluster.Endpoints(), ","), "WORKER_PREFIX="+e.prefix,
		"WORKER_ORDER="+order, "WORKER_SINK="+e.sink.URL)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &worker{cmd: cmd, stdin: stdin, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			w.lines <- sc.Text()
		}
		close(w.lines)
	}()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Process.Kill()
		cmd.Wait()
	})
	return w
}

// expect waits for the worker's next line with prefix and returns the rest.
func (w *worker) expect(t *testing.T, prefix string) string {
	t.Helper()
	select {
	case line, ok := <-w.lines:
		if !ok || !strings.HasPrefix(line, prefix+" ") {
			t.Fatalf("worker said %q (open %v); want %q", line, ok, prefix)
		}
		return strings.TrimPrefix(line, prefix+" ")
	case <-time.After(60 * time.Second):
		t.Fatalf("worker did not say %q", prefix)
		return ""
	}
}

// A worker is paused (SIGSTOP) longer than its session lease, in the middle
// of its work; another process takes the order over; the worker resumes and
// its late write is fenced out at the sink and in etcd.
func TestWorkerPausedPastItsLease(t *testing.T) {
	var sessionExpired, workerFenced bool
	var report workerReport
	run(t, scenario{
		members: 3,
		pins:    []int{0, 1, 2, -1},
		fault: func(ctx context.Context, e *env) error {
			order := "paused-order"
			e.mu.Lock()
			e.extra = append(e.extra, order)
			e.mu.Unlock()
			call := e.hist.now()
			w := startWorker(e.t, e, order)
			owner := w.expect(e.t, "owner")
			w.expect(e.t, "charged")
			if err := w.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
				return err
			}
			// Proof the pause outlived the lease: the owner key goes.
			cli := e.cluster.MustClient(e.t)
			okey := e.prefix + "o/" + owner
			resp, err := cli.Get(ctx, okey)
			if err != nil {
				return err
			}
			if len(resp.Kvs) == 1 {
				for wr := range cli.Watch(ctx, okey, clientv3.WithRev(resp.Header.Revision+1)) {
					if len(wr.Events) > 0 && wr.Events[0].Type == mvccpb.DELETE {
						sessionExpired = true
						break
					}
				}
			} else {
				sessionExpired = true
			}
			// Another process takes the order over and finishes it.
			if !e.attempt(e.clients[3], order, 30*time.Second, etcdstore.WithWait()) {
				return fmt.Errorf("the takeover of %s failed", order)
			}
			// The worker wakes up and tries to finish its work.
			if err := w.cmd.Process.Signal(syscall.SIGCONT); err != nil {
				return err
			}
			io.WriteString(w.stdin, "go\n")
			if err := json.Unmarshal([]byte(w.expect(e.t, "report")), &report); err != nil {
				return err
			}
			workerFenced = report.Error != ""
			e.hist.add(100, opInput{order, "worker"}, call, opOutput{Kind: outUnknown})
			return nil
		},
		fired: func(e *env) error {
			switch {
			case !sessionExpired:
				return fmt.Errorf("the worker's session did not expire while it was paused")
			case e.totalTakeovers() == 0:
				return fmt.Errorf("nothing was taken over")
			case staleRefused(e) == 0:
				return fmt.Errorf("the sink refused no stale write")
			case !workerFenced:
				return fmt.Errorf("the paused worker finished as if nothing happened: %+v", report)
			}
			e.t.Logf("paused worker reported: %s", report.Error)
			return nil
		},
	})
}
