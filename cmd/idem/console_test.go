package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/testcerts"
	"github.com/idem-dev/idem/internal/tlsfiles"
	"github.com/idem-dev/idem/jobs"
)

// axeCore is where .ci/run installs axe-core (npm) for the accessibility
// audit.
const axeCore = "testdata/npm/node_modules/axe-core/axe.min.js"

// The console as a person uses it, in headless Chromium: a real idem
// serve (embedded etcd, a real upstream) with keys made through the
// proxy, a parked job and a schedule made through the library. The
// overview counts what was sent; retrying the parked job from its page
// makes it finish; evicting a key from its page makes the next request
// run anew; a POST without the console's token changes nothing; no page
// raises a JavaScript error or a serious accessibility violation; the
// pages are usable by keyboard and on a phone. Screenshots of every page
// are saved (IDEM_TEST_CONSOLE_SCREENSHOTS names the directory; docs/CONSOLE.md
// shows them).
func TestConsoleInABrowser(t *testing.T) {
	browser := chromiumPath(t)
	axe, err := os.ReadFile(axeCore)
	if err != nil {
		t.Fatalf("axe-core for the accessibility audit: %v (.ci/run installs it: npm install --prefix cmd/idem/testdata/npm axe-core@4.14.1)", err)
	}
	shots := os.Getenv("IDEM_TEST_CONSOLE_SCREENSHOTS")
	if shots == "" {
		shots = filepath.Join(os.TempDir(), "idem-console-screenshots")
	}
	if err := os.MkdirAll(shots, 0o755); err != nil {
		t.Fatal(err)
	}

	dir := tempDir(t)
	up := newShop(t)
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL, "--console")...)

	// Keys through the proxy: two claims, a replay, a mismatch, a conflict.
	for _, k := range []string{"order-1001", "order-1002"} {
		if r := send(t, "POST", idem.listen+"/charge", k, `{"amount":4200}`); r.status != 201 {
			t.Fatalf("claim %s: %d %s", k, r.status, r.body)
		}
	}
	if r := send(t, "POST", idem.listen+"/charge", "order-1001", `{"amount":4200}`); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %v", r.status, r.header)
	}
	if r := send(t, "POST", idem.listen+"/charge", "order-1001", `{"amount":9900}`); r.status != 422 {
		t.Fatalf("mismatch: %d", r.status)
	}
	up.mu.Lock()
	up.hold = make(chan struct{})
	up.mu.Unlock()
	held := make(chan reply, 1)
	go func() { held <- send(t, "POST", idem.listen+"/charge", "order-1003", `{"amount":100}`) }()
	<-up.entered
	if r := send(t, "POST", idem.listen+"/charge", "order-1003", `{"amount":100}`); r.status != 409 {
		t.Fatalf("conflict: %d", r.status)
	}
	up.mu.Lock()
	close(up.hold)
	up.hold = nil
	up.mu.Unlock()
	if r := <-held; r.status != 201 {
		t.Fatalf("held request: %d", r.status)
	}

	// A parked job and a schedule, through the library on the same etcd.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{etcdEndpoint(flags)}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	var broken atomic.Bool
	broken.Store(true)
	kind := jobs.Kind{Name: "invoice", MaxAttempts: 1, Steps: []jobs.Step{
		{Name: "compute", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) { return []byte(`{"total":4200}`), nil }},
		{Name: "charge", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			if broken.Load() {
				return nil, errors.New("card processor down")
			}
			return []byte(`{"charge":"ch_1"}`), nil
		}},
	}}
	w, err := jobs.NewWorker(q, []jobs.Kind{kind})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := q.Submit(ctx, "inv-7", "invoice", []byte(`{"customer":"acme"}`)); err != nil {
		t.Fatal(err)
	}
	if j, err := q.Wait(ctx, "inv-7"); err != nil || j.State != jobs.Parked {
		t.Fatalf("inv-7 = %+v, %v; want parked", j, err)
	}
	sched, err := jobs.NewScheduler(q, []jobs.Schedule{{Name: "nightly-report", Cron: "0 3 * * *", Kind: "report", Overlap: jobs.OverlapSkip}})
	if err != nil {
		t.Fatal(err)
	}
	defer sched.Close()
	waitForKey(ctx, t, cli, store.Prefix()+"j/s/jobs/nightly-report") // the scheduler's first tick writes its cursor

	// The browser.
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("disable-gpu", true), chromedp.WindowSize(1280, 900))
	actx, acancel := chromedp.NewExecAllocator(ctx, opts...)
	defer acancel()
	bctx, bcancel := chromedp.NewContext(actx)
	defer bcancel()
	var jsMu sync.Mutex
	var jsErrors []string
	if err := chromedp.Listen(bctx, func(ev any) {
		jsMu.Lock()
		defer jsMu.Unlock()
		switch ev := ev.(type) {
		case *runtime.EventExceptionThrown:
			jsErrors = append(jsErrors, fmt.Sprintf("exception: %s at %s:%d", ev.ExceptionDetails.Text, ev.ExceptionDetails.URL, ev.ExceptionDetails.LineNumber))
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError {
				jsErrors = append(jsErrors, "console.error")
			}
		case *cdplog.EventEntryAdded:
			if ev.Entry.Level == cdplog.EntryLevelError {
				jsErrors = append(jsErrors, fmt.Sprintf("%s: %s (%s)", ev.Entry.Source, ev.Entry.Text, ev.Entry.URL))
			}
		}
	}); err != nil {
		t.Fatalf("start chromium (%s): %v", browser, err)
	}
	do := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(bctx, actions...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	eval := func(what, expr string) any {
		t.Helper()
		v, err := chromedp.Run(bctx, chromedp.Evaluate[any](expr, chromedp.EvalAwaitPromise))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return v
	}
	if _, err := chromedp.Call(bctx, cdplog.Enable, cdp.Empty{}); err != nil {
		t.Fatalf("Log.enable: %v", err)
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("read %s: %v", sel, err)
		}
		return strings.TrimSpace(s)
	}
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(shots, name+".png"), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	audit := func(page string) {
		t.Helper()
		eval("inject axe-core", string(axe)+";true")
		out := eval("axe.run", `axe.run(document, {resultTypes: ["violations"]}).then(r => JSON.stringify(r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map(n => n.target.join(" "))}))))`)
		var violations []struct {
			ID, Impact, Help string
			Nodes            []string
		}
		if err := json.Unmarshal([]byte(out.(string)), &violations); err != nil {
			t.Fatalf("axe's answer: %v", err)
		}
		for _, v := range violations {
			t.Logf("axe on %s: %s (%s): %s %v", page, v.ID, v.Impact, v.Help, v.Nodes)
			if v.Impact == "serious" || v.Impact == "critical" {
				t.Errorf("axe on %s: %s violation %s: %s at %v", page, v.Impact, v.ID, v.Help, v.Nodes)
			}
		}
	}

	// Overview: the counts the edge's counters hold.
	do("overview", chromedp.Navigate(idem.admin+"/console/"), chromedp.WaitVisible(chromedp.CSS(`[data-outcome="claimed"]`)))
	for outcome, want := range map[string]string{"claimed": "3", "replayed": "1", "mismatch": "1", "conflict": "1", "takeover": "0", "unavailable": "0"} {
		if got := text(fmt.Sprintf(`[data-outcome=%q]`, outcome)); got != want {
			t.Errorf("overview: %s = %q, want %s", outcome, got, want)
		}
	}
	if got := text(`[data-stat="sessions"]`); got != "2" { // idem serve's and the test's store
		t.Errorf("overview: sessions alive = %q, want 2", got)
	}
	if body := text("main"); !strings.Contains(body, "Leader: idem") || !strings.Contains(body, "Alarms: none") {
		t.Errorf("overview lacks the etcd cluster:\n%s", body)
	}
	// The keyboard: the first Tab reaches the skip link, which moves the
	// focus to the main part.
	do("tab", chromedp.KeyEvent("\t"))
	if focused := eval("focus", `document.activeElement.textContent`); focused != "Skip to content" {
		t.Errorf("the first Tab focuses %q, want the skip link", focused)
	}
	do("skip", chromedp.KeyEvent("\r"))
	if focused := eval("focus", `document.activeElement.id`); focused != "main" {
		t.Errorf("the skip link moved the focus to %q, want main", focused)
	}
	// It refreshes by itself: a new claim shows without a reload.
	if r := send(t, "POST", idem.listen+"/charge", "order-1004", `{"amount":1}`); r.status != 201 {
		t.Fatalf("claim order-1004: %d", r.status)
	}
	if _, err := chromedp.Run(bctx, chromedp.Poll[bool](`document.querySelector('[data-outcome="claimed"]').textContent.trim() === "4"`, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Fatalf("the overview did not refresh by itself: %v", err)
	}
	shot("overview")
	audit("overview")

	// Keys: the list, a record, and evict with a confirmation.
	do("keys", chromedp.Navigate(idem.admin+"/console/keys?tenant=default"), chromedp.WaitVisible(chromedp.CSS(`tr[data-key="order-1001"]`)))
	shot("keys")
	audit("keys")
	do("open a key", chromedp.Click(chromedp.CSS(`tr[data-key="order-1001"] a`)), chromedp.WaitVisible(chromedp.CSS(`[data-field="status"]`)))
	if got := text(`[data-field="status"]`); got != "201" {
		t.Errorf("key page: status %q, want 201", got)
	}
	if body := text("main"); !strings.Contains(body, `"charge":"ch_1"`) || !strings.Contains(body, "Retention left") {
		t.Errorf("key page lacks the body preview or the retention:\n%s", body)
	}
	shot("key")
	audit("key")
	do("evict", chromedp.Click(chromedp.CSS(`a.danger`)), chromedp.WaitVisible(chromedp.CSS(`#confirm`)))
	shot("evict-confirm")
	audit("evict-confirm")
	callsBefore, _ := up.counts()
	do("confirm evict", chromedp.Click(chromedp.CSS(`#confirm`)), chromedp.WaitVisible(chromedp.CSS(`.flash`)))
	if got := text(".flash"); !strings.Contains(got, "evicted default/order-1001") {
		t.Errorf("after evict: %q", got)
	}
	if r := send(t, "POST", idem.listen+"/charge", "order-1001", `{"amount":9900}`); r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
		t.Errorf("the evicted key's next request = %d replayed=%q; want it claimed and run", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if calls, _ := up.counts(); calls != callsBefore+1 {
		t.Errorf("the evicted key's next request reached the upstream %d times, want once", calls-callsBefore)
	}
	if !idem.hasLog(`"msg":"console action","action":"key/evict","tenant":"default","key":"order-1001","who":"anonymous"`) {
		t.Errorf("the eviction is not logged with who did it:\n%s", idem.logs)
	}

	// A POST without the console's token changes nothing.
	resp, err := http.PostForm(idem.admin+"/console/key/evict", url.Values{"tenant": {"default"}, "key": {"order-1002"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("POST without a token: %d, want 403", resp.StatusCode)
	}
	req, _ := http.NewRequest("POST", idem.admin+"/console/key/evict", strings.NewReader(url.Values{"tenant": {"default"}, "key": {"order-1002"}, "csrf": {"0000"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "https://evil.example")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	} else if resp.Body.Close(); resp.StatusCode != http.StatusForbidden {
		t.Errorf("cross-site POST: %d, want 403", resp.StatusCode)
	}
	if rec, err := store.Admin.Get(ctx, etcdstore.Key{Tenant: "default", ID: "order-1002"}); err != nil || rec.State != etcdstore.Done {
		t.Errorf("order-1002 after refused POSTs: %+v, %v; want it done, untouched", rec, err)
	}

	// Jobs: the parked job, its page, retry; the schedule.
	do("jobs", chromedp.Navigate(idem.admin+"/console/jobs?state=parked"), chromedp.WaitVisible(chromedp.CSS(`tr[data-job="inv-7"]`)))
	if got := text(`tr[data-schedule="nightly-report"]`); !strings.Contains(got, "skip") || !strings.Contains(got, "0 3 * * *") {
		t.Errorf("schedule row: %q", got)
	}
	shot("jobs")
	audit("jobs")
	do("open the job", chromedp.Click(chromedp.CSS(`tr[data-job="inv-7"] a`)), chromedp.WaitVisible(chromedp.CSS(`#retry`)))
	if body := text("main"); !strings.Contains(body, "card processor down") || !strings.Contains(body, `{"total":4200}`) {
		t.Errorf("job page lacks the attempt's error or the step's output:\n%s", body)
	}
	shot("job")
	audit("job")
	broken.Store(false)
	do("retry", chromedp.Click(chromedp.CSS(`#retry`)), chromedp.WaitVisible(chromedp.CSS(`.flash`)))
	if j, err := q.Wait(ctx, "inv-7"); err != nil || j.State != jobs.Succeeded {
		t.Fatalf("inv-7 after the console's retry = %+v, %v; want succeeded", j, err)
	}

	// On a phone: nothing wider than the screen.
	do("phone", chromedp.EmulateViewport(390, 844, chromedp.EmulateMobile),
		chromedp.Navigate(idem.admin+"/console/"), chromedp.WaitVisible(chromedp.CSS(`[data-outcome="claimed"]`)))
	if overflow := eval("width", `document.documentElement.scrollWidth > window.innerWidth`); overflow != false {
		t.Errorf("the overview is wider than a phone's screen")
	}
	shot("overview-phone")
	do("phone job", chromedp.Navigate(idem.admin+"/console/job?id=inv-7"), chromedp.WaitVisible(chromedp.CSS(`[data-field="state"]`)))
	if got := text(`[data-field="state"]`); got != "succeeded" {
		t.Errorf("job page after retry: %q", got)
	}
	if overflow := eval("width", `document.documentElement.scrollWidth > window.innerWidth`); overflow != false {
		t.Errorf("the job page is wider than a phone's screen")
	}
	shot("job-phone")

	jsMu.Lock()
	defer jsMu.Unlock()
	if len(jsErrors) > 0 {
		t.Errorf("JavaScript errors:\n%s", strings.Join(jsErrors, "\n"))
	}
	t.Logf("screenshots in %s", shots)
}

// chromiumPath finds Debian's chromium (.ci/run installs it).
func chromiumPath(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("no chromium to drive the console with (.ci/run installs Debian's chromium)")
	return ""
}

// waitForKey waits on a Watch until key exists.
func waitForKey(ctx context.Context, t *testing.T, cli *clientv3.Client, key string) {
	t.Helper()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) > 0 {
		return
	}
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1)) {
		if len(wr.Events) > 0 {
			return
		}
	}
	t.Fatalf("%s never written: %v", key, ctx.Err())
}

// consoleClient is a person's browser without the browser: a cookie jar,
// the CSRF token read from a page's form, and POSTs with it.
type consoleClient struct {
	t    *testing.T
	base string
	c    *http.Client
}

func newConsoleClient(t *testing.T, base string, tr http.RoundTripper) *consoleClient {
	jar, _ := cookiejar.New(nil)
	return &consoleClient{t: t, base: base, c: &http.Client{Jar: jar, Timeout: 30 * time.Second, Transport: tr}}
}

func (k *consoleClient) get(path string) (int, string) {
	k.t.Helper()
	resp, err := k.c.Get(k.base + path)
	if err != nil {
		k.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// post fetches the confirmation page at confirm for its token, then posts
// form to action with it.
func (k *consoleClient) post(confirm, action string, form url.Values) (int, string) {
	k.t.Helper()
	status, page := k.get(confirm)
	m := csrfField.FindStringSubmatch(page)
	if status != 200 || m == nil {
		k.t.Fatalf("GET %s: %d, no token in\n%s", confirm, status, page)
	}
	form.Set("csrf", m[1])
	resp, err := k.c.PostForm(k.base+action, form)
	if err != nil {
		k.t.Fatalf("POST %s: %v", action, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// On a shard set the overview has every shard and says which answers; the
// keys page lists the set's keys; evict finds the key's shard.
func TestConsoleOnAShardSet(t *testing.T) {
	dir := tempDir(t)
	file, proxies := twoShards(t, "")
	up := newShop(t)
	idem := startIdem(t, filepath.Join(dir, "work"), "--shards-file", file, "--upstream", up.URL, "--request-timeout", "2s", "--console")
	for i := range 8 {
		if r := send(t, "POST", idem.listen+"/pay", fmt.Sprintf("order-%d", i), `{}`); r.status != 201 {
			t.Fatalf("order-%d: %d", i, r.status)
		}
	}
	k := newConsoleClient(t, idem.admin, nil)
	status, page := k.get("/console/")
	if status != 200 || !strings.Contains(page, "etcd shard a") || !strings.Contains(page, "etcd shard b") || strings.Count(page, `class="good">answers<`) != 2 {
		t.Fatalf("overview of a shard set: %d\n%s", status, page)
	}
	if status, page = k.get("/console/keys?tenant=default"); status != 200 || strings.Count(page, `<tr data-key="order-`) != 8 {
		t.Fatalf("keys of a shard set: %d, %d rows\n%s", status, strings.Count(page, `<tr data-key="order-`), page)
	}
	status, page = k.post("/console/key/evict?tenant=default&key=order-3", "/console/key/evict", url.Values{"tenant": {"default"}, "key": {"order-3"}})
	if status != 200 || !strings.Contains(page, "evicted default/order-3") {
		t.Fatalf("evict on a shard set: %d\n%s", status, page)
	}
	if out, err := runCmd(t, "get", "--shards-file", file, "order-3"); err == nil {
		t.Fatalf("order-3 still there after the console evicted it:\n%s", out)
	}
	// A shard that does not answer: the overview says so, within its bound,
	// and shows the other.
	proxies[1].Blackhole()
	status, page = k.get("/console/")
	if status != 200 || strings.Count(page, `class="good">answers<`) != 1 || !strings.Contains(page, "does not answer") {
		t.Fatalf("overview with shard b cut off: %d\n%s", status, page)
	}
}

// Behind admin TLS with client certificates, the console names the person
// by the certificate's subject, and logs their actions with it; a client
// without a certificate does not reach it.
func TestConsoleWhoIsTheClientCertificate(t *testing.T) {
	dir := tempDir(t)
	ca, err := testcerts.NewCA(dir, "operators")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ca.Issue("idem", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	alice, err := ca.Issue("alice", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	up := newShop(t)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL, "--console",
		"--admin-tls-cert-file", srv.CertFile, "--admin-tls-key-file", srv.KeyFile, "--admin-tls-client-ca-file", ca.CertFile)...)
	if r := send(t, "POST", idem.listen+"/pay", "order-1", `{}`); r.status != 201 {
		t.Fatalf("order-1: %d", r.status)
	}
	roots, err := tlsfiles.LoadCAs(ca.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.LoadX509KeyPair(alice.CertFile, alice.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	admin := strings.Replace(idem.admin, "http://", "https://", 1)
	noCert := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	if resp, err := noCert.Get(admin + "/console/"); err == nil {
		resp.Body.Close()
		t.Fatalf("the console answered %d to a client without a certificate", resp.StatusCode)
	}
	k := newConsoleClient(t, admin, &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}}})
	if status, page := k.get("/console/"); status != 200 || !strings.Contains(page, "signed in as <strong>alice</strong>") {
		t.Fatalf("overview over TLS: %d\n%s", status, page)
	}
	if status, page := k.post("/console/key/evict?key=order-1", "/console/key/evict", url.Values{"tenant": {"default"}, "key": {"order-1"}}); status != 200 {
		t.Fatalf("evict: %d\n%s", status, page)
	}
	if !idem.hasLog(`"msg":"console action","action":"key/evict","tenant":"default","key":"order-1","who":"alice"`) {
		t.Fatalf("the eviction is not logged as alice's:\n%s", idem.logs)
	}
}

// An eviction whose outcome is unknown (etcd stops answering while it is
// sent) is reported as one that may have happened, never as failed.
func TestConsoleActionOfUnknownOutcome(t *testing.T) {
	dir := tempDir(t)
	p := etcdBehindProxy(t, filepath.Join(dir, "etcd"))
	up := newShop(t)
	idem := startIdem(t, filepath.Join(dir, "work"), "--endpoints", p.URL(), "--upstream", up.URL, "--console", "--request-timeout", "1s")
	if r := send(t, "POST", idem.listen+"/pay", "order-1", `{}`); r.status != 201 {
		t.Fatalf("order-1: %d", r.status)
	}
	k := newConsoleClient(t, idem.admin, nil)
	status, page := k.get("/console/key/evict?key=order-1")
	m := csrfField.FindStringSubmatch(page)
	if status != 200 || m == nil {
		t.Fatalf("confirmation: %d\n%s", status, page)
	}
	p.Blackhole()
	resp, err := k.c.PostForm(idem.admin+"/console/key/evict", url.Values{"csrf": {m[1]}, "tenant": {"default"}, "key": {"order-1"}})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "may have happened") {
		t.Fatalf("evict while etcd does not answer: %d\n%s", resp.StatusCode, body)
	}
	if !idem.hasLog(`"msg":"console action outcome unknown","action":"key/evict"`) || strings.Contains(idem.logs.String(), `"msg":"console action refused"`) {
		t.Fatalf("the log does not say the outcome is unknown:\n%s", idem.logs)
	}
}
