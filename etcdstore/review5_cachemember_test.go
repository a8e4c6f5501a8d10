package etcdstore

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
)

// idem.Store's godoc: a store with WithCache "may answer with a done record
// deleted at most its staleness bound (WithCacheStaleness) ago"; the
// cache's own docs: it answers only while a progress request "sent at most
// the bound ago" has come back. A progress notification is answered by the
// member the watch is on, from its own revision: a member cut off from its
// cluster that has not yet noticed (until its election timeout) keeps
// answering them, so the cache keeps "proving itself current" while it
// misses every write, and replays a record deleted many bounds ago.
func TestReview5CacheOnCutOffMemberReplaysPastItsBound(t *testing.T) {
	dir, err := os.MkdirTemp("", "idem-review5-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c, err := etcdtest.New(dir, 3, etcdtest.Options{Proxies: true, ElectionMs: 5000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ctx := testCtx(t)
	leader, err := c.WaitLeader(ctx, c.All())
	if err != nil {
		t.Fatal(err)
	}
	f := (leader + 1) % 3
	var rest []string
	for i, m := range c.Members {
		if i != f {
			rest = append(rest, m.ClientURL)
		}
	}
	const bound = 200 * time.Millisecond
	prefix := testPrefix(t)
	writer := newStore(t, c.MustClient(t, rest...), prefix)
	cached := newStore(t, c.MustClient(t, c.Members[f].ClientURL), prefix, WithCache(1<<20), WithCacheStaleness(bound), WithRequestTimeout(time.Second))

	k := Key{ID: "k"}
	fp := fpOf(t, "p")
	runs := 0
	work := func(context.Context, *Claim) (Outcome, End) {
		runs++
		return Outcome{Body: []byte("run")}, EndSave
	}
	if _, err := writer.Run(ctx, k, fp, work); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the cache to hold the record, current", func() bool {
		st := cached.Metrics().Cache
		return st.Entries == 1 && st.Lag < bound/2
	})

	if err := c.Isolate(f); err != nil {
		t.Fatal(err)
	}
	defer c.Heal()
	if err := writer.Evict(ctx, k); err != nil {
		t.Fatal(err)
	}
	evicted := time.Now()
	time.Sleep(5 * bound) // well past the bound, well before f's election timeout (5 s)

	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	res, err := cached.Run(rctx, k, fp, work)
	cancel()
	if err == nil && res.Replayed {
		t.Fatalf("%v after the record was deleted (staleness bound %v), the cached store replayed it (cache lag reported %v)",
			time.Since(evicted).Round(time.Millisecond), bound, cached.Metrics().Cache.Lag)
	}
}
