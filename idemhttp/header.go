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
// A repeated header, or a list in one header, is refused: which key would
// be meant? See ParseKey for the forms of one key.
func keyFromHeader(h http.Header) (string, bool, error) {
	vs := h.Values(HeaderKey)
	switch len(vs) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, fmt.Errorf("%w: sent %d times", ErrBadKeyHeader, len(vs))
	}
	id, err := ParseKey(vs[0])
	return id, true, err
}

// ParseKey reads an Idempotency-Key header value. A key may be sent bare
// (abc, as Stripe does) or as an RFC 8941 sf-string ("abc", with \" and \\
// escapes: the form of the IETF draft); both name the same key. An empty key
// in either form ("" included) is an error, and so are sf-string parameters
// ("abc";p=1): idem uses none, and a key whose meaning depends on them
// would not be one key. What the key may hold is etcdstore.Key's to say
// (visible ASCII but '/'; an sf-string's space is refused there).
func ParseKey(v string) (string, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return "", fmt.Errorf("%w: empty", ErrBadKeyHeader)
	}
	if v[0] != '"' {
		if strings.ContainsRune(v, '"') {
			return "", fmt.Errorf("%w: stray quote in a bare key (quote the whole key as an sf-string: \"...\")", ErrBadKeyHeader)
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
			switch rest := strings.TrimSpace(v[i+1:]); {
			case rest == "" && b.Len() == 0:
				return "", fmt.Errorf("%w: empty", ErrBadKeyHeader)
			case rest == "":
				return b.String(), nil
			case rest[0] == ';':
				return "", fmt.Errorf("%w: parameters (%s) are not part of an idempotency key, and idem uses none: send the key alone", ErrBadKeyHeader, rest)
			}
			return "", fmt.Errorf("%w: data after the quoted key (a list?)", ErrBadKeyHeader)
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: unterminated quoted key", ErrBadKeyHeader)
}

// FormatKey returns the one form in which idem forwards a key upstream:
// bare when it can be (no quote or backslash in it), an sf-string
// otherwise. The same key always goes out the same way, whichever form the
// client sent.
func FormatKey(id string) string {
	if !strings.ContainsAny(id, `"\`) {
		return id
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(id) + `"`
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

// DefaultDenyHeaders are the response headers never saved by default.
var DefaultDenyHeaders = []string{"Set-Cookie"}

// liveHeaders returns the response headers a client may be sent: all but
// hop-by-hop ones, those named by Connection (RFC 9110 §7.6.1), trailers,
// Content-Length (it is recomputed) and Date (a replay has its own). The
// first caller gets these.
func liveHeaders(h http.Header) http.Header {
	drop := map[string]bool{"Content-Length": true, "Date": true}
	for _, k := range hopByHop {
		drop[k] = true
	}
	for _, name := range []string{"Connection", "Trailer"} {
		for _, v := range h.Values(name) {
			for _, f := range strings.Split(v, ",") {
				drop[http.CanonicalHeaderKey(strings.TrimSpace(f))] = true
			}
		}
	}
	out := make(http.Header, len(h))
	for k, vs := range h {
		if drop[http.CanonicalHeaderKey(k)] || strings.HasPrefix(k, http.TrailerPrefix) {
			continue
		}
		out[k] = append([]string(nil), vs...)
	}
	return out
}

// savedHeaders returns the headers of live worth saving and replaying: as
// the middleware's DenyHeaders and AllowHeaders say.
func (m *Middleware) savedHeaders(live http.Header) map[string][]string {
	out := make(map[string][]string, len(live))
	for k, vs := range live {
		ck := http.CanonicalHeaderKey(k)
		if m.deny[ck] || m.allow != nil && !m.allow[ck] {
			continue
		}
		out[k] = vs
	}
	return out
}
