package main

import (
	"context"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	cdppage "github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/idem-dev/idem/etcdtest"
)

// Second review of the console (idem serve --console). Each test fails on
// the code as it is because of the defect its name and message say.

// review2InProcess runs idem serve --console in this process (its edge in
// API mode) on a real one-member etcd, and returns the server and its
// admin listener's base URL. It is for the tests that need to reach into
// the process: to advance the console's sampler, or a counter, as hours of
// traffic would.
func review2InProcess(t *testing.T, args ...string) (*server, string) {
	t.Helper()
	dir := tempDir(t)
	cl, err := etcdtest.New(filepath.Join(dir, "etcd"), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	var c serveConfig
	fs := c.flags(io.Discard)
	all := append([]string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--console", "--endpoints", cl.Endpoints()[0]}, args...)
	if err := parseFlags(fs, all); err != nil {
		t.Fatal(err)
	}
	if err := c.validate(); err != nil {
		t.Fatal(err)
	}
	if err := c.load(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := newServer(ctx, &c, slog.New(slog.DiscardHandler))
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-errc })
	return s, "http://" + s.adminLn.Addr().String()
}

// review2Get fetches url and returns its status and body.
func review2Get(t *testing.T, u string) (int, string) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

var review2Count = regexp.MustCompile(`<span data-outcome="([a-z_]+)">([^<]*)</span>`)

// review2Counts reads the overview's counts by outcome.
func review2Counts(body string) map[string]string {
	out := map[string]string{}
	for _, m := range review2Count.FindAllStringSubmatch(body, -1) {
		out[m[1]] = m[2]
	}
	return out
}

// CONSOLE.md: the overview charts "unavailable answers (503, store full
// included)". While idem has not reached etcd (it starts anyway and
// connects in the background), every keyed request is answered 503
// "unavailable" by the waiting edge, which counts nothing: the person on
// call, looking at the console during the outage, is told no request got a
// 503.
func TestConsoleReview2UnavailableBeforeEtcdIsNotCounted(t *testing.T) {
	dir := tempDir(t)
	proxy := etcdBehindProxy(t, filepath.Join(dir, "etcd"))
	proxy.Blackhole()
	up := newShop(t)
	idem := startIdem(t, filepath.Join(dir, "work"), "--endpoints", proxy.URL(), "--upstream", up.URL, "--dial-timeout", "1s", "--console")
	for i := range 3 {
		if r := send(t, "POST", idem.listen+"/pay", fmt.Sprintf("k-%d", i), `{}`); r.status != 503 {
			t.Fatalf("keyed request before etcd: %d %s; want 503", r.status, r.body)
		}
	}
	status, body := review2Get(t, idem.admin+"/console/")
	if status != 200 {
		t.Fatalf("overview before etcd: %d\n%s", status, body)
	}
	if got := review2Counts(body)["unavailable"]; got != "3" {
		t.Errorf("DEFECT: 3 keyed requests were answered 503 (idem has not reached etcd), but the overview's Unavailable (503) count is %q: the waiting edge's 503s are not counted (idem_requests_total neither)", got)
	}
}

// The counts are float64 written with %v and %g: past a million requests
// the overview says "1e+06 in all", "1.234567e+06", and so do the charts'
// text alternatives (aria-label). A busy edge passes a million replays in
// hours; the counter is advanced here as those requests would advance it.
func TestConsoleReview2CountsPastAMillion(t *testing.T) {
	s, admin := review2InProcess(t)
	s.metrics.Requests.WithLabelValues("replayed").Add(1_234_567)
	s.metrics.Requests.WithLabelValues("claimed").Add(1_000_000)
	_, body := review2Get(t, admin+"/console/")
	body = html.UnescapeString(body)
	counts := review2Counts(body)
	if counts["replayed"] != "1234567" || counts["claimed"] != "1000000" {
		t.Errorf("DEFECT: after 1,234,567 replays and 1,000,000 claims the overview shows replays %q and claims %q (float64 through %%v: scientific notation)", counts["replayed"], counts["claimed"])
	}
	if m := regexp.MustCompile(`aria-label="(Replays[^"]*)"`).FindStringSubmatch(body); m == nil || strings.Contains(m[1], "e+06") {
		t.Errorf("DEFECT: the Replays chart's text alternative reads %q", m[1])
	}
}

// The overview says "Counted by this process since T", T the oldest of
// the sampler's 121 samples: once the process has run ten minutes, T moves
// with the window, while the count next to it is since the process
// started (the counter). The sampler is advanced here as ten minutes
// would advance it (121 ticks).
func TestConsoleReview2CountedSinceMovesWithTheWindow(t *testing.T) {
	started := time.Now()
	s, admin := review2InProcess(t)
	s.metrics.Requests.WithLabelValues("claimed").Add(5) // before the window below
	added := time.Now()
	// The page writes whole seconds: let the clock pass the next one, so
	// that a sample taken from now on is seen to be after the start.
	time.Sleep(time.Until(started.Truncate(time.Second).Add(time.Second)))
	for range consoleSamples + 1 {
		s.console.sample()
	}
	_, body := review2Get(t, admin+"/console/")
	m := regexp.MustCompile(`Counted by this process since ([^;]+);`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no 'Counted by this process since' on the overview:\n%s", body)
	}
	since, err := time.Parse(time.RFC3339, m[1])
	if err != nil {
		t.Fatal(err)
	}
	if review2Counts(body)["claimed"] == "5" && since.After(added) {
		t.Errorf("DEFECT: the overview counts 5 claims 'since %s', but they were made before that, at %s: 'since' is the oldest sample of the ten-minute window, not the process's start", m[1], added.UTC().Format(time.RFC3339))
	}
}

// The body preview is cut at 4096 bytes, wherever that falls: inside a
// UTF-8 character, the cut makes the text invalid UTF-8, and printable
// then shows the whole preview as a Go-quoted string ("{\n  \"name\"...),
// no longer the JSON the upstream sent.
func TestConsoleReview2PreviewOfAUTF8Body(t *testing.T) {
	dir := tempDir(t)
	// 4095 bytes, then "é" (2 bytes) across the 4096-byte cut, then more.
	body := "{\n  \"note\": \"" + strings.Repeat("a", 4095-len("{\n  \"note\": \"")) + strings.Repeat("é", 600) + "\"\n}\n"
	up := newReview2Upstream(t, body)
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up, "--console")...)
	if r := send(t, "POST", idem.listen+"/note", "n-1", `{}`); r.status != 200 || r.body != body {
		t.Fatalf("claim: %d (%d bytes)", r.status, len(r.body))
	}
	status, page := review2Get(t, idem.admin+"/console/key?tenant=default&key=n-1")
	m := regexp.MustCompile(`(?s)<pre class="body"[^>]*>(.*?)</pre>`).FindStringSubmatch(page)
	if status != 200 || m == nil {
		t.Fatalf("key page: %d\n%s", status, page)
	}
	preview := html.UnescapeString(m[1])
	if !strings.HasPrefix(preview, "{\n  \"note\"") {
		t.Errorf("DEFECT: the preview of a 5 KiB UTF-8 JSON body whose 4096th byte is inside a character is shown quoted and escaped: %s... (the cut splits a character, and the whole preview is then treated as binary)", preview[:60])
	}
}

