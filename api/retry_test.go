package api

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/getkin/kin-openapi/routers/legacy"
)

// Issue 38: a retried release, or a second complete of the same outcome by
// the same owner, answered 409 "lost to a newer owner" when nobody else
// held the key. A retry of a call that landed must succeed, with what it
// did; a call that did not land (another owner holds the key) is still
// refused.
func TestRetriedReleaseAndCompleteSucceed(t *testing.T) {
	doc := loadSpec(t)
	doc.Servers = nil
	router, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	vc := &validatingClient{t: t, router: router, seen: map[string]bool{}}
	a := &apiClient{t, newAPIServer(t, newStore(t, fmt.Sprintf("/t/api/%d/", prefixSeq.Add(1)))), &http.Client{Transport: vc}}
	claim := func(key string) any {
		t.Helper()
		st, c := a.post("/v1/claim", map[string]any{"key": key, "params": 1, "deadline_ms": 60000})
		if st != 201 {
			t.Fatalf("claim %s = %d %v", key, st, c)
		}
		return c["handle"]
	}
	h := claim("rel")
	for i := range 2 {
		if st, r := a.post("/v1/release", map[string]any{"handle": h}); st != 200 || r["state"] != "released" {
			t.Fatalf("release #%d = %d %v; want 200 released", i+1, st, r)
		}
	}
	// Released, then claimed by another: the old handle's release is
	// refused (it would release another owner's claim).
	claim("rel")
	if st, r := a.post("/v1/release", map[string]any{"handle": h}); st != 409 {
		t.Fatalf("release of a handle whose key another claim holds = %d %v; want 409", st, r)
	}
	h = claim("done")
	// Header names as a client in any language spells them.
	out := map[string]any{"status": 201, "headers": map[string][]string{"content-type": {"application/json"}, "X-Request-Id": {"r1"}}, "body": []byte(`{"ok":true}`)}
	for i := range 2 {
		if st, r := a.post("/v1/complete", map[string]any{"handle": h, "outcome": out}); st != 200 || r["state"] != "done" {
			t.Fatalf("complete #%d of the same outcome = %d %v; want 200 done", i+1, st, r)
		}
	}
	other := map[string]any{"status": 500, "body": []byte(`{}`)}
	if st, r := a.post("/v1/complete", map[string]any{"handle": h, "outcome": other}); st != 409 {
		t.Fatalf("complete of another outcome after the first = %d %v; want 409", st, r)
	}
}
