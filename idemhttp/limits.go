package idemhttp

import (
	"fmt"
	"math"
	"net/http"
	"sync"
	"time"
)

// Limits bounds what one tenant may make idem write to etcd, so that one
// tenant cannot fill the etcd quota that every tenant shares, nor take all
// of its write throughput. Each limit is a token bucket per tenant, in
// this process: with N idem processes, a tenant may write up to N times as
// much. Zero values mean no limit.
type Limits struct {
	// ClaimsPerSecond is the sustained rate of keyed requests (claims) a
	// tenant may make, with bursts of up to ClaimBurst (default: one
	// second's worth, at least 1). A replay counts too: it is a claim whose
	// key turns out to be done.
	ClaimsPerSecond float64
	ClaimBurst      int
	// BytesPerSecond is the sustained rate of record bytes (saved outcomes,
	// checkpoints) a tenant may have written, with bursts of up to
	// BytesBurst (default: ten seconds' worth, at least 1 MiB). An outcome
	// is charged once it is saved (the work already ran: it is never
	// refused after the fact); a tenant in debt gets 429 on its next claims
	// until the debt is paid. The worker API refuses a complete or a
	// checkpoint that the budget cannot pay for.
	BytesPerSecond float64
	BytesBurst     int64
}

// Limiter enforces Limits, per tenant. A nil *Limiter limits nothing. One
// Limiter can serve a Middleware and an API at once.
type Limiter struct {
	l   Limits
	now func() time.Time

	mu      sync.Mutex
	tenants map[string]*tenantBuckets
}

type tenantBuckets struct {
	claims, bytes bucket
}

// bucket is a token bucket that may go into debt (an outcome already
// saved is charged whatever its size).
type bucket struct {
	tokens float64
	at     time.Time
}

func (b *bucket) refill(now time.Time, rate, burst float64) {
	if b.at.IsZero() {
		b.tokens, b.at = burst, now
		return
	}
	b.tokens = math.Min(burst, b.tokens+now.Sub(b.at).Seconds()*rate)
	b.at = now
}

// wait is how long until the bucket holds n tokens.
func (b *bucket) wait(n, rate float64) time.Duration {
	if b.tokens >= n {
		return 0
	}
	return time.Duration((n - b.tokens) / rate * float64(time.Second))
}

// maxTenants bounds the buckets kept: past it, buckets that are full (a
// tenant idle long enough) are dropped.
const maxTenants = 10000

// NewLimiter returns a Limiter for l, or an error naming a bad value.
func NewLimiter(l Limits) (*Limiter, error) {
	switch {
	case l.ClaimsPerSecond < 0 || math.IsNaN(l.ClaimsPerSecond) || math.IsInf(l.ClaimsPerSecond, 0):
		return nil, fmt.Errorf("idemhttp: ClaimsPerSecond %v must be a positive number, or 0 for no limit", l.ClaimsPerSecond)
	case l.BytesPerSecond < 0 || math.IsNaN(l.BytesPerSecond) || math.IsInf(l.BytesPerSecond, 0):
		return nil, fmt.Errorf("idemhttp: BytesPerSecond %v must be a positive number, or 0 for no limit", l.BytesPerSecond)
	case l.ClaimBurst < 0 || l.BytesBurst < 0:
		return nil, fmt.Errorf("idemhttp: bursts must not be negative")
	}
	if l.ClaimsPerSecond > 0 && l.ClaimBurst == 0 {
		l.ClaimBurst = max(1, int(math.Ceil(l.ClaimsPerSecond)))
	}
	if l.BytesPerSecond > 0 && l.BytesBurst == 0 {
		l.BytesBurst = max(1<<20, int64(10*l.BytesPerSecond))
	}
	return &Limiter{l: l, now: time.Now, tenants: make(map[string]*tenantBuckets)}, nil
}

