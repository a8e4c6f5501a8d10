package fencing

import (
	"errors"
	"fmt"
)

// ErrInvalidToken is returned when a token is malformed: empty, signed,
// non-decimal, zero, out of range or repeated in a header.
var ErrInvalidToken = errors.New("invalid fencing token")

// ErrStale is returned (wrapped in a *StaleError) when a token is lower than
// the highest token already accepted for the same resource. The write it
// guards must not happen: a newer owner has taken over.
var ErrStale = errors.New("stale fencing token")

// StaleError reports a refused token and the token that beat it.
type StaleError struct {
	Resource string
	Token    Token // the refused token
	Highest  Token // the highest token accepted for Resource
}

func (e *StaleError) Error() string {
	return fmt.Sprintf("resource %q: token %d is lower than %d: %v", e.Resource, e.Token, e.Highest, ErrStale)
}

// Is reports whether target is ErrStale.
func (e *StaleError) Is(target error) bool { return target == ErrStale }
