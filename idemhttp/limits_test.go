package idemhttp

import (
	"testing"
	"time"
)

// The buckets on a clock the test moves: claims refill at their rate, a
// saved outcome puts the tenant in debt until the rate has paid it, and
// tenants do not share buckets.
func TestLimiterBuckets(t *testing.T) {
	lim, err := NewLimiter(Limits{ClaimsPerSecond: 2, ClaimBurst: 2, BytesPerSecond: 1000, BytesBurst: 4000})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_800_000_000, 0)
	lim.now = func() time.Time { return now }
	for i := 0; i < 2; i++ {
		if p := lim.admitClaim("a"); p != nil {
			t.Fatalf("claim %d refused: %s", i, p.Detail)
		}
	}
	p := lim.admitClaim("a")
	if p == nil || p.Status != 429 || p.RetryAfter != 1 {
		t.Fatalf("third claim = %+v; want 429, retry after 1 s", p)
	}
	if p := lim.admitClaim("b"); p != nil {
		t.Fatalf("another tenant refused: %s", p.Detail)
	}
	now = now.Add(500 * time.Millisecond) // one claim back
	if p := lim.admitClaim("a"); p != nil {
		t.Fatalf("after 0.5 s: %s", p.Detail)
	}
	if p := lim.admitClaim("a"); p == nil {
		t.Fatal("a second claim after 0.5 s was admitted")
	}

	// Bytes: 10,000 saved puts "c" 6,000 in debt: 6 s to pay.
	lim.charge("c", 10000)
	now = now.Add(5 * time.Second)
	if p := lim.admitClaim("c"); p == nil || p.RetryAfter != 1 {
		t.Fatalf("in debt of 1000 bytes = %+v; want 429, retry after 1 s", p)
	}
	now = now.Add(time.Second)
	if p := lim.admitClaim("c"); p != nil {
		t.Fatalf("debt paid, still refused: %s", p.Detail)
	}
	// admitBytes takes what it can pay for, and waits for what it cannot.
	if p := lim.admitBytes("d", 3000); p != nil {
		t.Fatal(p.Detail)
	}
	if p := lim.admitBytes("d", 3000); p == nil || p.RetryAfter != 2 {
		t.Fatalf("3000 more with 1000 left = %+v; want 429, retry after 2 s", p)
	}
	// A write larger than the burst waits for a full bucket, then goes.
	if p := lim.admitBytes("e", 9000); p != nil {
		t.Fatalf("a 9000-byte write with a full 4000-byte bucket: %s", p.Detail)
	}

	var none *Limiter
	if none.admitClaim("a") != nil || none.admitBytes("a", 1<<30) != nil {
		t.Fatal("a nil Limiter limited")
	}
	for _, bad := range []Limits{{ClaimsPerSecond: -1}, {BytesPerSecond: -2}, {ClaimBurst: -1}} {
		if _, err := NewLimiter(bad); err == nil {
			t.Errorf("NewLimiter(%+v) accepted", bad)
		}
	}
}
