package etcdstore

import (
	"testing"
	"time"
)

// CHANGELOG: "NOSPACE: a Complete or Abandon that landed although its
// reply was lost is recognised by a read". Complete is tested
// (TestReplayWhenEtcdIsFull); this is the Abandon half, and a Release that
// landed (a delete: etcd lets it through when full).
func TestReviewAbandonThatLandedIsRecognisedWhenFull(t *testing.T) {
	small, cli := smallCluster(t)
	defer small.Close()
	s := newStore(t, cli, "/full/")
	ctx := testCtx(t)
	claims := map[string]*Claim{}
	for _, id := range []string{"abandoned", "released"} {
		c, _, err := s.Claim(ctx, Key{ID: id}, fpOf(t, "p"), WithoutSession(), WithDeadline(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		other, err := s.Attach(ctx, c.Handle())
		if err != nil {
			t.Fatal(err)
		}
		// The write lands through the other handle: for c, a lost reply.
		if id == "abandoned" {
			err = other.Abandon(ctx)
		} else {
			err = other.Release(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		claims[id] = c
	}
	fillUntilNoSpace(t, ctx, cli)
	if err := claims["abandoned"].Abandon(ctx); err != nil {
		t.Errorf("the retry of an Abandon that landed, when full = %v; want nil", err)
	}
	if err := claims["released"].Release(ctx); err != nil {
		t.Errorf("the retry of a Release that landed, when full = %v; want nil", err)
	}
}
