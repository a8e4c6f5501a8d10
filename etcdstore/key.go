package etcdstore

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
)

// Limits on keys and tenants.
const (
	// MaxKeyLen is the longest idempotency key, in bytes (Stripe's limit).
	MaxKeyLen = 255
	// MaxTenantLen is the longest tenant name.
	MaxTenantLen = 64
	// DefaultTenant is the tenant of a Key whose Tenant is empty.
	DefaultTenant = "default"
)

// Key names one logical operation: an idempotency key, scoped by tenant.
// Two tenants' keys never collide, whatever the key strings.
type Key struct {
	// Tenant scopes the key. Empty means DefaultTenant. 1 to MaxTenantLen
	// characters of [A-Za-z0-9._-], starting with a letter or digit.
	Tenant string
	// ID is the client's idempotency key: 1 to MaxKeyLen bytes of visible
	// ASCII (0x21-0x7e) other than '/', and not "." or "..", so that every key
	// is one URL path segment (GET /v1/keys/{key}). A V4 UUID is a good choice.
	ID string
}

// String returns "tenant/id" with the id quoted when it needs to be.
func (k Key) String() string {
	return k.tenant() + "/" + strconv.Quote(k.ID)
}

func (k Key) tenant() string {
	if k.Tenant == "" {
		return DefaultTenant
	}
	return k.Tenant
}

// Validate reports whether k is well formed, with an error naming what is
// wrong. Every store call validates its key before talking to etcd.
func (k Key) Validate() error {
	if err := ValidateTenant(k.tenant()); err != nil {
		return err
	}
	return validateID(k.ID)
}

func validateID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	}
	if len(id) > MaxKeyLen {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidKey, len(id), MaxKeyLen)
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c == ' ' {
			return fmt.Errorf("%w: a space at offset %d: a key is visible ASCII (0x21-0x7e) without '/'", ErrInvalidKey, i)
		} else if c < 0x21 || c > 0x7e {
			return fmt.Errorf("%w: byte %#02x at offset %d is not visible ASCII", ErrInvalidKey, c, i)
		} else if c == '/' {
			return fmt.Errorf("%w: '/' at offset %d: a key is one path segment", ErrInvalidKey, i)
		}
	}
	if id == "." || id == ".." {
		return fmt.Errorf("%w: %q is a relative path segment", ErrInvalidKey, id)
	}
	return nil
}

// ValidateTenant reports whether t is a well-formed tenant name.
func ValidateTenant(t string) error {
	if t == "" {
		return fmt.Errorf("%w: empty", ErrInvalidTenant)
	}
	if len(t) > MaxTenantLen {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidTenant, len(t), MaxTenantLen)
	}
	for i := 0; i < len(t); i++ {
		c := t[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return fmt.Errorf("%w: %q: character %q at offset %d", ErrInvalidTenant, t, c, i)
		}
	}
	return nil
}

// keyspace lays out idem's keys under one prefix:
//
//	<prefix>k/<tenant>/<id>   records
//	<prefix>o/<owner>         owner liveness keys, on session leases
//	<prefix>l/...             retention bucket keys, on their own leases
//	<prefix>x/<lease>         sweepers' locks, on their session leases
//	<prefix>z/...             compression dictionaries, on retention leases
//	<prefix>epoch             the shard epoch (WithEpochs)
//	<prefix>j/<name>          values of packages built on the store (Value)
//
// A tenant cannot contain '/', so "<prefix>k/<tenant>/" is a prefix of exactly
// that tenant's records, whatever bytes the id holds.
type keyspace struct {
	prefix string
}

func (ks keyspace) record(k Key) string { return ks.prefix + "k/" + k.tenant() + "/" + k.ID }
func (ks keyspace) tenant(t string) string {
	return ks.prefix + "k/" + t + "/"
}
func (ks keyspace) records() string { return ks.prefix + "k/" }
func (ks keyspace) owners() string  { return ks.prefix + "o/" }
func (ks keyspace) owner(id string) string {
	return ks.prefix + "o/" + id
}
func (ks keyspace) buckets() string { return ks.prefix + "l/" }

// sweeps is where a sweeper locks the lease it sweeps (<prefix>x/<lease id>).
func (ks keyspace) sweeps() string { return ks.prefix + "x/" }

// dictionaries is where compression dictionaries live (<prefix>z/current,
// <prefix>z/<id>/<lease>).
func (ks keyspace) dictionaries() string { return ks.prefix + "z/" }

// values is where packages built on the store keep values of their own
// (<prefix>j/<name>: package jobs' schedule cursors).
func (ks keyspace) values() string { return ks.prefix + "j/" }

// parseRecord splits a record's etcd key back into its Key.
func (ks keyspace) parseRecord(etcdKey string) (Key, bool) {
	rest, ok := strings.CutPrefix(etcdKey, ks.records())
	if !ok {
		return Key{}, false
	}
	tenant, id, ok := strings.Cut(rest, "/")
	if !ok {
		return Key{}, false
	}
	return Key{Tenant: tenant, ID: id}, true
}

// Digest returns a short, stable name of the key for logs, that does not
// reveal it: the first 8 bytes of the SHA-256 of the tenant-qualified key
// (k.String()), in hex. idem's logs name keys this way unless told to log
// them in clear, so the same key has the same digest in every process's
// log.
func (k Key) Digest() string {
	sum := sha256.Sum256([]byte(k.String()))
	return hex.EncodeToString(sum[:8])
}

// Redact returns err's text with the key replaced by its digest, for logs
// and traces that must not hold keys.
func (k Key) Redact(err error) string { return k.redact(err) }

// redact returns err's text with k replaced by its digest.
func (k Key) redact(err error) string {
	if err == nil {
		return ""
	}
	return strings.ReplaceAll(err.Error(), k.String(), "key#"+k.Digest())
}