func newReview2Upstream(t *testing.T, body string) string {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		io.WriteString(w, body)
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// CONSOLE.md: "A POST without a valid token is logged at WARN." A
// cross-site POST (a form of another site, without the token) is refused
// by the cross-origin check before the token is looked at, and nothing is
// logged: the attempt leaves no trace.
func TestConsoleReview2CrossSitePostIsNotLogged(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	claimKey(t, idem, "order-1")
	req, _ := http.NewRequest("POST", idem.admin+"/console/key/evict", strings.NewReader(url.Values{"tenant": {"default"}, "key": {"order-1"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "https://evil.example")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("cross-site POST: %d, want 403", resp.StatusCode)
	}
	// A same-origin POST without a token, to another path, is logged at
	// WARN; the log is in order: once its line is read, a line for the
	// cross-site POST would have been read before it.
	rc := newReviewConsole(t, idem)
	if status, _, _ := rc.post("/console/job/retry", url.Values{"id": {"j"}}); status != http.StatusForbidden {
		t.Fatalf("POST without a token: %d, want 403", status)
	}
	if !idem.hasLog(`"path":"/console/job/retry"`) {
		t.Fatalf("the POST without a token is not logged:\n%s", idem.logs)
	}
	if logs := idem.logs.String(); strings.Count(logs, `"level":"WARN","msg":"console`) < 2 {
		t.Errorf("DEFECT: a cross-site POST without a token was refused (403) and nothing was logged at WARN, as CONSOLE.md promises for a POST without a valid token:\n%s", logs)
	}
}

// review2Browser starts headless Chromium for a test.
func review2Browser(t *testing.T, ctx context.Context) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromiumPath(t)), chromedp.NoSandbox,
		chromedp.Flag("disable-gpu", true), chromedp.WindowSize(1280, 900))
	actx, acancel := chromedp.NewExecAllocator(ctx, opts...)
	t.Cleanup(acancel)
	bctx, bcancel := chromedp.NewContext(actx)
	t.Cleanup(bcancel)
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	return bctx
}

