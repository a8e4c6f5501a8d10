package etcdstore

import (
	"context"
	"errors"
	"testing"
)

// Forward keeps a key that lives here, hands an absent one over with a
// Moved record, after which the store refuses to claim it; without epochs
// it is refused.
func TestForward(t *testing.T) {
	prefix := testPrefix(t)
	s := newStore(t, client(t), prefix, WithEpochs())
	ctx := testCtx(t)
	if _, err := s.Do(ctx, Key{ID: "here"}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("v"), nil }); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Forward(ctx, Key{ID: "here"}, "b"); err != nil || rec.State != Done {
		t.Fatalf("Forward of a done key = %+v, %v; want the done record: it stays", rec, err)
	}
	rec, err := s.Forward(ctx, Key{ID: "gone"}, "b")
	if err != nil || rec.State != Moved || rec.MovedTo != "b" {
		t.Fatalf("Forward of an absent key = %+v, %v; want Moved to b", rec, err)
	}
	again, err := s.Forward(ctx, Key{ID: "gone"}, "b")
	if err != nil || again.Revision != rec.Revision {
		t.Fatalf("a second Forward = %+v, %v; want the same record, unwritten", again, err)
	}
	var me *MovedError
	if _, _, err := s.Claim(ctx, Key{ID: "gone"}, Fingerprint{}); !errors.As(err, &me) || me.To != "b" || !errors.Is(err, ErrMoved) {
		t.Fatalf("claim of a moved key = %v; want a MovedError to b", err)
	}
	if other, err := s.Forward(ctx, Key{ID: "gone"}, "c"); err != nil || other.MovedTo != "b" {
		t.Fatalf("Forward to another shard = %+v, %v; want the existing move to b", other, err)
	}
	plain := newStore(t, client(t), testPrefix(t))
	if _, err := plain.Forward(ctx, Key{ID: "k"}, "b"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Forward without epochs = %v; want ErrInvalidArgument", err)
	}
}
