package shard

import (
	"errors"
	"strconv"
	"testing"

	"github.com/idem-dev/idem/etcdstore"
)

// Enqueue goes where a claim of its key would: a key with a live record on
// its old shard is answered from there (nothing is created at its home),
// a key without one is handed over and enqueued at its home, and a process
// still on the old set is refused by the shards that record the new one,
// learns it, and enqueues at the home too. Txns lose a tenth of their
// replies.
func TestEnqueueRoutesLikeAClaim(t *testing.T) {
	prefix := testPrefix(t)
	ctx := testCtx(t)
	fp := etcdstore.Fingerprint{1}
	old := open(t, prefix, 1, []string{"a"}, nil, 0.1, 7, "a", "b")
	inForce(t, old, 1)
	next := Placement{Shards: []string{"a", "b"}}
	// Keys the next set places on b.
	var onB []etcdstore.Key
	for i := 0; len(onB) < 6; i++ {
		if k := (etcdstore.Key{Tenant: "jobs", ID: "j" + strconv.Itoa(i)}); next.Place(k) == "b" {
			onB = append(onB, k)
		}
	}
	early := map[string]int64{}
	for _, k := range onB[:3] {
		rec, err := old.Enqueue(ctx, k, fp, []byte("early"))
		if err != nil {
			t.Fatal(err)
		}
		early[k.ID] = rec.Revision
	}
	s := open(t, prefix, 2, []string{"a", "b"}, []string{"a"}, 0.1, 8, "a", "b")
	inForce(t, s, 2)
	for _, k := range onB[:3] {
		rec, err := s.Enqueue(ctx, k, fp, []byte("again"))
		if err != nil || rec.Revision != early[k.ID] || string(rec.Checkpoint) != "early" {
			t.Fatalf("Enqueue(%s) under the new set = %+v, %v; want the record on a", k, rec, err)
		}
		if _, err := s.Shard("b").Get(ctx, k); !errors.Is(err, etcdstore.ErrNotFound) {
			t.Fatalf("%s at its home b: %v; want nothing", k, err)
		}
	}
	for i, k := range onB[3:] {
		// The old process first: it learns the new set from a's refusal.
		st := []*Store{old, s, old}[i]
		rec, err := st.Enqueue(ctx, k, fp, []byte("late"))
		if err != nil || string(rec.Checkpoint) != "late" {
			t.Fatalf("Enqueue(%s) = %+v, %v", k, rec, err)
		}
		if got, err := s.Shard("b").Get(ctx, k); err != nil || got.Revision != rec.Revision {
			t.Fatalf("%s at b: %+v, %v; want the enqueued record", k, got, err)
		}
		if got, err := s.Shard("a").Get(ctx, k); err != nil || got.State != etcdstore.Moved {
			t.Fatalf("%s at a: %+v, %v; want a Moved record", k, got, err)
		}
	}
	if _, err := s.Enqueue(ctx, onB[4], etcdstore.Fingerprint{2}, nil); !errors.Is(err, etcdstore.ErrMismatch) {
		t.Fatalf("Enqueue with another fingerprint = %v; want ErrMismatch", err)
	}
}