// CONSOLE.md: "no page is wider than a phone's screen". Keys may be 255
// bytes without a space; on a 390 px screen the evict confirmation
// ("Evict key <code>KEY</code> of tenant ...?") and the "Done: evicted
// default/KEY" line after it do not wrap, and the page scrolls sideways.
func TestConsoleReview2LongKeyOnAPhone(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	long := "order-" + strings.Repeat("0123456789abcdef", 15) // 246 bytes
	claimKey(t, idem, long)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bctx := review2Browser(t, ctx)
	wide := func(what string) {
		t.Helper()
		v, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`document.documentElement.scrollWidth > window.innerWidth`))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if v {
			w, _ := chromedp.Run(bctx, chromedp.Evaluate[float64](`document.documentElement.scrollWidth`))
			t.Errorf("DEFECT: %s is %v px wide on a 390 px phone screen (a %d-byte key does not wrap)", what, w, len(long))
		}
	}
	q := url.Values{"tenant": {"default"}, "key": {long}}.Encode()
	if err := chromedp.Do(bctx, chromedp.EmulateViewport(390, 844, chromedp.EmulateMobile),
		chromedp.Navigate(idem.admin+"/console/key?"+q), chromedp.WaitVisible(chromedp.CSS(`[data-field="state"]`))); err != nil {
		t.Fatal(err)
	}
	wide("the key's page")
	if err := chromedp.Do(bctx, chromedp.Navigate(idem.admin+"/console/key/evict?"+q), chromedp.WaitVisible(chromedp.CSS(`#confirm`))); err != nil {
		t.Fatal(err)
	}
	wide("the evict confirmation")
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.CSS(`#confirm`)), chromedp.WaitVisible(chromedp.CSS(`.flash`))); err != nil {
		t.Fatal(err)
	}
	wide("the keys page after the eviction (its Done line)")
}

// The overview's refresh fetches the page every 5 s with setInterval,
// whether the last fetch has answered or not, and without a timeout: when
// idem is slow (here: stopped), the fetches pile up, one more every 5 s,
// and all land on the process at once when it answers again.
func TestConsoleReview2RefreshPilesUpWhenTheServerIsSlow(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bctx := review2Browser(t, ctx)
	// Count the page's fetches that have not answered yet.
	if _, err := chromedp.Call(bctx, cdppage.AddScriptToEvaluateOnNewDocument, cdppage.AddScriptToEvaluateOnNewDocumentParams{Source: `
		window.__pending = 0; window.__maxPending = 0;
		const f = window.fetch;
		window.fetch = function () {
			window.__pending++; window.__maxPending = Math.max(window.__maxPending, window.__pending);
			return f.apply(this, arguments).finally(() => { window.__pending--; });
		};`}); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(idem.admin+"/console/"), chromedp.WaitVisible(chromedp.CSS(`[data-outcome="claimed"]`))); err != nil {
		t.Fatal(err)
	}
	// A first refresh answers: the script runs.
	if _, err := chromedp.Run(bctx, chromedp.Poll[bool](`document.getElementById("refreshed").textContent.startsWith("Refreshed at")`, chromedp.WithPollingTimeout(20*time.Second))); err != nil {
		t.Fatalf("the overview does not refresh: %v", err)
	}
	// The process stops answering (SIGSTOP: a process paused, as by a long
	// stall); it is resumed before the test ends.
	if err := idem.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer idem.cmd.Process.Signal(syscall.SIGCONT)
	_, err := chromedp.Run(bctx, chromedp.Poll[bool](`window.__pending >= 3`, chromedp.WithPollingTimeout(25*time.Second)))
	pending, _ := chromedp.Run(bctx, chromedp.Evaluate[float64](`window.__maxPending`))
	if err == nil || pending > 1 {
		t.Errorf("DEFECT: while idem did not answer, the overview's refresh had %v fetches outstanding at once (a new one every 5 s, none abandoned): they pile up", pending)
	}
}

