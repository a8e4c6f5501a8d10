package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// sendAs sends a keyed POST as tenant (through the trusted tenant header).
func sendAs(t *testing.T, url, tenant, key, body string) reply {
	t.Helper()
	return send(t, "POST", url, key, body, "X-Tenant", tenant)
}

// One tenant over its limits gets 429 rate-limited, before any claim and
// without reaching the upstream; another tenant is not affected.
func TestTenantLimits(t *testing.T) {
	dir := tempDir(t)
	var calls atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		n := 100
		if r.URL.Path == "/big" {
			n = 8 << 10
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, strings.Repeat("x", n))
	}))
	t.Cleanup(up.Close)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL,
		"--tenant-header", "X-Tenant", "--trusted-proxies", "127.0.0.1/32",
		// One claim per 100 s after a burst of 3, and 1 byte/s after a
		// burst of 4 KiB: nothing refills during the test.
		"--tenant-claims-per-second", "0.01", "--tenant-claim-burst", "3",
		"--tenant-bytes-per-second", "1", "--tenant-bytes-burst", "4096")...)

	for i := 0; i < 3; i++ {
		if r := sendAs(t, idem.listen+"/pay", "acme", fmt.Sprintf("a-%d", i), `{}`); r.status != 201 {
			t.Fatalf("acme's claim %d = %d %q", i, r.status, r.body)
		}
	}
	before := calls.Load()
	r := sendAs(t, idem.listen+"/pay", "acme", "a-3", `{}`)
	if r.status != 429 || !strings.Contains(r.body, "rate-limited") || r.header.Get("Retry-After") == "" {
		t.Fatalf("acme's 4th claim = %d %q %v; want 429 rate-limited with Retry-After", r.status, r.body, r.header)
	}
	if calls.Load() != before {
		t.Fatal("a rate-limited request reached the upstream")
	}
	// Bytes: globex's 8 KiB outcome is saved (the work ran), and puts it
	// in debt: its next claim waits; acme's budget is its own.
	if r := sendAs(t, idem.listen+"/big", "globex", "g-1", `{}`); r.status != 201 || len(r.body) != 8<<10 {
		t.Fatalf("globex's big answer = %d, %d bytes", r.status, len(r.body))
	}
	if r := sendAs(t, idem.listen+"/big", "globex", "g-1", `{}`); r.status != 429 {
		t.Fatalf("globex in debt = %d %q; want 429", r.status, r.body)
	}
	if r := sendAs(t, idem.listen+"/pay", "initech", "i-1", `{}`); r.status != 201 {
		t.Fatalf("another tenant = %d %q; want it unaffected", r.status, r.body)
	}
	metrics := send(t, "GET", idem.admin+"/metrics", "", "").body
	if !strings.Contains(metrics, `idem_requests_total{outcome="rate_limited"} 2`) {
		t.Errorf("/metrics does not count the rate-limited requests:\n%s", metrics)
	}
	// A tenant header from a peer outside --trusted-proxies (127.0.0.2 is
	// loopback too, but not trusted) is refused on requests idem passes
	// through, too: the upstream may believe it.
	untrusted := &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{
		LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}).DialContext}, Timeout: 30 * time.Second}
	before = calls.Load()
	for _, method := range []string{"GET", "POST"} {
		req, _ := http.NewRequest(method, idem.listen+"/report", nil)
		req.Header.Set("X-Tenant", "acme")
		resp, err := untrusted.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 403 || !strings.Contains(string(body), "untrusted-tenant") {
			t.Fatalf("unkeyed %s with a tenant header from an untrusted peer = %d %q; want 403", method, resp.StatusCode, body)
		}
	}
	if calls.Load() != before {
		t.Fatal("a request with an untrusted tenant header reached the upstream")
	}
}

