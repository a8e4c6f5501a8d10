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
	s := newStore(t, client(t), prefix, withEpochs())
	ctx := testCtx(t)
	if _, err := s.Do(ctx, Key{ID: "here"}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("v"), nil }); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.forwardKey(ctx, Key{ID: "here"}, "b"); err != nil || rec.State != Done {
		t.Fatalf("Forward of a done key = %+v, %v; want the done record: it stays", rec, err)
	}
	rec, err := s.forwardKey(ctx, Key{ID: "gone"}, "b")
	if err != nil || rec.State != Moved || rec.MovedTo != "b" {
		t.Fatalf("Forward of an absent key = %+v, %v; want Moved to b", rec, err)
	}
	again, err := s.forwardKey(ctx, Key{ID: "gone"}, "b")
	if err != nil || again.Revision != rec.Revision {
		t.Fatalf("a second Forward = %+v, %v; want the same record, unwritten", again, err)
	}
	var me *movedError
	if _, _, err := s.Claim(ctx, Key{ID: "gone"}, Fingerprint{}); !errors.As(err, &me) || me.To != "b" || !errors.Is(err, errMoved) {
		t.Fatalf("claim of a moved key = %v; want a movedError to b", err)
	}
	// A Moved record naming another shard was left by an older shard set
	// (Forward compares the set in force): it is replaced.
	if other, err := s.forwardKey(ctx, Key{ID: "gone"}, "c"); err != nil || other.MovedTo != "c" || other.Revision <= rec.Revision {
		t.Fatalf("Forward to another shard = %+v, %v; want a new move to c", other, err)
	}
	// A claim that knows the Moved record is stale replaces it.
	c, _, err := s.Claim(ctx, Key{ID: "gone"}, Fingerprint{}, replaceMoved())
	if err != nil {
		t.Fatalf("claim of a moved key ReplaceMoved: %v", err)
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("here now")}); err != nil {
		t.Fatal(err)
	}
	plain := newStore(t, client(t), testPrefix(t))
	if _, err := plain.forwardKey(ctx, Key{ID: "k"}, "b"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Forward without epochs = %v; want ErrInvalidArgument", err)
	}
}

// WithoutCreate claims only a key with a live record here: a takeover or a
// replay, never a new record.
func TestWithoutCreate(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t), withEpochs())
	ctx := testCtx(t)
	fp := Fingerprint{1}
	if _, _, err := s.Claim(ctx, Key{ID: "absent"}, fp, withoutCreate()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("WithoutCreate of an absent key = %v; want ErrNotFound", err)
	}
	if rec, _ := s.Get(ctx, Key{ID: "absent"}); rec != nil {
		t.Fatalf("WithoutCreate wrote %+v", rec)
	}
	c, _, err := s.Claim(ctx, Key{ID: "live"}, fp)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("v")}); err != nil {
		t.Fatal(err)
	}
	if _, done, err := s.Claim(ctx, Key{ID: "live"}, fp, withoutCreate()); err != nil || done == nil || string(done.Outcome.Body) != "v" {
		t.Fatalf("WithoutCreate of a done key = %v, %v; want the replay", done, err)
	}
	if _, err := s.forwardKey(ctx, Key{ID: "moved"}, "b"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Claim(ctx, Key{ID: "moved"}, fp, withoutCreate()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("WithoutCreate of a moved key = %v; want ErrNotFound", err)
	}
}

