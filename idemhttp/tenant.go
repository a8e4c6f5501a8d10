package idemhttp

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"

	"github.com/idem-dev/idem/etcdstore"
)

// ErrUntrustedTenant is returned when a request names its tenant in a header
// but does not come from a trusted source.
var ErrUntrustedTenant = errors.New("tenant header from an untrusted source")

// TenantFunc returns the tenant of a request: the authenticated caller, never
// anything the caller merely claims.
type TenantFunc func(r *http.Request) (string, error)

// FixedTenant puts every request in one tenant. It is the default, with
// etcdstore.DefaultTenant, for deployments without authentication.
func FixedTenant(tenant string) TenantFunc {
	return func(*http.Request) (string, error) { return tenant, nil }
}

// TrustedHeaderTenant takes the tenant from header, but only from a request
// whose direct peer address is in trusted (an authenticating proxy in front
// of idem); other requests get fallback. A request from elsewhere that sends
// the header is refused with ErrUntrustedTenant rather than silently put in
// another tenant.
func TrustedHeaderTenant(header string, trusted []netip.Prefix, fallback TenantFunc) TenantFunc {
	return func(r *http.Request) (string, error) {
		vs := r.Header.Values(header)
		if len(vs) == 0 {
			return fallback(r)
		}
		if !fromTrusted(r, trusted) {
			return "", fmt.Errorf("%w: %s from %s", ErrUntrustedTenant, header, r.RemoteAddr)
		}
		if len(vs) > 1 {
			return "", fmt.Errorf("%w: header %s sent %d times", etcdstore.ErrInvalidTenant, header, len(vs))
		}
		if err := etcdstore.ValidateTenant(vs[0]); err != nil {
			return "", err
		}
		return vs[0], nil
	}
}

// GuardTenantHeader refuses with 403 untrusted-tenant every request that
// carries header from a peer outside trusted, before next sees it: the
// requests the middleware passes through unclaimed too, so that an
// upstream that believes the header (it trusts idem to have checked it)
// never gets one that a client made up. Use it around the middleware when
// the tenant comes from TrustedHeaderTenant.
func GuardTenantHeader(header string, trusted []netip.Prefix, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.Header.Values(header)) > 0 && !fromTrusted(r, trusted) {
			NewProblem(http.StatusForbidden, KindUntrustedTenant,
				fmt.Sprintf("%s is honoured only from a trusted proxy; %s is not one", header, r.RemoteAddr)).Write(w)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func fromTrusted(r *http.Request, trusted []netip.Prefix) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	ip = ip.Unmap()
	for _, p := range trusted {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// ErrUnauthenticated is returned by a TenantFunc when a request carries no
// valid credentials.
var ErrUnauthenticated = errors.New("unauthenticated")

// Unauthenticated refuses every request with ErrUnauthenticated: the end of
// a chain of authenticators, when requests without credentials must not
// fall into a default tenant.
func Unauthenticated() TenantFunc {
	return func(*http.Request) (string, error) {
		return "", fmt.Errorf("%w: no client certificate or bearer token", ErrUnauthenticated)
	}
}

// CertTenant takes the tenant from the verified client certificate of a TLS
// request: its subject's common name, which must be a valid tenant. Requests
// without a verified certificate get fallback. The server's tls.Config must
// verify client certificates (ClientAuth VerifyClientCertIfGiven or
// RequireAndVerifyClientCert): an unverified certificate is never read.
func CertTenant(fallback TenantFunc) TenantFunc {
	return func(r *http.Request) (string, error) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 || len(r.TLS.VerifiedChains[0]) == 0 {
			return fallback(r)
		}
		cn := r.TLS.VerifiedChains[0][0].Subject.CommonName
		if err := etcdstore.ValidateTenant(cn); err != nil {
			return "", fmt.Errorf("%w: client certificate common name: %w", ErrUnauthenticated, err)
		}
		return cn, nil
	}
}

// Tokens maps bearer tokens to tenants. Tokens are held as SHA-256 digests,
// so a lookup compares digests, never the secret itself byte by byte.
type Tokens struct {
	tenants map[[sha256.Size]byte]string
}

// MinTokenLen is the shortest bearer token accepted in a tokens file: 16
// bytes carry 96 bits in base64, past guessing.
const MinTokenLen = 16

// ParseTokens reads a tokens file: one "tenant token" pair per line, blank
// lines and lines starting with '#' ignored. A tenant may have several
// tokens (rotation); a token names one tenant. Errors name the line.
func ParseTokens(data []byte) (*Tokens, error) {
	t := &Tokens{tenants: map[[sha256.Size]byte]string{}}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			return nil, fmt.Errorf("line %d: want \"tenant token\", got %d fields", i+1, len(f))
		}
		if err := etcdstore.ValidateTenant(f[0]); err != nil {
			return nil, fmt.Errorf("line %d: %w", i+1, err)
		}
		if len(f[1]) < MinTokenLen || !validToken(f[1]) {
			return nil, fmt.Errorf("line %d: token for %s must be at least %d characters of token68 (RFC 6750)", i+1, f[0], MinTokenLen)
		}
		d := sha256.Sum256([]byte(f[1]))
		if prev, ok := t.tenants[d]; ok {
			return nil, fmt.Errorf("line %d: token already given to tenant %s", i+1, prev)
		}
		t.tenants[d] = f[0]
	}
	if len(t.tenants) == 0 {
		return nil, errors.New("no tokens")
	}
	return t, nil
}

// validToken reports whether s is an RFC 6750 b64token: token characters,
// then optional trailing '=' padding.
func validToken(s string) bool {
	body := strings.TrimRight(s, "=")
	if body == "" {
		return false
	}
	for i := 0; i < len(body); i++ {
		c := body[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("-._~+/", c) >= 0) {
			return false
		}
	}
	return true
}

// Len is the number of tokens.
func (t *Tokens) Len() int { return len(t.tenants) }

// Tenant returns the tenant a bearer token names (compared by digest).
func (t *Tokens) Tenant(token string) (string, bool) {
	tenant, ok := t.tenants[sha256.Sum256([]byte(token))]
	return tenant, ok
}

// BearerTenant takes the tenant from an "Authorization: Bearer" token found
// in tokens. A request with an Authorization header that is not a known
// bearer token is refused with ErrUnauthenticated; one without the header
// gets fallback.
func BearerTenant(tokens *Tokens, fallback TenantFunc) TenantFunc {
	return func(r *http.Request) (string, error) {
		vs := r.Header.Values("Authorization")
		if len(vs) == 0 {
			return fallback(r)
		}
		return tokens.Authorize(vs)
	}
}

// Authorize returns the tenant of the values of an Authorization header
// (or gRPC "authorization" metadata): exactly one "Bearer" token, found in
// tokens; anything else is ErrUnauthenticated.
func (t *Tokens) Authorize(values []string) (string, error) {
	if len(values) != 1 {
		return "", fmt.Errorf("%w: Authorization sent %d times", ErrUnauthenticated, len(values))
	}
	scheme, token, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", fmt.Errorf("%w: Authorization is not a Bearer token", ErrUnauthenticated)
	}
	tenant, ok := t.Tenant(strings.TrimSpace(token))
	if !ok {
		return "", fmt.Errorf("%w: unknown bearer token", ErrUnauthenticated)
	}
	return tenant, nil
}
