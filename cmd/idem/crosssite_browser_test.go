package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// Issue 38: in Chromium, a page on another loopback port approved a refund
// and submitted a payout through the worker API, which took text/plain
// bodies and checked no origin. The same page now changes nothing.
func TestWorkerAPIRefusesAPageOnAnotherOriginInChromium(t *testing.T) {
	dir := tempDir(t)
	idem := startIdem(t, dir, embeddedFlags(t, filepath.Join(dir, "idem-data"))...)
	page := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, `<!doctype html><title>start</title><script>
const api = %q;
Promise.allSettled([
  fetch(api + "/v1/claim", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: '{"key":"payout-1","params":1}'}),
  fetch(api + "/v1/jobs", {method: "POST", mode: "no-cors", body: '{"id":"payout-2","kind":"payout","params":{}}'}),
]).then(() => { document.title = "sent"; });
</script>`, idem.listen)
	}))
	defer page.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bctx := review2Browser(t, ctx)
	if err := chromedp.Do(bctx, chromedp.Navigate(page.URL)); err != nil {
		t.Fatalf("the page on another origin: %v", err)
	}
	if _, err := chromedp.Run(bctx, chromedp.Poll[bool](`document.title === "sent"`, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Fatalf("the page on another origin: %v", err)
	}
	for _, path := range []string{"/v1/keys/payout-1", "/v1/jobs/payout-2"} {
		if r := send(t, "GET", idem.listen+path, "", ""); r.status != http.StatusNotFound {
			t.Errorf("GET %s after the page's requests = %d %s; want 404: the page changed something", path, r.status, r.body)
		}
	}
}
