package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// The sidecar on its embedded etcd, over real sockets: replay, mismatch,
// conflict, bad key, body limit, pass-through, concurrent duplicates, the
// admin endpoints and the admin commands.
func TestServeProxy(t *testing.T) {
	dir := tempDir(t)
	up := newShop(t)
	flags := embeddedFlags(t, filepath.Join(dir, "data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL, "--max-request-body", "1000", "--require-key", "/pay")...)

	first := send(t, "POST", idem.listen+"/pay", "order-1", `{"amount":100}`)
	if first.status != 201 || first.header.Get("Idempotency-Retention") != "86400" {
		t.Fatalf("first = %d %v %q", first.status, first.header, first.body)
	}
	replay := send(t, "POST", idem.listen+"/pay", "order-1", `{"amount": 100}`)
	if replay.status != 201 || replay.body != first.body || replay.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay = %d %q %v; want the first answer, replayed", replay.status, replay.body, replay.header)
	}
	if r := send(t, "POST", idem.listen+"/pay", "order-1", `{"amount":999}`); r.status != 422 || r.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("other params = %d %q; want 422 problem+json", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/pay", "", `{}`); r.status != 400 || !strings.Contains(r.body, "missing-key") {
		t.Fatalf("no key on /pay = %d %q; want 400 missing-key", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/pay", "bad key", `{}`); r.status != 400 {
		t.Fatalf("bad key = %d; want 400", r.status)
	}
	if r := send(t, "POST", idem.listen+"/pay", "big", strings.Repeat("x", 2000)); r.status != 413 {
		t.Fatalf("big body = %d; want 413", r.status)
	}
	if r := send(t, "POST", idem.listen+"/other", "", `{}`); r.status != 201 {
		t.Fatalf("pass-through = %d; want 201", r.status)
	}
	// In flight: 409 with Retry-After.
	up.mu.Lock()
	up.hold = make(chan struct{})
	up.mu.Unlock()
	slow := make(chan reply, 1)
	go func() { slow <- send(t, "POST", idem.listen+"/pay", "order-2", `{}`) }()
	<-up.entered
	if r := send(t, "POST", idem.listen+"/pay", "order-2", `{}`); r.status != 409 || r.header.Get("Retry-After") == "" {
		t.Fatalf("in flight = %d %v; want 409 with Retry-After", r.status, r.header)
	}
	up.mu.Lock()
	close(up.hold)
	up.hold = nil
	up.mu.Unlock()
	if r := <-slow; r.status != 201 {
		t.Fatalf("slow = %d", r.status)
	}
	// Concurrent duplicates: one upstream call.
	callsBefore, _ := up.counts()
	var wg sync.WaitGroup
	replies := make([]reply, 16)
	for i := range replies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			replies[i] = send(t, "POST", idem.listen+"/pay", "order-3", `{"n":3}`, "Prefer", "wait=30")
		}()
	}
	wg.Wait()
	if calls, _ := up.counts(); calls != callsBefore+1 {
		t.Fatalf("16 concurrent duplicates made %d upstream calls; want 1", calls-callsBefore)
	}
	for _, r := range replies {
		if r.body != replies[0].body {
			t.Fatalf("duplicates got different answers: %q vs %q", r.body, replies[0].body)
		}
	}

	// Admin endpoints.
	for path, want := range map[string]int{"/livez": 200, "/readyz": 200, "/debug/pprof/": 404} {
		if r := send(t, "GET", idem.admin+path, "", ""); r.status != want {
			t.Fatalf("GET %s = %d; want %d", path, r.status, want)
		}
	}
	metrics := send(t, "GET", idem.admin+"/metrics", "", "").body
	for _, want := range []string{`idem_requests_total{outcome="replayed"}`, `idem_requests_total{outcome="claimed"}`,
		`idem_requests_total{outcome="mismatch"}`, `idem_requests_total{outcome="conflict"}`, `idem_session_live 1`, `idem_request_duration_seconds_bucket`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(metrics, "order-1") {
		t.Error("/metrics contains a key")
	}
	for _, line := range strings.Split(idem.logs.String(), "\n") {
		if strings.Contains(line, "order-1") || strings.Contains(line, `amount`) {
			t.Errorf("the log contains a key in clear or a body: %s", line)
		}
	}

	// Admin commands against the embedded etcd.
	ep := etcdEndpoint(flags)
	out, err := runCmd(t, "get", "--endpoints", ep, "order-1")
	if err != nil || !strings.Contains(out, "default/order-1 state=done") || !strings.Contains(out, "status=201") {
		t.Fatalf("idem get = %q, %v", out, err)
	}
	out, err = runCmd(t, "get", "--endpoints", ep, "-w", "json", "order-1")
	var got map[string]any
	if err != nil || json.Unmarshal([]byte(out), &got) != nil || got["state"] != "done" || got["tenant"] != "default" {
		t.Fatalf("idem get -w json = %q, %v", out, err)
	}
	out, err = runCmd(t, "ls", "--endpoints", ep, "-w", "table", "--state", "done")
	if err != nil || !strings.HasPrefix(out, "TENANT") || strings.Count(out, "\n") != 1+3 {
		t.Fatalf("idem ls -w table = %q, %v; want a header and 3 done keys", out, err)
	}
	out, err = runCmd(t, "status", "--endpoints", ep)
	if err != nil || !strings.Contains(out, "leader=true") || !strings.Contains(out, "keys=3 in_flight=0 done=3") || !strings.Contains(out, "sessions=1") {
		t.Fatalf("idem status = %q, %v", out, err)
	}
	if out, err := runCmd(t, "evict", "--endpoints", ep, "order-1"); err != nil || !strings.Contains(out, "evicted") {
		t.Fatalf("idem evict = %q, %v", out, err)
	}
	if _, err := runCmd(t, "get", "--endpoints", ep, "order-1"); err == nil {
		t.Fatal("idem get after evict succeeded")
	}
	// After an evict, the key runs again.
	if r := send(t, "POST", idem.listen+"/pay", "order-1", `{"amount":1}`); r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("after evict = %d replayed=%q; want a new run", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if err := idem.terminate(); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, idem.logs)
	}
}

