package idemhttp

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Header names.
const (
	// HeaderKey carries the client's idempotency key.
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is "true" on a response replayed from an earlier request.
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderRetention tells clients, in seconds, how long idem keeps a key
	// after its last write: retries must stop well inside it.
	HeaderRetention = "Idempotency-Retention"
)

// ErrBadKeyHeader is returned when the Idempotency-Key header is repeated or
// badly quoted.
var ErrBadKeyHeader = errors.New("bad Idempotency-Key header")

// keyFromHeader returns the request's idempotency key, "" when there is none.
// The key may be sent bare (as Stripe does) or as an RFC 8941 sf-string
// ("..." with \" and \\ escapes), the form of the IETF Idempotency-Key
// draft; both name the same key. A repeated header, or a list in one header,
// is refused: which key would be meant?
func keyFromHeader(h http.Header) (string, error) {
	vs := h.Values(HeaderKey)
	switch len(vs) {
	case 0:
		return "", nil
	case 1:
	default:
		return "", fmt.Errorf("%w: sent %d times", ErrBadKeyHeader, len(vs))
	}
	v := strings.TrimSpace(vs[0])
	if v == "" {
		return "", fmt.Errorf("%w: empty", ErrBadKeyHeader)
	}
	if v[0] != '"' {
		if strings.ContainsRune(v, '"') {
			return "", fmt.Errorf("%w: stray quote in a bare key", ErrBadKeyHeader)
		}
		return v, nil
	}
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; c {
		case '\\':
			if i+1 >= len(v) || v[i+1] != '"' && v[i+1] != '\\' {
				return "", fmt.Errorf("%w: bad escape in quoted key", ErrBadKeyHeader)
			}
			i++
			b.WriteByte(v[i])
		case '"':
			if i != len(v)-1 {
				return "", fmt.Errorf("%w: data after the quoted key (a list?)", ErrBadKeyHeader)
			}
			return b.String(), nil
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: unterminated quoted key", ErrBadKeyHeader)
}

// preferWait returns the wait=N preference of an RFC 7240 Prefer header, in
// seconds, capped at limit.
func preferWait(h http.Header, limit time.Duration) time.Duration {
	for _, v := range h.Values("Prefer") {
		for _, pref := range strings.Split(v, ",") {
			name, val, ok := strings.Cut(strings.TrimSpace(pref), "=")
			if !ok || !strings.EqualFold(strings.TrimSpace(name), "wait") {
				continue
			}
			n, err := strconv.Atoi(strings.Trim(strings.TrimSpace(val), `"`))
			if err != nil || n <= 0 {
				continue
			}
			return min(time.Duration(n)*time.Second, limit)
		}
	}
	return 0
}

// hopByHop are the headers a proxy must not forward or save (RFC 9110 §7.6.1).
var hopByHop = []string{
	"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// savedHeaders returns the response headers worth replaying: all but
// hop-by-hop ones, those named by Connection, and Content-Length (it is
// recomputed) and Date (a replay has its own).
func savedHeaders(h http.Header) map[string][]string {
	drop := map[string]bool{"Content-Length": true, "Date": true}
	for _, k := range hopByHop {
		drop[k] = true
	}
	for _, v := range h.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			drop[http.CanonicalHeaderKey(strings.TrimSpace(f))] = true
		}
	}
	out := make(map[string][]string, len(h))
	for k, vs := range h {
		if !drop[http.CanonicalHeaderKey(k)] {
			out[k] = append([]string(nil), vs...)
		}
	}
	return out
}
