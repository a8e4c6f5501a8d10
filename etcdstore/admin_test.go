package etcdstore

import (
	"context"
	"errors"
	"testing"
	"time"
)

// An Admin reads what a Store wrote without a session of its own.
func TestAdminWithoutSession(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	clk := newShiftClock()
	s := newStore(t, cli, prefix, WithExpirySweep(false), WithClock(clk))
	ctx := testCtx(t)
	if _, err := s.Do(ctx, Key{ID: "done"}, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("x"), nil }); err != nil {
		t.Fatal(err)
	}
	c, _, err := s.Claim(ctx, Key{Tenant: "other", ID: "flying"}, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)

	before := revision(t, cli)
	a, err := NewAdmin(cli, WithPrefix(prefix), WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	st, err := a.stats(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st.Records != 2 || st.Done != 1 || st.InFlight != 1 || st.Scanned != 2 || st.Owners != 1 || st.Leases != 1 {
		t.Fatalf("Stats = %+v; want 2 records (1 done, 1 in flight), 1 owner, 1 bucket", st)
	}
	if after := revision(t, cli); after != before {
		t.Fatalf("an Admin wrote to etcd: revision %d -> %d", before, after)
	}
	if rec, err := a.Get(ctx, Key{ID: "done"}); err != nil || string(rec.Outcome.Body) != "x" {
		t.Fatalf("Admin.Get = %+v, %v", rec, err)
	}
	if recs, err := a.List(ctx, "other", ListOptions{State: InFlight}); err != nil || len(recs) != 1 {
		t.Fatalf("Admin.List = %d, %v; want the one in-flight record", len(recs), err)
	}
	clk.Shift(48 * time.Hour)
	if st, err := a.stats(ctx, 1); err != nil || st.Scanned != 1 || st.Expired != 1 {
		t.Fatalf("capped Stats in the future = %+v, %v; want 1 scanned, expired", st, err)
	}
	if err := a.Evict(ctx, Key{ID: "done"}); err != nil {
		t.Fatal(err)
	}
	if _, err := NewAdmin(nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("NewAdmin(nil) = %v", err)
	}
}
