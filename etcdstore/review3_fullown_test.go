package etcdstore

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// R9 (a claim whose earlier try landed is won while etcd is full, "as when
// etcd is not full") skips what makes the claim won when etcd has room: the
// retry's Txn compares that the claim's owner key exists, and a claim
// whose session ended in etcd meanwhile is answered SessionGone
// (ErrSessionLost), never won. While etcd is full the same claim is won
// from a read that never looks at the owner key: the store hands out a
// claim whose record every other process already sees as stale (its owner
// is dead), and its work runs.
//
// The session's lease is revoked right after the claim's first try landed
// (its reply lost); the store has not noticed yet (its keepalive is far
// off), as after a pause or a partition longer than the session TTL.
func TestReview3FullOwnClaimUnderDeadSession(t *testing.T) {
	for _, full := range []bool{false, true} {
		name := "room"
		if full {
			name = "full"
		}
		t.Run(name, func(t *testing.T) {
			ctx := testCtx(t)
			plain := client(t)
			var armed, txns atomic.Int32
			var s *Store
			cli := hookedClient(t, func(method string, req any, invoke func() error) error {
				if !strings.HasSuffix(method, "/Txn") || armed.Load() == 0 || !strings.Contains(fmt.Sprint(req), "/k/default/k") {
					return invoke()
				}
				if txns.Add(1) == 1 {
					if err := invoke(); err != nil {
						return err
					}
					// The claim landed; its session ends in etcd; the reply is lost.
					if _, err := plain.Revoke(ctx, s.sessionLeaseID()); err != nil {
						t.Errorf("revoke: %v", err)
					}
					return errLost
				}
				if full {
					return rpctypes.ErrGRPCNoSpace
				}
				return invoke()
			})
			s = newStore(t, cli, testPrefix(t), WithSessionTTL(60*time.Second), WithBatching(false))
			armed.Store(1)
			c, done, err := s.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithAttempt("attempt-1"))
			if txns.Load() < 2 {
				t.Fatalf("the claim sent %d Txns; want the lost one and a retry", txns.Load())
			}
			if c != nil {
				alive, aerr := s.ownerLives(ctx, c.owner)
				t.Errorf("a claim whose session ended in etcd was won (full=%v): token %d, its owner key alive %v (%v); want ErrSessionLost, no claim, as when etcd has room",
					full, c.Token(), alive, aerr)
			} else if done != nil || !errors.Is(err, ErrSessionLost) && (!full || !errors.Is(err, ErrStoreFull)) {
				t.Errorf("a claim whose session ended in etcd (full=%v) = %v, %v; want ErrSessionLost (or, when full, ErrStoreFull)", full, done, err)
			}
		})
	}
}
