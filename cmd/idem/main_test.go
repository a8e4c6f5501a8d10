package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
)

// TestMain doubles as the idem binary: a test that needs a real process
// (to kill it, or to send it SIGTERM) re-executes the test binary with
// IDEM_TEST_RUN_MAIN=1, and main runs instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv("IDEM_TEST_RUN_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// idemProc is an idem serve process.
type idemProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	listen string // the edge's base URL
	admin  string // the admin server's base URL
	logs   *syncBuffer
	exited chan error
}

type syncBuffer struct {
	mu      sync.Mutex
	b       bytes.Buffer
	written chan struct{} // closed (and replaced) by every Write
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.written != nil {
		close(s.written)
		s.written = nil
	}
	return s.b.Write(p)
}

// waitFor returns once the buffer holds sub, and false if it still does not
// after timeout. A process's log line reaches the buffer through the pipe
// reader after the process has answered the request that logged it, so a
// test that looks for it right after the answer must wait for the line.
func (s *syncBuffer) waitFor(sub string, timeout time.Duration) bool {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		s.mu.Lock()
		if strings.Contains(s.b.String(), sub) {
			s.mu.Unlock()
			return true
		}
		if s.written == nil {
			s.written = make(chan struct{})
		}
		written := s.written
		s.mu.Unlock()
		select {
		case <-written:
		case <-deadline.C:
			return false
		}
	}
}

// hasLog waits (up to 30s) for a log line holding sub.
func (p *idemProc) hasLog(sub string) bool { return p.logs.waitFor(sub, 30*time.Second) }

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startIdem starts "idem serve args..." in dir and waits until it listens.
func startIdem(t *testing.T, dir string, args ...string) *idemProc {
	t.Helper()
	return startIdemUnder(t, dir, "", args...)
}

// startIdemUnder is startIdem with the shell commands of prelude run first
// (ulimit -n 256, say), in the shell that then becomes idem.
func startIdemUnder(t *testing.T, dir, prelude string, args ...string) *idemProc {
	t.Helper()
	args = append([]string{"serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-format", "json"}, args...)
	cmd := exec.Command(os.Args[0], args...)
	if prelude != "" {
		cmd = exec.Command("/bin/sh", append([]string{"-c", prelude + ` && exec "$0" "$@"`, os.Args[0]}, args...)...)
	}
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "IDEM_TEST_RUN_MAIN=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &idemProc{t: t, cmd: cmd, logs: &syncBuffer{}, exited: make(chan error, 1)}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-p.exited
		}
	})
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.logs.Write([]byte(line + "\n"))
			var m map[string]any
			if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == "idem listening" {
				p.listen, p.admin = "http://"+m["listen"].(string), "http://"+m["admin"].(string)
				close(ready)
			}
		}
		p.exited <- cmd.Wait()
	}()
	select {
	case <-ready:
		return p
	case err := <-p.exited:
		p.exited <- err
		t.Fatalf("idem exited before listening: %v\n%s", err, p.logs.String())
	case <-time.After(90 * time.Second):
		t.Fatalf("idem did not listen within 90s:\n%s", p.logs)
	}
	return nil
}

// kill ends the process at once, as a crash would.
func (p *idemProc) kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
}

// terminate sends SIGTERM and returns the exit error after a clean stop.
func (p *idemProc) terminate() error {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		return err
	case <-time.After(60 * time.Second):
		p.t.Fatalf("idem did not stop within 60s of SIGTERM:\n%s", p.logs)
		return nil
	}
}

// embeddedFlags returns flags for an embedded etcd in dataDir that needs no
// TCP port (a port picked free may be taken by another test package before
// etcd binds it): its client socket is the default, DATA-DIR/etcd.sock, and
// its peer socket one of its own in the process's directory.
func embeddedFlags(t *testing.T, dataDir string) []string {
	return []string{
		"--data-dir", dataDir,
		"--embedded-peer-url", fmt.Sprintf("unix://peer-%d.sock", peerSeq.Add(1)),
	}
}

var peerSeq atomic.Int64

// freeURLs returns a client and a peer URL on free loopback ports, for an
// etcd binary.
func freeURLs(t *testing.T) (client, peer string) {
	ports, err := etcdtest.FreePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", ports[0]), fmt.Sprintf("http://127.0.0.1:%d", ports[1])
}

// shop is a test upstream that charges once per request, and honours the
// Idempotency-Key it is forwarded: a key it has seen gets its first answer
// back, so a re-forwarded request has no second effect.
type shop struct {
	*httptest.Server
	mu      sync.Mutex
	calls   int
	effects int
	byKey   map[string]string
	fences  []fencing.Token
	hold    chan struct{} // when not nil, requests block on it after their effect
	entered chan struct{} // a held request has had its effect
}

func newShop(t *testing.T) *shop {
	s := &shop{byKey: map[string]string{}, entered: make(chan struct{}, 100)}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		tok, _, _ := fencing.FromHeader(r.Header)
		s.mu.Lock()
		s.calls++
		s.fences = append(s.fences, tok)
		resp, seen := s.byKey[key]
		if !seen || key == "" {
			s.effects++
			resp = fmt.Sprintf(`{"charge":"ch_%d","body":%q}`, s.effects, body)
			if key != "" {
				s.byKey[key] = resp
			}
		}
		hold := s.hold
		s.mu.Unlock()
		if hold != nil {
			s.entered <- struct{}{} // the effect happened; the answer is held
			select {
			case <-hold:
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, resp)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *shop) counts() (calls, effects int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls, s.effects
}

type reply struct {
	status int
	header http.Header
	body   string
}

func send(t *testing.T, method, url, key, body string, hdr ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, string(b)}
}

// runCmd runs an idem subcommand in-process and returns its output.
func runCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := run(ctx, args, &out, &errOut)
	if err != nil {
		return out.String() + errOut.String(), err
	}
	return out.String(), nil
}

func etcdEndpoint(flags []string) string {
	for i, f := range flags {
		if f == "--data-dir" {
			dir, err := filepath.Abs(flags[i+1])
			if err != nil {
				panic(err)
			}
			return "unix://" + filepath.Join(dir, "etcd.sock")
		}
	}
	return ""
}

func tempDir(t *testing.T) string {
	d := t.TempDir()
	if err := os.MkdirAll(filepath.Join(d, "work"), 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// etcdBehindProxy starts a one-member etcd in dir and returns a proxy in
// front of its client port, to cut idem off from it.
func etcdBehindProxy(t *testing.T, dir string) *etcdtest.Proxy {
	t.Helper()
	c, err := etcdtest.New(dir, 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	proxy, err := etcdtest.NewProxy(strings.TrimPrefix(c.Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	return proxy
}
