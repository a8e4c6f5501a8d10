package main

import (
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// Review tests of the console (idem serve --console). Each starts a real
// idem serve on its embedded etcd and speaks HTTP to its admin listener as
// a browser would: a cookie jar, the links and forms of the pages.

// reviewConsole is a browser-like client of one idem serve's console.
type reviewConsole struct {
	t    *testing.T
	idem *idemProc
	c    *http.Client
}

func newReviewConsole(t *testing.T, idem *idemProc) *reviewConsole {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &reviewConsole{t: t, idem: idem, c: &http.Client{Jar: jar, Timeout: 30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

// get fetches a path (or a link, as the page wrote it, resolved against
// base) of the admin listener.
func (rc *reviewConsole) get(path string) (int, string) {
	rc.t.Helper()
	resp, err := rc.c.Get(rc.idem.admin + path)
	if err != nil {
		rc.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// post posts a form the way the page's form would, with the page's token.
func (rc *reviewConsole) post(path string, form url.Values) (int, http.Header, string) {
	rc.t.Helper()
	req, err := http.NewRequest("POST", rc.idem.admin+path, strings.NewReader(form.Encode()))
	if err != nil {
		rc.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := rc.c.Do(req)
	if err != nil {
		rc.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

var (
	reviewHref   = regexp.MustCompile(`href="([^"]*)"`)
	reviewCSRF   = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)
	reviewHidden = regexp.MustCompile(`<input type="hidden" name="([a-z]+)" value="([^"]*)">`)
)

// token reads the CSRF token of a confirmation page (any key will do).
func (rc *reviewConsole) token() string {
	rc.t.Helper()
	status, body := rc.get("/console/key/evict?tenant=default&key=anything")
	m := reviewCSRF.FindStringSubmatch(body)
	if status != 200 || m == nil {
		rc.t.Fatalf("no CSRF token on the confirmation page: %d\n%s", status, body)
	}
	return m[1]
}

// links returns the hrefs of a page, as a browser reads them.
func reviewLinks(body string) []string {
	var out []string
	for _, m := range reviewHref.FindAllStringSubmatch(body, -1) {
		out = append(out, html.UnescapeString(m[1]))
	}
	return out
}

// hiddenFields returns the hidden inputs of a page's form.
func reviewHiddenFields(body string) url.Values {
	v := url.Values{}
	for _, m := range reviewHidden.FindAllStringSubmatch(body, -1) {
		v.Set(m[1], html.UnescapeString(m[2]))
	}
	return v
}

func startConsoleIdem(t *testing.T, extra ...string) (*idemProc, *shop) {
	t.Helper()
	dir := tempDir(t)
	up := newShop(t)
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	idem := startIdem(t, dir, append(append(flags, "--upstream", up.URL, "--console"), extra...)...)
	return idem, up
}

func claimKey(t *testing.T, idem *idemProc, key string) {
	t.Helper()
	if r := send(t, "POST", idem.listen+"/charge", key, `{"amount":1}`); r.status != 201 {
		t.Fatalf("claim %q: %d %s", key, r.status, r.body)
	}
}

// Keys and job ids may hold any visible ASCII but '/': "order:17",
// "a+b", "x%3Ay". The pages build their links with q (url.QueryEscape)
// inside an href, where html/template escapes the already escaped value a
// second time: the link of "pay:1" names "pay%3A1", another key. Following
// the key's own links, as a person does, the evict confirmation and its
// POST then evict that other key.
func TestConsoleReviewLinksOfKeysWithPunctuation(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	rc := newReviewConsole(t, idem)
	claimKey(t, idem, "pay:1")
	claimKey(t, idem, "pay%3A1") // a different, valid key

	// The keys page's link to pay:1.
	_, list := rc.get("/console/keys?tenant=default")
	var link string
	if m := regexp.MustCompile(`data-key="pay:1"><td>default</td><th scope="row"><a href="([^"]*)"`).FindStringSubmatch(list); m != nil {
		link = html.UnescapeString(m[1])
	}
	if link == "" {
		t.Fatalf("no link for pay:1 on the keys page:\n%s", list)
	}
	u, _ := url.Parse(link)
	if got := u.Query().Get("key"); got != "pay:1" {
		t.Errorf("DEFECT: the keys page's link for key pay:1 is %q, which names key %q (escaped twice: q inside an href)", link, got)
	}

	// The key page of pay:1 (reached by a correct URL), its evict link,
	// the confirmation, the POST.
	status, page := rc.get("/console/key?" + url.Values{"tenant": {"default"}, "key": {"pay:1"}}.Encode())
	if status != 200 {
		t.Fatalf("key page of pay:1: %d\n%s", status, page)
	}
	var evict string
	for _, l := range reviewLinks(page) {
		if strings.HasPrefix(l, "/console/key/evict?") {
			evict = l
		}
	}
	if evict == "" {
		t.Fatalf("no evict link on pay:1's page:\n%s", page)
	}
	status, confirm := rc.get(evict)
	if status != 200 {
		t.Fatalf("confirmation %s: %d", evict, status)
	}
	form := reviewHiddenFields(confirm)
	if form.Get("key") != "pay:1" {
		t.Errorf("DEFECT: the evict link on pay:1's page (%s) asks to confirm evicting key %q", evict, form.Get("key"))
	}
	status, _, body := rc.post("/console/key/evict", form)
	t.Logf("POST evict %v: %d", form, status)
	if status >= 400 {
		t.Logf("%s", body)
	}
	for key, want := range map[string]int{"pay:1": 404, "pay%3A1": 200} {
		if got, _ := rc.get("/console/key?" + url.Values{"tenant": {"default"}, "key": {key}}.Encode()); got != want {
			t.Errorf("DEFECT: after evicting pay:1 through its own page's links, key %q answers %d, want %d (the wrong key was evicted, or none)", key, got, want)
		}
	}
}

// The keys page's "Next page" link: html/template escapes the query string
// .Next holds (tenant=...&after_key=...) as one query value, so '=' and '&'
// become %3d and %26. Following it shows the first page again, forever.
func TestConsoleReviewNextPage(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	rc := newReviewConsole(t, idem)
	for i := 0; i <= consolePageSize; i++ { // one more than a page
		claimKey(t, idem, fmt.Sprintf("k%03d", i))
	}
	_, first := rc.get("/console/keys?tenant=default")
	if !strings.Contains(first, `data-key="k000"`) || strings.Contains(first, `data-key="k100"`) {
		t.Fatalf("first page: want k000..k099")
	}
	var next string
	for _, l := range reviewLinks(first) {
		if strings.HasPrefix(l, "/console/keys?") {
			next = l
		}
	}
	if next == "" {
		t.Fatalf("no next page link on a full page")
	}
	status, second := rc.get(next)
	if status != 200 {
		t.Fatalf("next page %s: %d\n%s", next, status, second)
	}
	if !strings.Contains(second, `data-key="k100"`) || strings.Contains(second, `data-key="k000"`) {
		u, _ := url.Parse(next)
		t.Errorf("DEFECT: the Next page link %q (query parsed as %v) does not lead to the second page (k100): it shows the first again", next, u.Query())
	}
}

// Bad input to an action is the person's mistake: a clear error, 400, as
// the worker API (idemhttp.ProblemFor) answers ErrInvalidKey and
// ErrInvalidTenant. The console's failFor knows only ErrInvalidArgument
// and answers 500, an internal error, instead.
func TestConsoleReviewBadInputOfActionsIs400(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	rc := newReviewConsole(t, idem)
	csrf := rc.token()
	for _, c := range []struct {
		path string
		form url.Values
	}{
		{"/console/key/evict", url.Values{"tenant": {"default"}, "key": {"has space"}}},
		{"/console/key/evict", url.Values{"tenant": {"default"}, "key": {""}}},
		{"/console/key/evict", url.Values{"tenant": {"-bad"}, "key": {"k"}}},
		{"/console/job/retry", url.Values{"id": {"a/b"}}},
		{"/console/job/cancel", url.Values{"tenant": {"no tenant"}, "id": {"j"}}},
	} {
		c.form.Set("csrf", csrf)
		status, _, body := rc.post(c.path, c.form)
		if status != http.StatusBadRequest {
			msg := body
			if i := strings.Index(body, `role="alert">`); i >= 0 {
				msg = body[i:min(len(body), i+200)]
			}
			t.Errorf("DEFECT: POST %s %v: %d, want 400 (bad input): %s", c.path, c.form, status, msg)
		}
	}
}

// A key that holds no job (an idempotency key), asked for as a job: the
// worker API answers jobs.ErrNotJob with 404; the console answers 500 on
// the job page and on retry and cancel.
func TestConsoleReviewNotAJobIsNot500(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	rc := newReviewConsole(t, idem)
	claimKey(t, idem, "order-1")
	if status, body := rc.get("/console/job?tenant=default&id=order-1"); status == http.StatusInternalServerError {
		t.Errorf("DEFECT: the job page of key default/order-1, which holds no job: %d (internal error), want 404 as the worker API answers ErrNotJob\n%s", status, alertOf(body))
	}
	csrf := rc.token()
	for _, action := range []string{"retry", "cancel"} {
		status, _, body := rc.post("/console/job/"+action, url.Values{"csrf": {csrf}, "tenant": {"default"}, "id": {"order-1"}})
		if status == http.StatusInternalServerError || status < 400 {
			t.Errorf("DEFECT: POST /console/job/%s of key default/order-1, which holds no job: %d, want 404 (or 409)\n%s", action, status, alertOf(body))
		}
	}
	if status, _ := rc.get("/console/key?tenant=default&key=order-1"); status != 200 {
		t.Errorf("order-1 after the refused actions: %d, want it untouched", status)
	}
}

func alertOf(body string) string {
	if i := strings.Index(body, `role="alert">`); i >= 0 {
		return body[i:min(len(body), i+300)]
	}
	return body
}

// DNS rebinding: a page of evil.example whose name is made to resolve to
// 127.0.0.1 talks to the admin listener as its own origin. The browser
// sends Host: evil.example:PORT, Origin http://evil.example:PORT and
// Sec-Fetch-Site: same-origin; the console serves it a cookie and a page
// with the token (its script can read it: same origin), then accepts its
// POST. CrossOriginProtection compares Origin with Host, both the
// attacker's; nothing checks that Host names this listener. DOCS
// (CONSOLE.md) tell operators to keep the admin listener on loopback as
// the protection: that is exactly what DNS rebinding defeats.
func TestConsoleReviewDNSRebinding(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	claimKey(t, idem, "order-9")
	u, _ := url.Parse(idem.admin)
	evilHost := "evil.example:" + u.Port()
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	do := func(method, path string, body io.Reader) (*http.Response, string) {
		req, _ := http.NewRequest(method, idem.admin+path, body)
		req.Host = evilHost
		req.Header.Set("Sec-Fetch-Site", "same-origin")
		if method == "POST" {
			req.Header.Set("Origin", "http://"+evilHost)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		}
		// The jar keys cookies by the URL's host (127.0.0.1); a browser
		// would key them by evil.example: same cookie either way.
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	resp, page := do("GET", "/console/key?tenant=default&key=order-9", nil)
	if resp.StatusCode == 200 && strings.Contains(page, "order-9") {
		t.Errorf("DEFECT: a request with Host %s (not this listener's name) is served the console's key page: saved bodies readable by any web page through DNS rebinding", evilHost)
	}
	resp, confirm := do("GET", "/console/key/evict?tenant=default&key=order-9", nil)
	m := reviewCSRF.FindStringSubmatch(confirm)
	if m == nil {
		return // refused: good
	}
	resp, _ = do("POST", "/console/key/evict", strings.NewReader(url.Values{"csrf": {m[1]}, "tenant": {"default"}, "key": {"order-9"}}.Encode()))
	rc := newReviewConsole(t, idem)
	if status, _ := rc.get("/console/key?tenant=default&key=order-9"); status == 404 {
		t.Errorf("DEFECT: a page of %s (DNS rebinding to the loopback admin listener) evicted default/order-9: its POST got %d; the CSRF token and CrossOriginProtection do not stop a same-origin attacker, and Host is never checked", evilHost, resp.StatusCode)
	}
}

// The flash ("Done: ...") is whatever ?done= says: a link can make any
// console page announce an action that nobody took ("Done: evicted
// default/order-1", "Done: inv-7 cancelled").
func TestConsoleReviewForgedDoneMessage(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	rc := newReviewConsole(t, idem)
	forged := "inv-7 cancelled; now evict default/order-1 to finish the clean-up"
	_, body := rc.get("/console/jobs?" + url.Values{"done": {forged}}.Encode())
	if strings.Contains(body, `class="flash"`) && strings.Contains(body, html.EscapeString(forged)) {
		t.Errorf("DEFECT: GET /console/jobs?done=... shows %q as a done action, though no action was taken (the flash comes from the URL, not from the action)", "Done: "+forged)
	}
}

// A record saved while --replay-deny-headers allowed Set-Cookie, replayed
// after a restart with the default policy (deny Set-Cookie): the console
// says Set-Cookie is "withheld by the replay policy" and lists the
// "headers a retry is sent" without it, but the edge replays every saved
// header: the retry gets the first caller's cookie. The console's account
// of a replay is false (or the edge does not apply the deny list to what
// it replays, as docs/CONSOLE.md and the flag's help promise).
func TestConsoleReviewWithheldHeaderIsReplayed(t *testing.T) {
	dir := tempDir(t)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Set-Cookie", "session=first-callers-secret")
		w.Header().Set("X-Order", "o-1")
		w.WriteHeader(201)
		io.WriteString(w, `{"ok":true}`)
	}))
	defer up.Close()
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	idem := startIdem(t, dir, append(flags, "--upstream", up.URL, "--console", "--replay-deny-headers", "none")...)
	if r := send(t, "POST", idem.listen+"/charge", "c-1", `{}`); r.status != 201 || r.header.Get("Set-Cookie") == "" {
		t.Fatalf("claim: %d %v", r.status, r.header)
	}
	if err := idem.terminate(); err != nil {
		t.Fatalf("stop: %v\n%s", err, idem.logs)
	}
	idem = startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "idem-data")), "--upstream", up.URL, "--console")...)
	r := send(t, "POST", idem.listen+"/charge", "c-1", `{}`)
	if r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry not replayed: %d %v", r.status, r.header)
	}
	replayedCookie := r.header.Get("Set-Cookie") != ""
	rc := newReviewConsole(t, idem)
	status, page := rc.get("/console/key?tenant=default&key=c-1")
	if status != 200 {
		t.Fatalf("key page: %d", status)
	}
	consoleWithholds := strings.Contains(page, "Withheld by the replay policy") && strings.Contains(page, "Set-Cookie")
	if replayedCookie && consoleWithholds {
		t.Errorf("DEFECT: the console says Set-Cookie is withheld by the replay policy and not among the headers a retry is sent, but the retry was sent Set-Cookie: %q", r.header.Get("Set-Cookie"))
	}
}

// HEAD of the console's stylesheet and script: 404 "no such page", while
// GET serves them (ServeHTTP sends only GET to the file server). HEAD must
// answer as GET does, without the body (RFC 9110 §9.3.2).
func TestConsoleReviewHeadOfStaticFiles(t *testing.T) {
	idem, _ := startConsoleIdem(t)
	for _, p := range []string{"/console/static/console.css", "/console/static/console.js"} {
		resp, err := http.Head(idem.admin + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		get, err := http.Get(idem.admin + p)
		if err != nil {
			t.Fatal(err)
		}
		get.Body.Close()
		if resp.StatusCode != get.StatusCode {
			t.Errorf("DEFECT: HEAD %s: %d, GET: %d", p, resp.StatusCode, get.StatusCode)
		}
	}
}
