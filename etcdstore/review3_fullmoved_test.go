package etcdstore

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// (Older than the recent changes, found beside R9.) While etcd is full, a
// claim of a key handed over to another shard (a Moved record here) is
// answered from a read by readOnly, which has no case for Moved records:
// the Moved record's fingerprint is not the claim's, so the caller gets
// ErrMismatch ("never retry, use a new key": a 422 at the edge) instead
// of a MovedError naming the shard the key lives on, as when etcd has room.
func TestReview3FullClaimOfAMovedKeyIsMoved(t *testing.T) {
	ctx := testCtx(t)
	var full atomic.Bool
	cli := hookedClient(t, func(method string, req any, invoke func() error) error {
		if full.Load() && strings.HasSuffix(method, "/Txn") {
			return rpctypes.ErrGRPCNoSpace
		}
		return invoke()
	})
	s := newStore(t, cli, testPrefix(t), withEpochs())
	key := Key{ID: "gone"}
	if _, err := s.forwardKey(ctx, key, "b"); err != nil {
		t.Fatal(err)
	}
	for _, f := range []bool{false, true} {
		full.Store(f)
		_, _, err := s.Claim(ctx, key, fpOf(t, "p"))
		var me *movedError
		if !errors.As(err, &me) || me.To != "b" {
			t.Errorf("claim of a moved key (etcd full: %v) = %v; want a movedError to b", f, err)
		}
	}
}
