package fencing

import (
	"fmt"
	"sync"
)

// Checker refuses tokens lower than the highest one it has accepted for the
// same resource. A resource is whatever one key's work writes: an order, an
// account, a row. The zero Checker is ready to use and safe for concurrent use
// by multiple goroutines.
//
// A Checker lives in memory and fences only the writes that go through it.
// A downstream database must keep the highest token beside the data and
// compare it in the same statement that writes, for example in PostgreSQL:
//
//	-- charges(order_id PRIMARY KEY, amount, fence BIGINT NOT NULL)
//	INSERT INTO charges (order_id, amount, fence) VALUES ($1, $2, $3)
//	ON CONFLICT (order_id) DO UPDATE
//	  SET amount = EXCLUDED.amount, fence = EXCLUDED.fence
//	  WHERE charges.fence <= EXCLUDED.fence;
//	-- 0 rows affected: a newer owner has written; this worker is fenced out.
//
// Equal tokens are accepted: the owner of a claim may write more than once.
type Checker struct {
	mu      sync.Mutex
	highest map[string]Token
}

// Check accepts t for resource when t is at least the highest token accepted
// so far, and records it. Otherwise it returns a *StaleError (errors.Is
// ErrStale) and records nothing. Check returns an error wrapping
// ErrInvalidToken when t is not positive.
func (c *Checker) Check(resource string, t Token) error {
	if t <= 0 {
		return fmt.Errorf("resource %q: token %d: %w", resource, t, ErrInvalidToken)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if h := c.highest[resource]; t < h {
		return &StaleError{Resource: resource, Token: t, Highest: h}
	}
	if c.highest == nil {
		c.highest = make(map[string]Token)
	}
	c.highest[resource] = t
	return nil
}

// Highest returns the highest token accepted for resource, or 0.
func (c *Checker) Highest(resource string) Token {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.highest[resource]
}

// Forget drops what the Checker knows of resource, for example once the
// resource's idempotency key is past its retention and can never be claimed
// again with an older token.
func (c *Checker) Forget(resource string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.highest, resource)
}
