package etcdstore

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/idem-dev/idem/internal/canonjson"
)

// Fingerprint is the SHA-256 of a request's parameters in canonical form. It
// is stored with the claim; a later request with the same key and a different
// fingerprint is refused with ErrMismatch.
type Fingerprint [sha256.Size]byte

// String returns the fingerprint in hex.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// FingerprintOf fingerprints params: in canonical JSON form when params is
// valid UTF-8 JSON (so whitespace, object member order and number spelling
// do not matter: close to RFC 8785, the JSON Canonicalization Scheme), and
// as raw bytes otherwise. It returns an error wrapping ErrInvalidParams for
// JSON that has no single canonical form: an object that repeats a member
// name (parsers disagree on which one wins), a lone surrogate escape,
// nesting deeper than 256, or a non-integer number that a float64 round trip
// would change (two such numbers would otherwise share one form). Integer
// literals are kept digit for digit, so large ids survive.
func FingerprintOf(params []byte) (Fingerprint, error) {
	c, err := canonjson.Canonical(params) // one pass: not JSON at all is ErrNotJSON
	switch {
	case errors.Is(err, canonjson.ErrNotJSON):
		return sha256.Sum256(params), nil
	case err != nil:
		return Fingerprint{}, fmt.Errorf("%w: %w", ErrInvalidParams, err)
	}
	return sha256.Sum256(c), nil
}
