package etcdstore

import (
	"errors"
	"testing"
)

// Enqueue with IfValue writes only while the value is at the revision the
// write was decided under: a late write after the value moved writes
// nothing (ErrValueChanged); a record that exists is returned whatever the
// value says; bad value names are refused.
func TestEnqueueIfValue(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	v, ok, err := s.SetValue(ctx, "s/jobs/tick", []byte("prev=1"), 0)
	if err != nil || !ok {
		t.Fatalf("SetValue = %v, %v", ok, err)
	}
	decided := v.Revision
	if _, _, err := s.SetValue(ctx, "s/jobs/tick", []byte("prev=2"), decided); err != nil {
		t.Fatal(err)
	}
	key, fp := Key{Tenant: "jobs", ID: "tick@1"}, fpOf(t, `1`)
	if rec, err := s.Enqueue(ctx, key, fp, []byte("d"), IfValue("s/jobs/tick", decided)); !errors.Is(err, ErrValueChanged) || rec != nil {
		t.Fatalf("Enqueue decided under an old revision = %+v, %v; want ErrValueChanged", rec, err)
	}
	if _, err := s.Get(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a refused Enqueue wrote the record: %v", err)
	}
	cur, err := s.Value(ctx, "s/jobs/tick")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Enqueue(ctx, key, fp, []byte("d"), IfValue("s/jobs/tick", cur.Revision))
	if err != nil || rec.State != InFlight {
		t.Fatalf("Enqueue under the current revision = %+v, %v; want it written", rec, err)
	}
	if again, err := s.Enqueue(ctx, key, fp, []byte("d"), IfValue("s/jobs/tick", decided)); err != nil || again.Token != rec.Token {
		t.Fatalf("Enqueue of an existing record under an old revision = %+v, %v; want the record", again, err)
	}
	if _, err := s.Enqueue(ctx, Key{ID: "x"}, fp, nil, IfValue("/abs", 1)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a bad value name = %v; want ErrInvalidArgument", err)
	}
}