// The focus ring (:focus-visible, 3px #f5b400) is drawn on the page's
// white: a contrast of about 1.8:1, under the 3:1 WCAG 2.2 asks of a focus
// indicator (1.4.11, non-text contrast). A person using the keyboard
// hardly sees where the focus is on the keys and jobs pages' forms and
// links.
func TestConsoleReview2FocusRingIsVisible(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	claimKey(t, idem, "order-1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bctx := review2Browser(t, ctx)
	if err := chromedp.Do(bctx, chromedp.Navigate(idem.admin+"/console/keys?tenant=default"), chromedp.WaitVisible(chromedp.CSS(`tr[data-key="order-1"]`))); err != nil {
		t.Fatal(err)
	}
	// Tab to the tenant field of the filters, past the skip link and the
	// navigation, as a keyboard user does.
	for range 20 {
		if err := chromedp.Do(bctx, chromedp.KeyEvent("\t")); err != nil {
			t.Fatal(err)
		}
		id, _ := chromedp.Run(bctx, chromedp.Evaluate[string](`document.activeElement.id`))
		if id == "tenant" {
			break
		}
	}
	ratio, err := chromedp.Run(bctx, chromedp.Evaluate[float64](`(() => {
		const el = document.activeElement;
		const cs = getComputedStyle(el);
		if (el.id !== "tenant" || cs.outlineStyle === "none") { return -1; }
		const rgb = s => s.match(/[0-9.]+/g).slice(0, 3).map(Number);
		const lum = c => { const [r, g, b] = c.map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
		const a = lum(rgb(cs.outlineColor)), b = lum(rgb(getComputedStyle(document.body).backgroundColor));
		return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
	})()`))
	if err != nil {
		t.Fatal(err)
	}
	if ratio < 0 {
		t.Fatalf("the tenant field has no focus outline after Tab")
	}
	if ratio < 3 {
		t.Errorf("DEFECT: the focus ring of the keys page's tenant field has a contrast of %.2f:1 against the page (WCAG 2.2 1.4.11 asks 3:1): focus is hard to see", ratio)
	}
}

// The overview and keys pages at a phone's width, audited by axe-core as
// TestConsoleInABrowser audits them at 1280 px: tables scroll sideways
// "inside their box" (a div with overflow-x: auto); the overview's members
// table holds nothing focusable, and its box cannot be focused, so a
// keyboard user cannot scroll it to the database size and leader columns
// (axe: scrollable-region-focusable, serious).
func TestConsoleReview2ScrollingTablesOnAPhoneAndTheKeyboard(t *testing.T) {
	axe, err := os.ReadFile(axeCore)
	if err != nil {
		t.Fatal(err)
	}
	idem, _ := startConsoleIdem(t)
	claimKey(t, idem, "order-1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bctx := review2Browser(t, ctx)
	if err := chromedp.Do(bctx, chromedp.EmulateViewport(390, 844, chromedp.EmulateMobile)); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/console/", "/console/keys?tenant=default"} {
		if err := chromedp.Do(bctx, chromedp.Navigate(idem.admin+p), chromedp.WaitVisible(chromedp.CSS(`table`))); err != nil {
			t.Fatal(err)
		}
		out, err := chromedp.Run(bctx, chromedp.Evaluate[string](string(axe)+`;axe.run(document, {resultTypes: ["violations"]}).then(r => JSON.stringify(r.violations.filter(v => v.impact === "serious" || v.impact === "critical").map(v => v.id + ": " + v.nodes.map(n => n.target.join(" ")).join(", "))))`, chromedp.EvalAwaitPromise))
		if err != nil {
			t.Fatal(err)
		}
		if out != "[]" {
			t.Errorf("DEFECT: axe-core on %s at 390 px: serious violations %s", p, out)
		}
	}
}
