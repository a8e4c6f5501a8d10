package idemhttp

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idem-dev/idem/etcdstore"
)

// Every form of an empty key, a key with parameters, and a key with a
// character keys cannot hold is refused with 400 invalid-key, and nothing
// reaches the upstream.
func TestKeySyntaxRefusals(t *testing.T) {
	up := newUpstream(t)
	front := newFront(t, Config{}, up, ProxyOptions{})
	for _, tc := range []struct{ header, detail string }{
		{`""`, "empty"},
		{`"" `, "empty"},
		{` "" `, "empty"},
		{`"k";p=1`, "parameters"},
		{`"k"; a=?1`, "parameters"},
		{`"a b"`, "space"},
		{`"a/b"`, "'/'"},
		{`"k", "j"`, "a list"},
		{`a"b`, "stray quote"},
		{`"unterminated`, "unterminated"},
	} {
		r := do(t, "POST", front.URL+"/charge", tc.header, `{}`)
		if r.status != http.StatusBadRequest || problemType(t, r) != KindInvalidKey || !strings.Contains(r.body, tc.detail) {
			t.Errorf("Idempotency-Key: %s = %d %q; want 400 invalid-key saying %q", tc.header, r.status, r.body, tc.detail)
		}
	}
	// An empty bare value: the header is there, so the request is keyed.
	req, _ := http.NewRequest("POST", front.URL+"/charge", strings.NewReader(`{}`))
	req.Header["Idempotency-Key"] = []string{""}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("Idempotency-Key with an empty value = %d; want 400", resp.StatusCode)
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the upstream was called %d times for refused keys; want 0", n)
	}
}

// The quoted and the bare form name one key: the second is a replay, and
// the upstream sees the key in one form whichever the client sent.
func TestQuotedAndBareKeyAreOneOperation(t *testing.T) {
	up := newUpstream(t)
	front := newFront(t, Config{}, up, ProxyOptions{})
	first := do(t, "POST", front.URL+"/charge", `"ord-7"`, `{"a":1}`)
	again := do(t, "POST", front.URL+"/charge", `ord-7`, `{"a":1}`)
	if first.status != http.StatusCreated || again.body != first.body || again.header.Get(HeaderReplayed) != "true" {
		t.Fatalf("quoted then bare: %d %q, then %d %q replayed=%q; want one operation", first.status, first.body, again.status, again.body, again.header.Get(HeaderReplayed))
	}
	if n := up.effectsOf("ord-7"); n != 1 {
		t.Fatalf("the upstream saw key ord-7 %d times (effects by key: %v); want once, in its bare form", n, up.effects)
	}
	// A key that holds a quote can only travel as an sf-string: that is
	// then its one form.
	for _, sent := range []string{`"q\"1"`, `"q\"1" `} {
		r := do(t, "POST", front.URL+"/echo", sent, `{}`)
		var h http.Header
		if err := json.Unmarshal([]byte(r.body), &h); err != nil {
			t.Fatalf("echo: %d %q: %v", r.status, r.body, err)
		}
		if got := h.Values(HeaderKey); len(got) != 1 || got[0] != `"q\"1"` {
			t.Fatalf("sent %s; the upstream got %q; want [\"q\\\"1\"]", sent, got)
		}
	}
}

// A replay never carries Set-Cookie (by default), headers the upstream's
// Connection header names, or trailers; the first caller still gets its
// cookie. DenyHeaders and AllowHeaders change what is saved.
func TestWhatAReplayCarries(t *testing.T) {
	up := newUpstream(t)
	for _, tc := range []struct {
		name          string
		cfg           Config
		cookie, reqID bool // replayed
	}{
		{"default", Config{}, false, true},
		{"deny none", Config{DenyHeaders: []string{}}, true, true},
		{"deny X-Request-Id", Config{DenyHeaders: []string{"x-request-id", "Set-Cookie"}}, false, false},
		{"allow Content-Type, X-Kept", Config{AllowHeaders: []string{"Content-Type", "X-Kept"}}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			front := newFront(t, tc.cfg, up, ProxyOptions{})
			first := do(t, "POST", front.URL+"/headers", "login-1", `{}`)
			if first.status != http.StatusCreated || !strings.HasPrefix(first.header.Get("Set-Cookie"), "session=secret-") {
				t.Fatalf("first = %d %v; want 201 with the upstream's cookie", first.status, first.header)
			}
			replay := do(t, "POST", front.URL+"/headers", "login-1", `{}`)
			if replay.header.Get(HeaderReplayed) != "true" || replay.body != first.body {
				t.Fatalf("replay = %d %q %v", replay.status, replay.body, replay.header)
			}
			if got := replay.header.Get("Set-Cookie") != ""; got != tc.cookie {
				t.Errorf("replay Set-Cookie %q; want present=%v", replay.header.Get("Set-Cookie"), tc.cookie)
			}
			if got := replay.header.Get("X-Request-Id") != ""; got != tc.reqID {
				t.Errorf("replay X-Request-Id %q; want present=%v", replay.header.Get("X-Request-Id"), tc.reqID)
			}
			if replay.header.Get("X-Kept") != "yes" {
				t.Errorf("replay lacks X-Kept: %v", replay.header)
			}
			for _, k := range []string{"X-Checksum", "Trailer"} {
				if v := replay.header.Get(k); v != "" {
					t.Errorf("replay has %s: %q; trailers are not replayed", k, v)
				}
			}
		})
	}
	if _, err := New(Config{Store: newStore(t, ""), DenyHeaders: []string{"Bad Name"}}); err == nil {
		t.Fatal("New accepted a header name with a space in DenyHeaders")
	}
}

