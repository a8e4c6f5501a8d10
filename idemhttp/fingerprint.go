package idemhttp

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/canonjson"
)

// Fingerprint fingerprints a request: method, path, query (its raw pairs
// sorted by name), the media type, the body (in canonical JSON form when the
// content type is JSON, raw bytes otherwise) and the values of the named
// headers. A JSON body that has no
// canonical form (repeated members, numbers that do not survive a float64
// round trip, malformed) is an error wrapping etcdstore.ErrInvalidParams.
func Fingerprint(r *http.Request, body []byte, headers []string) (etcdstore.Fingerprint, error) {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err == nil && isJSONType(mt) && len(body) > 0 {
		c, err := canonjson.Canonical(body)
		if err != nil {
			return etcdstore.Fingerprint{}, fmt.Errorf("request body: %w: %w", etcdstore.ErrInvalidParams, err)
		}
		body = c
	}
	// The fields go to the hash length-prefixed, the small ones through
	// one buffer (no allocation per field), the body as it is.
	var small [512]byte
	buf := field(small[:0], "idem-http-1")
	buf = field(buf, r.Method)
	buf = field(buf, r.URL.EscapedPath())
	buf = field(buf, canonicalQuery(r.URL.RawQuery))
	buf = field(buf, mt) // {"a":1} as text/plain is another request than as JSON
	buf = binary.AppendUvarint(buf, uint64(len(body)))
	h := sha256.New()
	h.Write(buf)
	h.Write(body)
	buf = buf[:0]
	for _, name := range headers {
		buf = field(buf, http.CanonicalHeaderKey(name))
		vs := r.Header.Values(name)
		buf = field(buf, strconv.Itoa(len(vs)))
		for _, v := range vs {
			buf = field(buf, v)
		}
	}
	h.Write(buf)
	var fp etcdstore.Fingerprint
	h.Sum(fp[:0])
	return fp, nil
}

// canonicalQuery orders a raw query's pairs by name, keeping the order of
// repeated names and every pair as sent: decoding first would drop
// malformed pairs and let two different queries collide.
func canonicalQuery(raw string) string {
	if raw == "" {
		return ""
	}
	pairs := strings.Split(raw, "&")
	slices.SortStableFunc(pairs, func(a, b string) int {
		na, _, _ := strings.Cut(a, "=")
		nb, _, _ := strings.Cut(b, "=")
		return strings.Compare(na, nb)
	})
	return strings.Join(pairs, "&")
}

// field appends s length-prefixed, so no two field sequences hash alike.
func field(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

// isJSON reports whether a Content-Type is JSON: application/json or any
// +json suffix type.
func isJSON(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && isJSONType(mt)
}

// isJSONType reports whether a parsed media type is JSON.
func isJSONType(mt string) bool { return mt == "application/json" || strings.HasSuffix(mt, "+json") }
