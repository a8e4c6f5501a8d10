package etcdstore

import (
	"errors"
	"testing"
	"time"
)

// Enqueue with IfValue writes only while the value is at the revision the
// write was decided under: a late write after the value moved writes
// nothing (ErrValueChanged); a record that exists is returned whatever the
// value says; bad value names are refused.
func TestEnqueueIfValue(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	v, ok, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=1"), 0)
	if err != nil || !ok {
		t.Fatalf("SetValue = %v, %v", ok, err)
	}
	decided := v.Revision
	if _, _, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=2"), decided); err != nil {
		t.Fatal(err)
	}
	key, fp := Key{Tenant: "jobs", ID: "tick@1"}, fpOf(t, `1`)
	if rec, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValue("s/jobs/tick", decided)); !errors.Is(err, errValueChanged) || rec != nil {
		t.Fatalf("Enqueue decided under an old revision = %+v, %v; want errValueChanged", rec, err)
	}
	if _, err := s.Get(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a refused Enqueue wrote the record: %v", err)
	}
	cur, err := s.getValue(ctx, "s/jobs/tick")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValue("s/jobs/tick", cur.Revision))
	if err != nil || rec.State != InFlight {
		t.Fatalf("Enqueue under the current revision = %+v, %v; want it written", rec, err)
	}
	if again, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValue("s/jobs/tick", decided)); err != nil || again.Token != rec.Token {
		t.Fatalf("Enqueue of an existing record under an old revision = %+v, %v; want the record", again, err)
	}
	if _, err := s.Enqueue(ctx, Key{ID: "x"}, fp, nil, ifValue("/abs", 1)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a bad value name = %v; want ErrInvalidArgument", err)
	}
}

// Over an expired record (its retention passed, not swept yet), Enqueue
// with IfValue writes the new operation while the value holds, and is
// refused once it moved; it never takes the expired record for a moved
// value (a scheduler's decided occurrence spun on that refusal).
func TestEnqueueIfValueOverAnExpiredRecord(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	ctx := testCtx(t)
	short := newStore(t, cli, prefix, WithRetention(time.Second))
	key, fp := Key{Tenant: "jobs", ID: "tick@2"}, fpOf(t, `2`)
	old, err := short.Enqueue(ctx, key, fp, []byte("old"))
	if err != nil {
		t.Fatal(err)
	}
	clk := newShiftClock()
	clk.Shift(2 * time.Second) // a writer for whom it has expired
	s := newStore(t, cli, prefix, WithClock(clk))
	v, _, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=2"), 0)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Enqueue(ctx, key, fp, []byte("new"), ifValue("s/jobs/tick", v.Revision))
	if err != nil || rec.Token == old.Token || string(rec.Checkpoint) != "new" {
		t.Fatalf("Enqueue over an expired record, value unmoved = %+v, %v; want a new record", rec, err)
	}
	key2 := Key{Tenant: "jobs", ID: "tick@3"}
	if _, err := short.Enqueue(ctx, key2, fp, []byte("old")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=3"), v.Revision); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Enqueue(ctx, key2, fp, []byte("new"), ifValue("s/jobs/tick", v.Revision)); !errors.Is(err, errValueChanged) {
		t.Fatalf("Enqueue over an expired record, value moved = %+v, %v; want errValueChanged", rec, err)
	}
}

// Regression (explorer seed 1796412355989147081): the record an Enqueue
// with IfValue writes moves the value to a new revision in the same
// transaction, its content unchanged. A scheduler that read the cursor at
// that revision and the job as absent (forgotten, it judged) and set the
// cursor to run the next occurrence fails instead of landing beside the
// late submission of the job it judged forgotten. A record that existed
// already moves nothing.
func TestEnqueueIfValueMovesTheValue(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	v, ok, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=1"), 0)
	if err != nil || !ok {
		t.Fatalf("SetValue = %v, %v", ok, err)
	}
	key, fp := Key{Tenant: "jobs", ID: "tick@1"}, fpOf(t, `1`)
	rec, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValue("s/jobs/tick", v.Revision))
	if err != nil {
		t.Fatal(err)
	}
	now, err := s.getValue(ctx, "s/jobs/tick")
	if err != nil {
		t.Fatal(err)
	}
	if now.Revision != rec.Revision || string(now.Value) != "prev=1" {
		t.Fatalf("value after the fenced Enqueue: revision %d, %q; want revision %d (the record's), %q unchanged", now.Revision, now.Value, rec.Revision, "prev=1")
	}
	if _, ok, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=2"), v.Revision); err != nil || ok {
		t.Fatalf("SetValue at the revision read before the record landed = %v, %v; want refused", ok, err)
	}
	if _, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValue("s/jobs/tick", now.Revision)); err != nil {
		t.Fatal(err)
	}
	if again, err := s.getValue(ctx, "s/jobs/tick"); err != nil || again.Revision != now.Revision {
		t.Fatalf("value after an Enqueue that found the record: %+v, %v; want revision %d unmoved", again, err, now.Revision)
	}
}

// IfValueThen writes the value's new content with the record, in one
// transaction; a record that exists already leaves the value as it is;
// revision 0 is refused. Peek returns a record past its retention.
func TestEnqueueIfValueThen(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	ctx := testCtx(t)
	v, _, err := s.setValue(ctx, "s/jobs/tick", []byte("prev=1"), 0)
	if err != nil {
		t.Fatal(err)
	}
	key, fp := Key{Tenant: "jobs", ID: "tick@1"}, fpOf(t, `1`)
	rec, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValueThen("s/jobs/tick", v.Revision, []byte("prev=1 submitted=1")))
	if err != nil {
		t.Fatal(err)
	}
	now, err := s.getValue(ctx, "s/jobs/tick")
	if err != nil || now.Revision != rec.Revision || string(now.Value) != "prev=1 submitted=1" {
		t.Fatalf("value after Enqueue with IfValueThen = %+v, %v; want %q at the record's revision %d", now, err, "prev=1 submitted=1", rec.Revision)
	}
	if _, err := s.Enqueue(ctx, key, fp, []byte("d"), ifValueThen("s/jobs/tick", now.Revision, []byte("other"))); err != nil {
		t.Fatal(err)
	}
	if again, err := s.getValue(ctx, "s/jobs/tick"); err != nil || string(again.Value) != "prev=1 submitted=1" || again.Revision != now.Revision {
		t.Fatalf("value after an Enqueue that found the record = %+v, %v; want it unchanged", again, err)
	}
	if _, err := s.Enqueue(ctx, Key{Tenant: "jobs", ID: "tick@2"}, fp, nil, ifValueThen("s/jobs/tick", 0, []byte("x"))); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("IfValueThen at revision 0 = %v; want ErrInvalidArgument", err)
	}
	clk := newShiftClock()
	clk.Shift(25 * time.Hour) // past the default retention
	// Its sweeper would delete the record Peek reads.
	later := newStore(t, cli, prefix, WithClock(clk), WithExpirySweep(false))
	if _, err := later.Get(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get past the retention = %v; want ErrNotFound", err)
	}
	if got, err := later.peek(ctx, key); err != nil || got.Revision != rec.Revision {
		t.Fatalf("Peek past the retention = %+v, %v; want the record at revision %d", got, err, rec.Revision)
	}
	if _, err := later.peek(ctx, Key{Tenant: "jobs", ID: "none"}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Peek of no record = %v; want ErrNotFound", err)
	}
}