// idem is killed after the upstream took effect but before the response was
// saved, and restarted on the same data. Issue 38: the takeover forwarded
// the retry again, so an upstream that does not honour the key charged
// twice, and the client got the second charge as the only one. Under the
// default policy (--on-unknown-outcome save) the takeover answers that the
// outcome is unknown, saves that, and never forwards; with release, it
// forwards again with a greater fencing token, as documented.
func TestKilledAfterUpstreamCallNoDoubleEffect(t *testing.T) {
	for _, policy := range []string{"save", "release"} {
		t.Run(policy, func(t *testing.T) {
			dir := tempDir(t)
			up := newShop(t)
			up.hold = make(chan struct{})
			flags := append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL, "--session-ttl", "2s", "--on-unknown-outcome", policy)
			idem := startIdem(t, dir, flags...)
			go func() { // its answer never comes: idem dies first
				req, _ := http.NewRequest("POST", idem.listen+"/pay", strings.NewReader(`{"amount":5}`))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Idempotency-Key", "order-9")
				if resp, err := http.DefaultClient.Do(req); err == nil {
					resp.Body.Close()
				}
			}()
			<-up.entered // the charge happened
			idem.kill()
			up.mu.Lock()
			close(up.hold)
			up.hold = nil
			up.mu.Unlock()

			idem = startIdem(t, dir, flags...)
			// The dead process's claim stands until its session lease
			// expires; the retry waits for that on a Watch and then takes
			// the key over.
			r := send(t, "POST", idem.listen+"/pay", "order-9", `{"amount":5}`, "Prefer", "wait=30")
			calls, effects := up.counts()
			if policy == "save" {
				if r.status != http.StatusBadGateway || !strings.Contains(r.body, "upstream-outcome-unknown") || calls != 1 {
					t.Fatalf("retry after the crash = %d %q, %d upstream calls; want 502 upstream-outcome-unknown and the one call", r.status, r.body, calls)
				}
				again := send(t, "POST", idem.listen+"/pay", "order-9", `{"amount":5}`)
				if again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
					t.Fatalf("later retry = %d %q; want the saved unknown outcome replayed", again.status, again.body)
				}
				if calls, _ := up.counts(); calls != 1 {
					t.Fatalf("upstream calls %d; want 1", calls)
				}
				return
			}
			if r.status != 201 || !strings.Contains(r.body, `"charge":"ch_1"`) {
				t.Fatalf("retry after the crash = %d %q; want the first charge's answer", r.status, r.body)
			}
			if calls != 2 || effects != 1 {
				t.Fatalf("upstream calls %d, effects %d; want 2 calls (re-forwarded) and 1 effect", calls, effects)
			}
			if up.fences[1] <= up.fences[0] {
				t.Fatalf("fencing tokens %v: the takeover's is not greater", up.fences)
			}
			if again := send(t, "POST", idem.listen+"/pay", "order-9", `{"amount":5}`); again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("later retry = %q; want the replay", again.body)
			}
		})
	}
}