// buckets returns tenant's buckets, refilled to now; mu must be held.
func (lim *Limiter) buckets(tenant string, now time.Time) *tenantBuckets {
	tb := lim.tenants[tenant]
	if tb == nil {
		if len(lim.tenants) >= maxTenants {
			lim.dropIdle(now)
		}
		tb = &tenantBuckets{}
		lim.tenants[tenant] = tb
	}
	if lim.l.ClaimsPerSecond > 0 {
		tb.claims.refill(now, lim.l.ClaimsPerSecond, float64(lim.l.ClaimBurst))
	}
	if lim.l.BytesPerSecond > 0 {
		tb.bytes.refill(now, lim.l.BytesPerSecond, float64(lim.l.BytesBurst))
	}
	return tb
}

func (lim *Limiter) dropIdle(now time.Time) {
	for t, tb := range lim.tenants {
		tb.claims.refill(now, lim.l.ClaimsPerSecond, float64(lim.l.ClaimBurst))
		tb.bytes.refill(now, lim.l.BytesPerSecond, float64(lim.l.BytesBurst))
		if (lim.l.ClaimsPerSecond == 0 || tb.claims.tokens >= float64(lim.l.ClaimBurst)) &&
			(lim.l.BytesPerSecond == 0 || tb.bytes.tokens >= float64(lim.l.BytesBurst)) {
			delete(lim.tenants, t)
		}
	}
}

// admitClaim takes one claim from tenant's budget, or returns the 429
// problem saying when to retry: when its claims are spent, or its bytes are
// in debt.
func (lim *Limiter) admitClaim(tenant string) *Problem {
	if lim == nil {
		return nil
	}
	lim.mu.Lock()
	defer lim.mu.Unlock()
	tb := lim.buckets(tenant, lim.now())
	if lim.l.BytesPerSecond > 0 && tb.bytes.tokens < 0 {
		return rateLimited(tb.bytes.wait(0, lim.l.BytesPerSecond),
			fmt.Sprintf("tenant %q wrote more than its %.0f bytes per second of outcomes and checkpoints; retry later with the same key", tenant, lim.l.BytesPerSecond))
	}
	if lim.l.ClaimsPerSecond > 0 {
		if d := tb.claims.wait(1, lim.l.ClaimsPerSecond); d > 0 {
			return rateLimited(d, fmt.Sprintf("tenant %q is over its %g keyed requests per second; retry later with the same key", tenant, lim.l.ClaimsPerSecond))
		}
		tb.claims.tokens--
	}
	return nil
}

// admitBytes takes n bytes from tenant's budget if it holds them, or
// returns the 429 problem saying when it will: for writes a worker can
// retry (a complete, a checkpoint).
func (lim *Limiter) admitBytes(tenant string, n int) *Problem {
	if lim == nil || lim.l.BytesPerSecond == 0 {
		return nil
	}
	lim.mu.Lock()
	defer lim.mu.Unlock()
	tb := lim.buckets(tenant, lim.now())
	need := math.Min(float64(n), float64(lim.l.BytesBurst)) // a record larger than the burst waits for a full bucket
	if d := tb.bytes.wait(need, lim.l.BytesPerSecond); d > 0 {
		return rateLimited(d, fmt.Sprintf("tenant %q is over its %.0f bytes per second of outcomes and checkpoints (this write: %d bytes); retry it later", tenant, lim.l.BytesPerSecond, n))
	}
	tb.bytes.tokens -= float64(n)
	return nil
}

// charge takes n bytes already written from tenant's budget, into debt if
// need be.
func (lim *Limiter) charge(tenant string, n int) {
	if lim == nil || lim.l.BytesPerSecond == 0 || n <= 0 {
		return
	}
	lim.mu.Lock()
	defer lim.mu.Unlock()
	lim.buckets(tenant, lim.now()).bytes.tokens -= float64(n)
}

func rateLimited(wait time.Duration, detail string) *Problem {
	p := NewProblem(http.StatusTooManyRequests, KindRateLimited, detail)
	p.RetryAfter = retrySeconds(wait)
	return &p
}

// outcomeSize is about what an outcome takes in a record.
func outcomeSize(status int, h map[string][]string, body []byte, errText string) int {
	n := len(body) + len(errText) + 8
	for k, vs := range h {
		n += len(k)
		for _, v := range vs {
			n += len(v) + 2
		}
	}
	return n
}