// A claim, enqueue or Forward that routed by an older shard set is refused
// (ErrSetChanged) once another process records a new one, and the store
// learns the new set from the answer.
func TestShardSetGuardsClaims(t *testing.T) {
	prefix := testPrefix(t)
	a := newStore(t, client(t), prefix, withEpochs())
	b := newStore(t, client(t), prefix, withEpochs())
	ctx := testCtx(t)
	v, ok, err := a.setValue(ctx, shardSetValue, []byte("generation 1"), 0)
	if err != nil || !ok {
		t.Fatalf("record a set: %v %v", ok, err)
	}
	if got := a.shardSet(); got.Revision != v.Revision {
		t.Fatalf("the store's set after its own write: %+v; want %+v", got, v)
	}
	if b.shardSet().Revision != 0 {
		t.Fatal("b read a set before it was written")
	}
	_, _, err = b.Claim(ctx, Key{ID: "k"}, Fingerprint{})
	if !errors.Is(err, errSetChanged) {
		t.Fatalf("a claim by a store that knows no set = %v; want errSetChanged", err)
	}
	if got := b.shardSet(); got.Revision != v.Revision || string(got.Value) != "generation 1" {
		t.Fatalf("b's set after the refusal = %+v; want the one recorded", got)
	}
	if _, _, err := b.Claim(ctx, Key{ID: "k"}, Fingerprint{}); err != nil {
		t.Fatalf("the claim again, under the set recorded: %v", err)
	}
	if _, err := b.Enqueue(ctx, Key{ID: "j"}, Fingerprint{}, nil); err != nil {
		t.Fatalf("enqueue under the set recorded: %v", err)
	}
	if _, _, err := a.setValue(ctx, shardSetValue, []byte("generation 2"), v.Revision); err != nil {
		t.Fatal(err)
	}
	if _, err := b.forwardKey(ctx, Key{ID: "m"}, "x"); !errors.Is(err, errSetChanged) {
		t.Fatalf("Forward under an older set = %v; want errSetChanged", err)
	}
	if _, err := b.Enqueue(ctx, Key{ID: "j2"}, Fingerprint{}, nil); err != nil {
		t.Fatalf("enqueue after learning the set: %v", err)
	}
}

// Enqueue routed as a claim (Routed): only where the key has a live
// record (WithoutCreate), over a Moved record (ReplaceMoved), and under the
// shard set named (UnderShardSet), refused once that set changed even by a
// store that has learnt the newer one.
func TestEnqueueRouted(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t), withEpochs())
	ctx := testCtx(t)
	fp := Fingerprint{1}
	if _, err := s.Enqueue(ctx, Key{ID: "absent"}, fp, nil, routed(withoutCreate())); !errors.Is(err, ErrNotFound) {
		t.Fatalf("WithoutCreate of an absent key = %v; want ErrNotFound", err)
	}
	if rec, _ := s.Get(ctx, Key{ID: "absent"}); rec != nil {
		t.Fatalf("WithoutCreate wrote %+v", rec)
	}
	live, err := s.Enqueue(ctx, Key{ID: "live"}, fp, []byte("first"))
	if err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Enqueue(ctx, Key{ID: "live"}, fp, []byte("second"), routed(withoutCreate())); err != nil || rec.Revision != live.Revision {
		t.Fatalf("WithoutCreate of a live key = %+v, %v; want it as it is", rec, err)
	}
	moved, err := s.forwardKey(ctx, Key{ID: "moved"}, "b")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Enqueue(ctx, Key{ID: "moved"}, fp, nil, routed(withoutCreate())); !errors.Is(err, ErrNotFound) {
		t.Fatalf("WithoutCreate of a moved key = %v; want ErrNotFound", err)
	}
	var me *movedError
	if _, err := s.Enqueue(ctx, Key{ID: "moved"}, fp, nil); !errors.As(err, &me) {
		t.Fatalf("Enqueue over a Moved record = %v; want a *movedError", err)
	}
	rec, err := s.Enqueue(ctx, Key{ID: "moved"}, fp, []byte("here"), routed(replaceMoved()))
	if err != nil || rec.State != InFlight || rec.Token <= moved.Token || string(rec.Checkpoint) != "here" {
		t.Fatalf("ReplaceMoved = %+v, %v; want a new job with a greater token than %d", rec, err, moved.Token)
	}
	v1, _, err := s.setValue(ctx, shardSetValue, []byte("generation 1"), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Enqueue(ctx, Key{ID: "new"}, fp, nil, routed(underShardSet(v1.Revision))); err != nil {
		t.Fatalf("under the set in force: %v", err)
	}
	if _, _, err := s.setValue(ctx, shardSetValue, []byte("generation 2"), v1.Revision); err != nil {
		t.Fatal(err)
	}
	s.loadShardSet(ctx) // the store knows the new set: the option still compares the old one
	if _, err := s.Enqueue(ctx, Key{ID: "newer"}, fp, nil, routed(underShardSet(v1.Revision))); !errors.Is(err, errSetChanged) {
		t.Fatalf("under a set no longer in force = %v; want errSetChanged", err)
	}
	if _, err := s.Enqueue(ctx, Key{ID: "bad"}, fp, nil, routed(underShardSet(0))); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a set revision 0 = %v; want ErrInvalidArgument", err)
	}
}
