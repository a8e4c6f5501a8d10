package idemhttp

import (
	"encoding/hex"
	"net/http"
	"strings"
	"testing"
)

// A fingerprint is saved with every record: a retry after an upgrade must
// fingerprint as before, or it would be refused as another request (422).
// These were computed by the 0.4 code.
func TestFingerprintsDoNotChange(t *testing.T) {
	cases := []struct {
		method, target, ct, body string
		headers                  map[string][]string
		names                    []string
	}{
		{"POST", "/charges", "application/json", `{"currency":"eur", "amount":100}`, nil, nil},
		{"POST", "/charges?b=2&a=1&a=0", "application/json; charset=utf-8", `[1,2.50,"x"]`, nil, nil},
		{"PUT", "/a%2Fb/c", "text/plain", "raw body", nil, nil},
		{"POST", "/", "", "", nil, nil},
		{"POST", "/x", "application/merge-patch+json", `{"a":{"c":1,"b":[true,null]}}`, map[string][]string{"X-Tenant-Plan": {"gold", "silver"}, "Authorization": {"Bearer t"}},
			[]string{"x-tenant-plan", "Authorization", "Missing"}},
		{"PATCH", "/" + strings.Repeat("p", 300), "application/octet-stream", strings.Repeat("\x00\xff", 3000), nil, nil},
	}
	golden := []string{
		"d867dde167418ce9f87c6a84df818da5b72ddc296f6202f645f5705049edd295", "172d7abcf76f73a58983c86276e94c8d90c84210fcc8c8c7faa407484e25a1c6", "bdc16450af82b54d094603c308c7e4925ea04ac40f62d45509b1124732f15f73", "ed4c2702d77b923a5e725c736dbf5bdde23195c54c3b10fc1d7d87a83b8d683d", "3849ddefaff50547691d352c3bfa7f335c3c8e594da3581d9cb372d21803d681", "1635f5a3ec75a6de5b0866b8b17e4f0f6abe10c615329222fcb4bb655c207187",
	}
	for i, c := range cases {
		r, err := http.NewRequest(c.method, "http://idem.test"+c.target, nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.ct != "" {
			r.Header.Set("Content-Type", c.ct)
		}
		for k, vs := range c.headers {
			for _, v := range vs {
				r.Header.Add(k, v)
			}
		}
		fp, err := Fingerprint(r, []byte(c.body), c.names)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if got := hex.EncodeToString(fp[:]); got != golden[i] {
			t.Errorf("case %d: fingerprint %s, want %s", i, got, golden[i])
		}
	}
}

// readBody reads what the reader holds, whatever Content-Length declared:
// exactly, more (a reader that does not enforce it) or less (an error).
func TestReadBodyWhateverTheDeclaredLength(t *testing.T) {
	for _, c := range []struct {
		body     string
		declared int64
		ok       bool
	}{{"hello", 5, true}, {"hello", 3, true}, {"hello", -1, true}, {"hello", 0, true}, {"", 0, true}, {"hello", 9, false}} {
		got, err := readBody(strings.NewReader(c.body), c.declared)
		if c.ok && (err != nil || string(got) != c.body) || !c.ok && err == nil {
			t.Errorf("body %q declared %d: got %q, %v", c.body, c.declared, got, err)
		}
	}
}