// A header denied after records were saved with it (Set-Cookie allowed
// at first, then the default) is not replayed from those records either:
// the deny list holds for what a replay sends, not only for what is saved.
func TestDenyListHoldsForRecordsSavedBefore(t *testing.T) {
	up := newUpstream(t)
	store := newStore(t, "")
	before := newFront(t, Config{Store: store, DenyHeaders: []string{}}, up, ProxyOptions{})
	first := do(t, "POST", before.URL+"/headers", "login-2", `{}`)
	if !strings.HasPrefix(first.header.Get("Set-Cookie"), "session=secret-") {
		t.Fatalf("first = %d %v; want the upstream's cookie", first.status, first.header)
	}
	if again := do(t, "POST", before.URL+"/headers", "login-2", `{}`); again.header.Get("Set-Cookie") == "" {
		t.Fatalf("with Set-Cookie allowed, the replay lacks it: %v (the record did not save it)", again.header)
	}
	after := newFront(t, Config{Store: store}, up, ProxyOptions{})
	replay := do(t, "POST", after.URL+"/headers", "login-2", `{}`)
	if replay.header.Get(HeaderReplayed) != "true" || replay.body != first.body {
		t.Fatalf("replay = %d %q %v", replay.status, replay.body, replay.header)
	}
	if c := replay.header.Get("Set-Cookie"); c != "" {
		t.Errorf("a replay under the default deny list sent the first caller's Set-Cookie %q, saved before the list denied it", c)
	}
	if replay.header.Get("X-Kept") != "yes" {
		t.Errorf("replay lacks X-Kept: %v", replay.header)
	}
}

// The middleware alone (no reverse proxy to strip them): headers that the
// handler's Connection header names are hop-by-hop, never saved.
func TestConnectionNamedHeadersAreNotSaved(t *testing.T) {
	mw, err := New(Config{Store: newStore(t, "")})
	if err != nil {
		t.Fatal(err)
	}
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "X-Hop, keep-alive")
		w.Header().Set("X-Hop", "per-connection")
		w.Header().Set("X-Kept", "yes")
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	do(t, "POST", srv.URL+"/", "hop-1", `{}`)
	replay := do(t, "POST", srv.URL+"/", "hop-1", `{}`)
	if replay.header.Get(HeaderReplayed) != "true" || replay.header.Get("X-Kept") != "yes" {
		t.Fatalf("replay = %d %v", replay.status, replay.header)
	}
	if v := replay.header.Get("X-Hop"); v != "" {
		t.Fatalf("replay has X-Hop: %q; a header named by Connection is hop-by-hop", v)
	}
}

