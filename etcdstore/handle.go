package etcdstore

import (
	"context"
	"crypto/subtle"
	"fmt"
	"time"

	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"
)

// Handle identifies a claim outside the process that holds it: a remote
// worker keeps it between the calls of idem's HTTP API, which may reach
// different idem processes. Key, Attempt and Token identify the claim;
// Revision is the fence of the last write the handle saw, for information.
// The key and the token are no secret (anyone who can read the key learns
// them); the attempt id is: a Handle is a capability over its claim, to be
// given only to whoever runs the claim's work.
type Handle struct {
	Key      Key
	Attempt  string
	Token    fencing.Token
	Revision int64
}

// Handle returns the claim's current handle. It changes after each
// Checkpoint or Renew.
func (c *Claim) Handle() Handle {
	c.mu.Lock()
	defer c.mu.Unlock()
	return Handle{Key: c.key, Attempt: c.attempt, Token: c.token, Revision: c.rev}
}

// Attach returns a Claim for h, to complete, checkpoint, renew, release or
// abandon it from this process. It reads the record (linearizable), and
// returns an error wrapping ErrFenced unless the record is still in flight
// under h's claim: same token and attempt id, not abandoned. Only that claim writes records with its token and attempt id,
// so a handle whose revision is older (a checkpoint reply was lost) still
// attaches, at the current revision. The Claim is not registered as
// running here; its deadline timer starts when Done or Context is called.
func (s *Store) Attach(ctx context.Context, h Handle) (*Claim, error) {
	if err := h.Key.Validate(); err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	if h.Attempt == "" || h.Token <= 0 {
		return nil, fmt.Errorf("attach %s: %w: handle needs an attempt and a token", h.Key, ErrInvalidArgument)
	}
	rec, _, err := s.get(ctx, h.Key)
	if err != nil {
		return nil, err
	}
	if rec == nil || rec.State != InFlight || rec.Owner == "" || rec.Token != h.Token || !sameAttempt(rec.Attempt, h.Attempt) {
		return nil, fmt.Errorf("attach %s: %w", h.Key, ErrFenced)
	}
	c := s.newClaim(h.Key, rec.Fingerprint, rec.Attempt, rec.Owner)
	c.won(rec, nil)
	return c, nil
}

// Renew moves the claim's deadline to d from now: a heartbeat for work that
// runs longer than its first deadline. It is a fenced write like
// Checkpoint, and an error wrapping ErrFenced means the claim was already
// taken over. Renewing a claim that had no deadline gives it one. Renew
// before the deadline: once it has passed, the claim's context has ended
// and others may already have taken the key over.
func (c *Claim) Renew(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("renew %s: %w: deadline %v must be positive", c.key, ErrInvalidArgument, d)
	}
	// The deadline is computed once: a retried write that finds its own
	// earlier try landed recognises it by the same deadline.
	deadline := toMillis(c.s.now().Add(d))
	return c.write(ctx, kernel.WriteRequest{Kind: kernel.Renew, Deadline: deadline}, nil)
}

// sameAttempt reports whether two attempt ids are the same, in time that
// does not depend on where they differ: an attempt id is a secret.
func sameAttempt(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}