// SIGTERM: readiness drops, the in-flight request finishes and is saved,
// the process exits cleanly, and after a restart the retry is a replay.
func TestGracefulShutdown(t *testing.T) {
	dir := tempDir(t)
	up := newShop(t)
	up.hold = make(chan struct{})
	flags := append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL, "--shutdown-grace", "30s")
	idem := startIdem(t, dir, flags...)
	inflight := make(chan reply, 1)
	go func() { inflight <- send(t, "POST", idem.listen+"/pay", "order-7", `{}`) }()
	<-up.entered
	idem.cmd.Process.Signal(os.Interrupt)
	// Readiness drops while the request drains.
	deadline := time.Now().Add(30 * time.Second)
	for send(t, "GET", idem.admin+"/readyz", "", "").status != http.StatusServiceUnavailable {
		if time.Now().After(deadline) {
			t.Fatal("/readyz still ready during shutdown")
		}
		time.Sleep(20 * time.Millisecond) // polling an external process's state
	}
	up.mu.Lock()
	close(up.hold)
	up.hold = nil
	up.mu.Unlock()
	first := <-inflight
	if first.status != 201 {
		t.Fatalf("in-flight request during shutdown = %d %q", first.status, first.body)
	}
	if err := <-idem.exited; err != nil {
		t.Fatalf("exit: %v\n%s", err, idem.logs)
	}
	if !strings.Contains(idem.logs.String(), "embedded etcd stopped") {
		t.Fatalf("embedded etcd was not stopped cleanly:\n%s", idem.logs)
	}
	idem = startIdem(t, dir, flags...)
	if r := send(t, "POST", idem.listen+"/pay", "order-7", `{}`); r.body != first.body || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after restart = %q; want the saved answer", r.body)
	}
	if calls, _ := up.counts(); calls != 1 {
		t.Fatalf("upstream calls = %d; want 1", calls)
	}
}

// With a short retention, etcd prunes the key and the same key is a new
// operation.
func TestServeRetentionExpiry(t *testing.T) {
	dir := tempDir(t)
	up := newShop(t)
	flags := append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL, "--retention", "2s", "--bucket-width", "1s")
	idem := startIdem(t, dir, flags...)
	first := send(t, "POST", idem.listen+"/pay", "order-r", `{}`)
	if first.status != 201 || first.header.Get("Idempotency-Retention") != "2" {
		t.Fatalf("first = %d %v", first.status, first.header)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{etcdEndpoint(flags)}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	key := "/idem/k/default/order-r"
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("record: %v %v", resp, err)
	}
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(resp.Kvs[0].ModRevision+1)) {
		if len(wr.Events) > 0 && wr.Events[0].Type == mvccpb.DELETE {
			break
		}
	}
	if ctx.Err() != nil {
		t.Fatal("the record was not pruned")
	}
	second := send(t, "POST", idem.listen+"/pay", "order-r", `{}`)
	if second.header.Get("Idempotent-Replayed") != "" {
		t.Fatal("a pruned key was replayed")
	}
	if calls, _ := up.counts(); calls != 2 {
		t.Fatalf("upstream calls = %d; want 2", calls)
	}
}

// The JSON worker API through the binary.
func TestServeAPI(t *testing.T) {
	dir := tempDir(t)
	idem := startIdem(t, dir, embeddedFlags(t, filepath.Join(dir, "data"))...)
	r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"job-1","params":{"n":1}}`)
	var claimed struct {
		State  string
		Handle map[string]any
	}
	if r.status != 201 || json.Unmarshal([]byte(r.body), &claimed) != nil || claimed.State != "claimed" {
		t.Fatalf("claim = %d %q", r.status, r.body)
	}
	h, _ := json.Marshal(claimed.Handle)
	if r := send(t, "POST", idem.listen+"/v1/complete", "", `{"handle":`+string(h)+`,"outcome":{"body":"b2s="}}`); r.status != 200 {
		t.Fatalf("complete = %d %q", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"job-1","params":{"n":1}}`); r.status != 200 || !strings.Contains(r.body, `"body":"b2s="`) {
		t.Fatalf("claim of a done key = %d %q", r.status, r.body)
	}
}

