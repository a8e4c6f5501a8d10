package idemhttp

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"mime"
	"net/http"
	"slices"
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
	if isJSON(r.Header.Get("Content-Type")) && len(body) > 0 {
		c, err := canonjson.Canonical(body)
		if err != nil {
			return etcdstore.Fingerprint{}, fmt.Errorf("request body: %w: %w", etcdstore.ErrInvalidParams, err)
		}
		body = c
	}
	h := sha256.New()
	field(h, "idem-http-1")
	field(h, r.Method)
	field(h, r.URL.EscapedPath())
	field(h, canonicalQuery(r.URL.RawQuery))
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	field(h, mt) // {"a":1} as text/plain is another request than as JSON
	field(h, string(body))
	for _, name := range headers {
		field(h, http.CanonicalHeaderKey(name))
		vs := r.Header.Values(name)
		field(h, fmt.Sprint(len(vs)))
		for _, v := range vs {
			field(h, v)
		}
	}
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

// field writes s length-prefixed, so no two field sequences hash alike.
func field(h hash.Hash, s string) {
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(s)))])
	h.Write([]byte(s))
}

// isJSON reports whether a Content-Type is JSON: application/json or any
// +json suffix type.
func isJSON(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return false
	}
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}
