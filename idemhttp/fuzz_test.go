package idemhttp

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/canonjson"
)

// FuzzKeyAndTenantHeaders parses an Idempotency-Key header and a tenant
// header as the edge does. What it accepts is a valid store key (so
// FuzzKeyEncoding's invariant, that a valid key encodes inside its tenant's
// prefix, covers it), has no '/' to name another tenant's or idem's own
// keys with, and names the same key bare and quoted.
func FuzzKeyAndTenantHeaders(f *testing.F) {
	for _, s := range [][2]string{
		{"order-1", "acme"}, {`"order-1"`, "acme"}, {`"a\"b"`, "t"}, {"../acme/k", "globex"}, {"k", "../acme"},
		{`"a", "b"`, "x"}, {"", "x"}, {"k\x00", "x"}, {"..", "a.b"}, {`"\\"`, "a-b"}, {"k", "a/b"}, {"k", ""},
	} {
		f.Add(s[0], s[1])
	}
	tenantOf := TrustedHeaderTenant("X-Tenant", []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}, FixedTenant("default"))
	f.Fuzz(func(t *testing.T, keyHeader, tenantHeader string) {
		r := httptest.NewRequest("POST", "/charge", nil) // RemoteAddr 192.0.2.1: trusted
		r.Header[HeaderKey] = []string{keyHeader}
		if tenantHeader != "" {
			r.Header["X-Tenant"] = []string{tenantHeader}
		}
		id, _, err := keyFromHeader(r.Header)
		if err != nil {
			if !errors.Is(err, ErrBadKeyHeader) {
				t.Fatalf("key header %q: error %v is not ErrBadKeyHeader", keyHeader, err)
			}
			return
		}
		tenant, err := tenantOf(r)
		if err != nil {
			if !errors.Is(err, etcdstore.ErrInvalidTenant) {
				t.Fatalf("tenant header %q: error %v is not ErrInvalidTenant", tenantHeader, err)
			}
			return
		}
		k := etcdstore.Key{Tenant: tenant, ID: id}
		if k.Validate() != nil {
			return // refused by the store before any etcd call (400 at the edge)
		}
		if strings.Contains(id, "/") || strings.Contains(tenant, "/") {
			t.Fatalf("accepted %v, which holds a '/'", k)
		}
		if tenantHeader != "" && tenant != tenantHeader {
			t.Fatalf("tenant header %q became tenant %q", tenantHeader, tenant)
		}
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(id) + `"`
		again, err := ParseKey(quoted)
		if err != nil || again != id {
			t.Fatalf("key %q quoted as %q parses to %q, %v", id, quoted, again, err)
		}
		if canon, err := ParseKey(FormatKey(id)); err != nil || canon != id {
			t.Fatalf("key %q forwarded as %q parses to %q, %v", id, FormatKey(id), canon, err)
		}
	})
}

// FuzzRequestFingerprint: a request's fingerprint does not depend on how
// its JSON body is spaced or ordered, and does depend on the method, the
// path and the body's meaning.
func FuzzRequestFingerprint(f *testing.F) {
	for _, s := range [][3]string{
		{"POST", "/charge?b=2&a=1", `{"amount":100,"currency":"eur"}`},
		{"PATCH", "/x", `[1,2,{"a":null}]`},
		{"POST", "/a%2Fb", `"x"`},
		{"POST", "/", `{"a":1,"a":2}`},
	} {
		f.Add(s[0], s[1], []byte(s[2]))
	}
	f.Fuzz(func(t *testing.T, method, target string, body []byte) {
		if method != "POST" && method != "PATCH" {
			method = "POST"
		}
		if !strings.HasPrefix(target, "/") || strings.ContainsAny(target, " \r\n\t#") {
			return
		}
		mk := func(m string) *http.Request {
			r, err := http.NewRequest(m, "http://idem"+target, nil)
			if err != nil {
				return nil
			}
			r.Header.Set("Content-Type", "application/json")
			return r
		}
		r := mk(method)
		if r == nil {
			return
		}
		fp, err := Fingerprint(r, body, nil)
		if err != nil {
			if !errors.Is(err, etcdstore.ErrInvalidParams) {
				t.Fatalf("error %v is not ErrInvalidParams", err)
			}
			return
		}
		// The canonical body is the same request.
		canon, err := canonjson.Canonical(body)
		if len(body) > 0 {
			if err != nil {
				t.Fatalf("Fingerprint accepted %q that canonjson refuses: %v", body, err)
			}
			if fp2, err := Fingerprint(mk(method), canon, nil); err != nil || fp2 != fp {
				t.Fatalf("%q and its canonical form %q fingerprint differently (%v)", body, canon, err)
			}
		}
		// Another method, or another body, is another request.
		other := "PATCH"
		if method == "PATCH" {
			other = "POST"
		}
		if fp3, _ := Fingerprint(mk(other), body, nil); fp3 == fp {
			t.Fatalf("%s and %s of %q share a fingerprint", method, other, body)
		}
		wrapped := append(append([]byte(`{"wrapped":`), canon...), '}')
		if len(body) > 0 {
			if fp4, err := Fingerprint(mk(method), wrapped, nil); err == nil && fp4 == fp {
				t.Fatalf("%q and %q share a fingerprint", body, wrapped)
			}
		}
	})
}
