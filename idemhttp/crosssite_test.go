package idemhttp

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Issue 38: a page on another origin could submit jobs and signal events
// through the worker API, which took text/plain bodies and checked no
// origin. What a browser could send cross-site is refused (403
// cross-site) and changes nothing; programs (no Origin, no Sec-Fetch-Site,
// JSON or no content type) and same-origin pages are served.
func TestWorkerAPIRefusesWhatABrowserSendsCrossSite(t *testing.T) {
	api, err := NewAPI(APIConfig{Store: newStore(t, "")})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	defer srv.Close()
	post := func(key string, hdr ...string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("POST", srv.URL+"/v1/claim", strings.NewReader(`{"key":"`+key+`","params":1}`))
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for name, hdr := range map[string][]string{
		"text/plain":            {"Content-Type", "text/plain;charset=UTF-8"},
		"a form":                {"Content-Type", "application/x-www-form-urlencoded"},
		"Sec-Fetch-Site":        {"Content-Type", "application/json", "Sec-Fetch-Site", "cross-site"},
		"a foreign Origin":      {"Content-Type", "application/json", "Origin", "http://127.0.0.1:1"},
		"the opaque Origin":     {"Content-Type", "application/json", "Origin", "null"},
		"a same-site neighbour": {"Content-Type", "application/json", "Sec-Fetch-Site", "same-site"},
	} {
		key := "k-" + strings.ReplaceAll(name, " ", "-")
		if st, body := post(key, hdr...); st != http.StatusForbidden || !strings.Contains(body, "urn:idem:problem:cross-site") {
			t.Errorf("%s: %d %s; want 403 cross-site", name, st, body)
		}
		resp, err := http.Get(srv.URL + "/v1/keys/" + key)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("%s: the refused claim left a record (GET = %d)", name, resp.StatusCode)
		}
	}
	host := strings.TrimPrefix(srv.URL, "http://")
	for name, hdr := range map[string][]string{
		"a program, JSON":     {"Content-Type", "application/json"},
		"a program, no type":  {},
		"a problem+json type": {"Content-Type", "application/merge-patch+json"},
		"a same-origin page":  {"Content-Type", "application/json", "Origin", "http://" + host, "Sec-Fetch-Site", "same-origin"},
		"a typed URL (none)":  {"Content-Type", "application/json", "Sec-Fetch-Site", "none"},
	} {
		if st, body := post("ok-"+strings.ReplaceAll(name, " ", "-"), hdr...); st != http.StatusCreated {
			t.Errorf("%s: %d %s; want 201", name, st, body)
		}
	}
}