// The worker API refuses a checkpoint over --max-checkpoint-bytes (413),
// and a checkpoint the tenant's byte budget cannot pay for (429).
func TestAPICheckpointLimits(t *testing.T) {
	dir := tempDir(t)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")),
		"--max-checkpoint-bytes", "4000", "--tenant-bytes-per-second", "1", "--tenant-bytes-burst", "4096")...)
	r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"job","params":{}}`)
	var c struct{ Handle json.RawMessage }
	if r.status != 201 || json.Unmarshal([]byte(r.body), &c) != nil {
		t.Fatalf("claim = %d %q", r.status, r.body)
	}
	cp := func(n int) reply {
		return send(t, "POST", idem.listen+"/v1/checkpoint", "", fmt.Sprintf(`{"handle":%s,"checkpoint":%q}`, c.Handle,
			base64.StdEncoding.EncodeToString([]byte(strings.Repeat("s", n)))))
	}
	if r := cp(5000); r.status != 413 || !strings.Contains(r.body, "limit 4000") {
		t.Fatalf("a 5000-byte checkpoint = %d %q; want 413", r.status, r.body)
	}
	if r := cp(3000); r.status != 200 {
		t.Fatalf("a 3000-byte checkpoint = %d %q", r.status, r.body)
	}
	if r := cp(3000); r.status != 429 || !strings.Contains(r.body, "rate-limited") {
		t.Fatalf("a second 3000-byte checkpoint over the 4 KiB budget = %d %q; want 429", r.status, r.body)
	}
}

// etcd out of space (NOSPACE): new keys get 503 store-full, in-flight keys
// still 409, done keys are replayed; /readyz, /metrics and the log say so.
// The recovery OPERATIONS.md gives brings it back.
func TestServeWhenEtcdIsFull(t *testing.T) {
	dir := tempDir(t)
	up := newShop(t)
	flags := embeddedFlags(t, filepath.Join(dir, "data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL, "--quota-backend-bytes", fmt.Sprint(8<<20))...)
	if r := send(t, "POST", idem.listen+"/pay", "done-1", `{}`); r.status != 201 {
		t.Fatalf("before: %d", r.status)
	}
	up.mu.Lock()
	up.hold = make(chan struct{})
	up.mu.Unlock()
	held := make(chan reply, 1)
	go func() { held <- send(t, "POST", idem.listen+"/pay", "held-1", `{}`) }()
	<-up.entered

	ep := etcdEndpoint(flags)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	filler := strings.Repeat("x", 512<<10)
	for i := 0; ; i++ {
		if _, err := cli.Put(ctx, fmt.Sprintf("/filler/%d", i), filler); err != nil {
			if !strings.Contains(err.Error(), "database space exceeded") {
				t.Fatalf("filling etcd: %v", err)
			}
			break
		}
	}
	r := send(t, "POST", idem.listen+"/pay", "new-1", `{}`)
	if r.status != 503 || !strings.Contains(r.body, "store-full") || r.header.Get("Retry-After") == "" {
		t.Fatalf("new key when full = %d %q; want 503 store-full", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/pay", "held-1", `{}`); r.status != 409 {
		t.Fatalf("in-flight key when full = %d %q; want 409", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/pay", "done-1", `{}`); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("done key when full = %d %q; want the replay", r.status, r.body)
	}
	if r := send(t, "GET", idem.admin+"/readyz", "", ""); r.status != 503 || !strings.Contains(r.body, "NOSPACE") {
		t.Fatalf("/readyz when full = %d %q; want 503 naming NOSPACE", r.status, r.body)
	}
	if m := send(t, "GET", idem.admin+"/metrics", "", "").body; !strings.Contains(m, "idem_store_full 1") {
		t.Fatalf("/metrics lacks idem_store_full 1")
	}
	if !idem.hasLog("out of space") {
		t.Fatalf("nothing logged about the full store:\n%s", idem.logs)
	}

	// The recovery: delete, compact, defragment, disarm.
	if _, err := cli.Delete(ctx, "/filler/", clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	st, err := cli.Status(ctx, ep)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, st.Header.Revision, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Defragment(ctx, ep); err != nil {
		t.Fatal(err)
	}
	alarms, err := cli.AlarmList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range alarms.Alarms {
		if _, err := cli.AlarmDisarm(ctx, &clientv3.AlarmMember{MemberID: a.MemberID, Alarm: a.Alarm}); err != nil {
			t.Fatal(err)
		}
	}
	if r := send(t, "GET", idem.admin+"/readyz", "", ""); r.status != 200 {
		t.Fatalf("/readyz after the recovery = %d %q", r.status, r.body)
	}
	up.mu.Lock()
	close(up.hold)
	up.hold = nil
	up.mu.Unlock()
	if r := <-held; r.status != 201 {
		t.Fatalf("the held request = %d %q", r.status, r.body)
	}
	if r := send(t, "POST", idem.listen+"/pay", "new-1", `{}`); r.status != 201 {
		t.Fatalf("new key after the recovery = %d %q", r.status, r.body)
	}
}

// A flood of idle connections past the open-file limit: idem accepts no
// more than it can hold (the rest wait in the kernel's backlog), never
// runs out of descriptors, keeps its admin listener and its embedded etcd,
// and serves again once the flood is gone.
func TestConnectionFloodPastTheFileLimit(t *testing.T) {
	dir := tempDir(t)
	up := newShop(t)
	idem := startIdemUnder(t, dir, "ulimit -n 256", append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL)...)
	if !strings.Contains(idem.logs.String(), `"max_connections":64`) {
		t.Fatalf("with 256 files, want max_connections 64 in the start line:\n%s", idem.logs)
	}
	addr := strings.TrimPrefix(idem.listen, "http://")
	var flood []net.Conn
	defer func() {
		for _, c := range flood {
			c.Close()
		}
	}()
	for i := 0; i < 600; i++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			break // the backlog is full: the kernel drops the rest
		}
		flood = append(flood, c)
	}
	if len(flood) < 300 {
		t.Fatalf("only %d connections of the flood were made", len(flood))
	}
	if r := send(t, "GET", idem.admin+"/livez", "", ""); r.status != 200 {
		t.Fatalf("/livez during the flood = %d", r.status)
	}
	if r := send(t, "GET", idem.admin+"/readyz", "", ""); r.status != 200 {
		t.Fatalf("/readyz during the flood = %d %q (the embedded etcd must still answer)", r.status, r.body)
	}
	for _, c := range flood {
		c.Close()
	}
	flood = nil
	if r := send(t, "POST", idem.listen+"/pay", "after-flood", `{}`); r.status != 201 {
		t.Fatalf("after the flood = %d %q", r.status, r.body)
	}
	if strings.Contains(idem.logs.String(), "too many open files") {
		t.Fatalf("idem ran out of file descriptors:\n%s", idem.logs)
	}
	if err := idem.terminate(); err != nil {
		t.Fatalf("exit: %v\n%s", err, idem.logs)
	}
}
