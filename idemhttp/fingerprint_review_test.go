package idemhttp

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/rand"
	"mime"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/canonjson"
)

// The fingerprint of 67a9305, copied.
func oldFingerprint(r *http.Request, body []byte, headers []string) (etcdstore.Fingerprint, error) {
	if oldIsJSON(r.Header.Get("Content-Type")) && len(body) > 0 {
		c, err := canonjson.Canonical(body)
		if err != nil {
			return etcdstore.Fingerprint{}, fmt.Errorf("request body: %w: %w", etcdstore.ErrInvalidParams, err)
		}
		body = c
	}
	h := sha256.New()
	oldField(h, "idem-http-1")
	oldField(h, r.Method)
	oldField(h, r.URL.EscapedPath())
	oldField(h, canonicalQuery(r.URL.RawQuery))
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	oldField(h, mt)
	oldField(h, string(body))
	for _, name := range headers {
		oldField(h, http.CanonicalHeaderKey(name))
		vs := r.Header.Values(name)
		oldField(h, fmt.Sprint(len(vs)))
		for _, v := range vs {
			oldField(h, v)
		}
	}
	var fp etcdstore.Fingerprint
	h.Sum(fp[:0])
	return fp, nil
}

func oldField(h hash.Hash, s string) {
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(s)))])
	h.Write([]byte(s))
}

func oldIsJSON(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return false
	}
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

func TestReviewFingerprintSameStreamAsBefore(t *testing.T) {
	rnd := rand.New(rand.NewSource(1))
	cts := []string{"", "application/json", "APPLICATION/JSON; charset=utf-8", "text/plain; charset", "application/json; charset",
		"application/x+json;;", "text/plain", "application/problem+json", "a/b; x=\"unterminated", "multipart/form-data; boundary=x",
		"application/json; charset=utf-8; charset=latin1", ";", "/", "text/", "application/json ;q=1", strings.Repeat("x", 600) + "/json"}
	methods := []string{"POST", "PUT", "PATCH", "DELETE", "GET", ""}
	paths := []string{"/", "/a%2Fb", "/" + strings.Repeat("p", 510), "/" + strings.Repeat("é", 300), "/x y", ""}
	queries := []string{"", "b=2&a=1", "a", "&&", "a=1&a=0&" + strings.Repeat("q", 600)}
	bodies := []string{"", `{"b":1,"a":[1,2]}`, "not json", `{"a":1,"a":2}`, strings.Repeat("z", 130), strings.Repeat("\x00", 20000), "[]", " "}
	hdrNames := []string{"X-A", "authorization", "Missing", "x-long"}
	n := 0
	for i := 0; i < 20000; i++ {
		r := httptest.NewRequest("POST", "/", nil)
		r.Method = methods[rnd.Intn(len(methods))]
		r.URL.Path = paths[rnd.Intn(len(paths))]
		r.URL.RawPath = ""
		r.URL.RawQuery = queries[rnd.Intn(len(queries))]
		if ct := cts[rnd.Intn(len(cts))]; ct != "" || rnd.Intn(2) == 0 {
			r.Header.Set("Content-Type", ct)
		}
		for k := rnd.Intn(4); k > 0; k-- {
			name := hdrNames[rnd.Intn(len(hdrNames))]
			v := strings.Repeat("v", rnd.Intn(700))
			r.Header.Add(name, v)
		}
		var names []string
		for k := rnd.Intn(4); k > 0; k-- {
			names = append(names, hdrNames[rnd.Intn(len(hdrNames))])
		}
		body := []byte(bodies[rnd.Intn(len(bodies))])
		if rnd.Intn(5) == 0 {
			body = make([]byte, rnd.Intn(2000))
			rnd.Read(body)
		}
		want, werr := oldFingerprint(r, bytes.Clone(body), names)
		got, gerr := Fingerprint(r, bytes.Clone(body), names)
		if (werr == nil) != (gerr == nil) || got != want {
			t.Fatalf("case %d (%s %q ct %q body %q headers %v): got %x, %v; before %x, %v", i, r.Method, r.URL, r.Header.Get("Content-Type"), body, names, got, gerr, want, werr)
		}
		n++
	}
	t.Logf("%d cases", n)
}

// readBody on odd readers: short reads, errors mid-way, the limit.
func TestReviewReadBodyOddReaders(t *testing.T) {
	data := []byte(strings.Repeat("abcdefgh", 100))
	for _, tc := range []struct {
		name     string
		r        io.Reader
		declared int64
		want     []byte
		wantErr  bool
	}{
		{"one byte at a time", iotest.OneByteReader(bytes.NewReader(data)), int64(len(data)), data, false},
		{"half reads", iotest.HalfReader(bytes.NewReader(data)), int64(len(data)), data, false},
		{"data with EOF", iotest.DataErrReader(bytes.NewReader(data)), int64(len(data)), data, false},
		{"more than declared", bytes.NewReader(data), 10, data, false},
		{"fewer than declared", bytes.NewReader(data), int64(len(data)) + 1, nil, true},
		{"error mid-way", io.MultiReader(bytes.NewReader(data[:10]), iotest.ErrReader(errors.New("boom"))), int64(len(data)), nil, true},
		{"error after the declared bytes", io.MultiReader(bytes.NewReader(data), iotest.ErrReader(errors.New("boom"))), int64(len(data)), nil, true},
		{"unknown length", iotest.HalfReader(bytes.NewReader(data)), -1, data, false},
	} {
		got, err := readBody(tc.r, tc.declared)
		if (err != nil) != tc.wantErr || !bytes.Equal(got, tc.want) {
			t.Errorf("%s: %d bytes, %v", tc.name, len(got), err)
		}
	}
}

// Over-limit bodies still give the 413 problem, whatever Content-Length says.
func TestReviewParseOverLimitIs413(t *testing.T) {
	const limit = 100
	m := &Middleware{cfg: Config{MaxRequestBody: limit, Tenant: FixedTenant(etcdstore.DefaultTenant)}}
	for _, tc := range []struct {
		name     string
		body     string
		declared int64
		status   int
	}{
		{"declared at the limit, one more sent", strings.Repeat("x", limit+1), limit, 413},
		{"declared small, far more sent", strings.Repeat("x", 10*limit), 5, 413},
		{"declared unknown, more sent", strings.Repeat("x", limit+1), -1, 413},
		{"at the limit", strings.Repeat("x", limit), limit, 0},
		{"declared more than sent", strings.Repeat("x", 10), 20, 400},
	} {
		r := httptest.NewRequest("POST", "/x", strings.NewReader(tc.body))
		r.ContentLength = tc.declared
		w := httptest.NewRecorder()
		_, p := m.parse(w, r, "k")
		status := 0
		if p != nil {
			status = p.Status
		}
		if status != tc.status {
			t.Errorf("%s: status %d, want %d (%+v)", tc.name, status, tc.status, p)
		}
	}
}

// A body's buffer is allocated at its declared length before a byte has
// arrived: a client that declares the limit (1 MiB by default) and sends
// a few bytes, slowly, makes the server hold the limit per connection,
// where io.ReadAll held what arrived. Memory per request should follow the
// bytes received, not the bytes promised.
func TestReviewReadBodyAllocatesWhatArrives(t *testing.T) {
	const declared = DefaultMaxRequestBody
	r := io.MultiReader(strings.NewReader("{\"a\":1}"), iotest.ErrReader(io.ErrUnexpectedEOF))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := readBody(r, declared)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a body short of its Content-Length was read without an error")
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 64<<10 {
		t.Fatalf("reading 7 bytes of a body that declared %d allocated %d bytes", declared, got)
	}
}