// idem against an etcd it did not start: Debian's etcd-server 3.4.
func TestServeExternalEtcd(t *testing.T) {
	etcdBin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("no etcd binary on PATH: install Debian's etcd-server (.ci/run does) to test against an external etcd")
	}
	dir := tempDir(t)
	ep := startExternalEtcd(t, etcdBin, filepath.Join(dir, "etcd"))
	up := newShop(t)
	idem := startIdem(t, filepath.Join(dir, "work"), "--endpoints", ep, "--upstream", up.URL, "--cache-size", "1048576")
	if _, err := os.Stat(filepath.Join(dir, "work", "idem-data")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("idem made an embedded etcd data dir while given --endpoints (%v)", err)
	}
	first := send(t, "POST", idem.listen+"/pay", "ext-1", `{"a":1}`)
	again := send(t, "POST", idem.listen+"/pay", "ext-1", `{"a":1}`)
	if first.status != 201 || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("against etcd 3.4: %d %q then %q", first.status, first.body, again.body)
	}
	if r := send(t, "POST", idem.listen+"/pay", "ext-1", `{"a":2}`); r.status != 422 {
		t.Fatalf("mismatch against etcd 3.4 = %d", r.status)
	}
	// etcd 3.4 answers the cache's progress requests: it proves itself
	// current, and replays come from memory.
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(send(t, "GET", idem.admin+"/metrics", "", "").body, "idem_cache_hits_total 1") {
		if time.Now().After(deadline) {
			t.Fatalf("no replay from the cache against etcd 3.4:\n%s", send(t, "GET", idem.admin+"/metrics", "", "").body)
		}
		send(t, "POST", idem.listen+"/pay", "ext-1", `{"a":1}`)
		time.Sleep(50 * time.Millisecond) // polling a condition
	}
	out, err := runCmd(t, "status", "--endpoints", ep)
	if err != nil || !strings.Contains(out, "version=3.4") || !strings.Contains(out, "keys=1") {
		t.Fatalf("idem status against etcd 3.4 = %q, %v", out, err)
	}
	// Group commit works on etcd 3.4: 64 concurrent new keys go in batches
	// (Txns of Txns), each its own outcome.
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r := send(t, "POST", idem.listen+"/pay", fmt.Sprintf("burst-%d", i), `{"a":1}`); r.status != 201 {
				t.Errorf("burst-%d against etcd 3.4: %d %s", i, r.status, r.body)
			}
		}()
	}
	wg.Wait()
	metrics := send(t, "GET", idem.admin+"/metrics", "", "").body
	if batches, writes := metricValue(metrics, "idem_etcd_batches_total"), metricValue(metrics, "idem_etcd_batched_writes_total"); writes <= batches {
		t.Fatalf("against etcd 3.4: %v writes in %v batches: nothing was batched", writes, batches)
	}
	if _, effects := up.counts(); effects != 65 {
		t.Fatalf("the upstream charged %d times for 65 keys", effects)
	}
	if err := idem.terminate(); err != nil {
		t.Fatalf("exit: %v", err)
	}
}

// startExternalEtcd runs an etcd binary on free loopback ports and returns
// its client endpoint; the process is killed when the test ends.
func startExternalEtcd(t *testing.T, bin, dataDir string) string {
	t.Helper()
	client, peer := freeURLs(t)
	cmd := exec.Command(bin, "--name", "ext", "--data-dir", dataDir,
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "ext="+peer, "--experimental-enable-lease-checkpoint",
		"--logger", "zap", "--log-outputs", "stderr") // 3.4's default logger panics on config warnings
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{client}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	go func() {
		select {
		case <-exited:
			cancel() // it died: stop waiting for it
		case <-ctx.Done():
		}
	}()
	// Status blocks until the member serves (the client retries).
	if _, err := cli.Status(ctx, client); err != nil {
		t.Fatalf("external etcd did not start: %v\n%s", err, logs)
	}
	return client
}

// etcd is cut off mid-run (its connections stay open and carry nothing, as
// in a partition): a keyed request is refused with 503 within about the
// request timeout, without reaching the upstream, and keyless traffic
// keeps flowing.
func TestEtcdCutOffRefusesKeyedRequests(t *testing.T) {
	dir := tempDir(t)
	proxy := etcdBehindProxy(t, filepath.Join(dir, "etcd"))
	up := newShop(t)
	idem := startIdem(t, filepath.Join(dir, "work"), "--endpoints", proxy.URL(), "--upstream", up.URL, "--request-timeout", "2s")
	if r := send(t, "POST", idem.listen+"/pay", "before", `{}`); r.status != 201 {
		t.Fatalf("before the cut: %d %q", r.status, r.body)
	}
	proxy.Blackhole()
	calls, _ := up.counts()
	start := time.Now()
	r := send(t, "POST", idem.listen+"/pay", "during", `{}`)
	took := time.Since(start)
	if r.status != http.StatusServiceUnavailable || !strings.Contains(r.body, "unavailable") {
		t.Fatalf("keyed request while etcd is cut off = %d %q; want 503 unavailable", r.status, r.body)
	}
	if now, _ := up.counts(); now != calls {
		t.Fatalf("the upstream was called (%d -> %d) for a request idem could not claim", calls, now)
	}
	if r := send(t, "GET", idem.listen+"/pay", "", ""); r.status != 201 {
		t.Fatalf("keyless request while etcd is cut off = %d %q; want it passed through", r.status, r.body)
	}
	t.Logf("keyed request refused after %v (--request-timeout 2s)", took.Round(time.Millisecond))
}

// metricValue returns the value of an unlabelled metric in a Prometheus text
// exposition, or -1.
func metricValue(text, name string) float64 {
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}