// 429, and 503 with Retry-After, say the request was not processed: the
// client gets the upstream's answer, nothing is saved, and the retry
// reaches the upstream. Other 5xx (503 without Retry-After, 500) are saved
// and replayed. Rules change either.
func TestStatusPolicy(t *testing.T) {
	up := newUpstream(t)
	for _, tc := range []struct {
		name, query string
		rules       []StatusRule
		status      int  // the first answer
		rerun       bool // the retry reaches the upstream
	}{
		{"429", "code=429&retry-after=1", nil, 429, true},
		{"429 without Retry-After", "code=429", nil, 429, true},
		{"503 with Retry-After", "code=503&retry-after=2", nil, 503, true},
		{"503 without Retry-After", "code=503", nil, 503, false},
		{"500", "code=500", nil, 500, false},
		{"502", "code=502", nil, 502, false},
		{"409 from the upstream", "code=409", nil, 409, false},
		{"rule 429=save", "code=429&retry-after=1", []StatusRule{{Status: "429", End: etcdstore.EndSave}}, 429, false},
		{"rule 5xx=release", "code=500", []StatusRule{{Status: "5xx", End: etcdstore.EndRelease}}, 500, true},
		{"rule 503:retry-after=save", "code=503&retry-after=1", []StatusRule{{Status: "503", RetryAfter: true, End: etcdstore.EndSave}}, 503, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			front := newFront(t, Config{OnStatus: Rules(nil, tc.rules...)}, up, ProxyOptions{})
			key := "st-" + strings.NewReplacer(" ", "-", "=", "-", ":", "-").Replace(tc.name)
			first := do(t, "POST", front.URL+"/status?"+tc.query, key, `{}`)
			if first.status != tc.status || first.body != `{"call":1}` {
				t.Fatalf("first = %d %q; want the upstream's %d", first.status, first.body, tc.status)
			}
			retry := do(t, "POST", front.URL+"/status?"+tc.query, key, `{}`)
			switch {
			case tc.rerun && (retry.status != http.StatusCreated || retry.body != `{"call":2}` || retry.header.Get(HeaderReplayed) != ""):
				t.Fatalf("retry = %d %q replayed=%q; want the upstream called again (201, call 2)", retry.status, retry.body, retry.header.Get(HeaderReplayed))
			case !tc.rerun && (retry.status != tc.status || retry.body != first.body || retry.header.Get(HeaderReplayed) != "true"):
				t.Fatalf("retry = %d %q replayed=%q; want the first answer replayed", retry.status, retry.body, retry.header.Get(HeaderReplayed))
			}
			if tc.rerun && tc.status == 429 && tc.query == "code=429&retry-after=1" && first.header.Get("Retry-After") != "1" {
				t.Fatalf("the released 429 lost its Retry-After: %v", first.header)
			}
		})
	}
}

func TestParseStatusRule(t *testing.T) {
	for in, want := range map[string]StatusRule{
		"429=save":                {Status: "429", End: etcdstore.EndSave},
		"5xx=release":             {Status: "5xx", End: etcdstore.EndRelease},
		"5XX=abandon":             {Status: "5xx", End: etcdstore.EndAbandon},
		"503:retry-after=release": {Status: "503", RetryAfter: true, End: etcdstore.EndRelease},
	} {
		if got, err := ParseStatusRule(in); err != nil || got != want {
			t.Errorf("ParseStatusRule(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for in, why := range map[string]string{
		"429":               "want STATUS",
		"42=save":           "not a status",
		"600=save":          "not a status",
		"1xx=save":          "not a status",
		"abc=save":          "not a status",
		"429=keep":          "must be save, release or abandon",
		"503:when-sad=save": "the only condition",
	} {
		if _, err := ParseStatusRule(in); err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("ParseStatusRule(%q) = %v; want an error saying %q", in, err, why)
		}
	}
}

// idem's own problem answers link to where their types are documented, as
// the IETF draft suggests; saved problems replay the link too.
func TestProblemsLinkToTheirDocs(t *testing.T) {
	up := newUpstream(t)
	for _, tc := range []struct{ docs, want string }{
		{"", `<` + DefaultProblemDocs + `>; rel="describedby"`},
		{"https://docs.example/idem", `<https://docs.example/idem>; rel="describedby"`},
		{"none", ""},
	} {
		front := newFront(t, Config{ProblemDocs: tc.docs}, up, ProxyOptions{})
		do(t, "POST", front.URL+"/charge", "link-1", `{"a":1}`)
		for name, r := range map[string]reply{
			"422":             do(t, "POST", front.URL+"/charge", "link-1", `{"a":2}`),
			"400":             do(t, "POST", front.URL+"/charge", `""`, `{}`),
			"502 saved":       do(t, "POST", front.URL+"/cut", "link-2", `{}`),
			"502 replayed":    do(t, "POST", front.URL+"/cut", "link-2", `{}`),
			"a plain success": do(t, "POST", front.URL+"/charge", "link-1", `{"a":1}`),
		} {
			want := tc.want
			if name == "a plain success" {
				want = ""
			}
			if got := r.header.Get("Link"); got != want {
				t.Errorf("docs %q, %s (%d): Link %q; want %q", tc.docs, name, r.status, got, want)
			}
		}
	}
}
