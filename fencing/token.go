package fencing

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Header is the HTTP request header that carries a fencing token downstream.
const Header = "Idempotency-Fence"

// Token is a fencing token: the etcd revision of the claim that authorises a
// piece of work. The zero Token means "no token".
type Token int64

// String returns the token in decimal, the form used in headers and logs.
func (t Token) String() string { return strconv.FormatInt(int64(t), 10) }

// Parse parses a token from its decimal form. It accepts only positive decimal
// integers without sign, spaces or leading zeros, so a token has exactly one
// spelling.
func Parse(s string) (Token, error) {
	if s == "" {
		return 0, fmt.Errorf("parse fencing token: %w", ErrInvalidToken)
	}
	if len(s) > 1 && s[0] == '0' {
		return 0, fmt.Errorf("parse fencing token %q: leading zero: %w", s, ErrInvalidToken)
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, fmt.Errorf("parse fencing token %q: not a decimal integer: %w", s, ErrInvalidToken)
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("parse fencing token %q: out of range: %w", s, ErrInvalidToken)
	}
	return Token(n), nil
}

type ctxKey struct{}

// NewContext returns a copy of ctx that carries t.
func NewContext(ctx context.Context, t Token) context.Context {
	return context.WithValue(ctx, ctxKey{}, t)
}

// FromContext returns the token carried by ctx, and whether there was one.
func FromContext(ctx context.Context) (Token, bool) {
	t, ok := ctx.Value(ctxKey{}).(Token)
	return t, ok && t > 0
}

// SetHeader sets the fencing token header on h, replacing any value a client
// may have sent.
func SetHeader(h http.Header, t Token) {
	h.Set(Header, t.String())
}

// FromHeader returns the token in h. It returns (0, false, nil) when the
// header is absent, and an error wrapping ErrInvalidToken when the header is
// repeated or malformed: a request with two tokens has no defined order.
func FromHeader(h http.Header) (Token, bool, error) {
	vs := h.Values(Header)
	switch len(vs) {
	case 0:
		return 0, false, nil
	case 1:
	default:
		return 0, false, fmt.Errorf("header %s sent %d times: %w", Header, len(vs), ErrInvalidToken)
	}
	t, err := Parse(strings.TrimSpace(vs[0]))
	if err != nil {
		return 0, false, err
	}
	return t, true, nil
}
