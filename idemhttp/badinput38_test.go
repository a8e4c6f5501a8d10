package idemhttp

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Issue 38, worker API bad input: a body with a repeated member was taken
// (last wins: {"key":"a","key":"b"} claimed b); saved statuses -1, 999 and
// 2^40 and invalid header names were accepted. Each is refused with a
// clear error, and changes nothing.
func TestWorkerAPIRefusesAmbiguousAndUnsendableInput(t *testing.T) {
	api, err := NewAPI(APIConfig{Store: newStore(t, "")})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	defer srv.Close()
	post := func(path, body string) (int, string) {
		t.Helper()
		resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if st, body := post("/v1/claim", `{"key":"a","params":1,"key":"b"}`); st != 400 || !strings.Contains(body, "invalid-json") {
		t.Fatalf("a repeated member = %d %s; want 400 invalid-json", st, body)
	}
	for _, k := range []string{"a", "b"} {
		resp, err := http.Get(srv.URL + "/v1/keys/" + k)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 404 {
			t.Fatalf("key %s after the refused claim: %d; want 404", k, resp.StatusCode)
		}
	}
	st, claimed := post("/v1/claim", `{"key":"c","params":1,"deadline_ms":60000}`)
	if st != 201 {
		t.Fatalf("claim = %d %s", st, claimed)
	}
	_, after, _ := strings.Cut(claimed, `"handle":`)
	handle := after[:strings.Index(after, "}")+1]
	for _, out := range []string{
		`{"status":-1}`, `{"status":999}`, `{"status":1099511627776}`, `{"status":42}`,
		`{"status":200,"headers":{"Bad Name":["x"]}}`, `{"status":200,"headers":{"X-Ok":["line\nbreak"]}}`,
	} {
		if st, body := post("/v1/complete", `{"handle":`+handle+`,"outcome":`+out+`}`); st != 400 {
			t.Errorf("complete with outcome %s = %d %s; want 400", out, st, body)
		}
	}
	resp, err := http.Get(srv.URL + "/v1/keys/c")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"state":"in_flight"`) {
		t.Fatalf("the key after refused completes: %s; want still in flight", b)
	}
	if st, body := post("/v1/complete", `{"handle":`+handle+`,"outcome":{"status":201,"headers":{"X-Ok":["1"]}}}`); st != 200 {
		t.Fatalf("a valid complete = %d %s", st, body)
	}
}
