package idemgrpc

import (
	"context"
	"fmt"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
)

// TenantFunc returns the tenant of a call: the authenticated caller, never
// a value the caller merely claims. Config.Tenant takes one; an error
// refuses the call (UNAUTHENTICATED for ErrUnauthenticated, PERMISSION_DENIED
// otherwise) before anything is claimed.
type TenantFunc = func(ctx context.Context, fullMethod string) (string, error)

// ErrUnauthenticated is returned by a TenantFunc for a call without valid
// credentials (the same error as idemhttp's).
var ErrUnauthenticated = idemhttp.ErrUnauthenticated

// FixedTenant puts every call in one tenant: the default
// (etcdstore.DefaultTenant), right for a service with one caller, or whose
// callers may share keys. Callers that must not see each other's replays
// need their own tenants: CertTenant, BearerTenant.
func FixedTenant(tenant string) TenantFunc {
	return func(context.Context, string) (string, error) { return tenant, nil }
}

// Unauthenticated refuses every call: the end of a chain of
// authenticators, when calls without credentials must not fall into a
// default tenant.
func Unauthenticated() TenantFunc {
	return func(context.Context, string) (string, error) {
		return "", fmt.Errorf("%w: no client certificate or bearer token", ErrUnauthenticated)
	}
}

// CertTenant takes the tenant from the verified client certificate of a
// TLS connection (the peer's credentials.TLSInfo): its subject's common
// name, which must be a valid tenant. Calls without a verified
// certificate get fallback. The server's tls.Config must verify client
// certificates (ClientAuth VerifyClientCertIfGiven or
// RequireAndVerifyClientCert): an unverified certificate is never read.
func CertTenant(fallback TenantFunc) TenantFunc {
	return func(ctx context.Context, method string) (string, error) {
		p, ok := peer.FromContext(ctx)
		if !ok {
			return fallback(ctx, method)
		}
		info, ok := p.AuthInfo.(credentials.TLSInfo)
		if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
			return fallback(ctx, method)
		}
		cn := info.State.VerifiedChains[0][0].Subject.CommonName
		if err := etcdstore.ValidateTenant(cn); err != nil {
			return "", fmt.Errorf("%w: client certificate common name: %w", ErrUnauthenticated, err)
		}
		return cn, nil
	}
}

// BearerTenant takes the tenant from an "authorization: Bearer" token in
// the call's metadata, found in tokens (idemhttp.ParseTokens: the same
// tokens file as the HTTP edge's). A call with an authorization that is
// not a known bearer token is refused; one without gets fallback.
func BearerTenant(tokens *idemhttp.Tokens, fallback TenantFunc) TenantFunc {
	return func(ctx context.Context, method string) (string, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		vs := md.Get("authorization")
		if len(vs) == 0 {
			return fallback(ctx, method)
		}
		return tokens.Authorize(vs)
	}
}
