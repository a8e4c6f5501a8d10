package idemhttp

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"

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
