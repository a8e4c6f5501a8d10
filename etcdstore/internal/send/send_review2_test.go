package send

import (
	"context"
	"testing"
	"time"

	"github.com/idem-dev/idem/clock"
)

// A leader whose own write is left out of the batch it sends (its key is
// already in it, or the bytes) and which is then the only queued write is
// never woken: signalLocked skips it (leading), and no other caller waits
// to arm the hold's timer or to take it. When another batch answers (a
// slot frees, the pace is measured, the hold passes), nobody looks: the
// write waits for the answer of a batch it is not in (up to the request
// timeout) while 3 of 4 slots are free and the hold has long passed.
// ARCHITECTURE: "no write waits ... for an unrelated batch while a slot is
// free".
func TestReview2StrandedLeaderWriteWaitsForItsUnrelatedBatch(t *testing.T) {
	for _, tc := range []struct {
		name     string
		lkey     string // the leader's own key
		maxBytes int
	}{
		{"key already in the batch", "a", 0},
		{"bytes", "l", 300}, // sizeAtMost(putReq(one letter)) is 258: two do not fit
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := newGatedKV(t)
			s := New(Config{KV: kv, Clock: clock.Real, Batching: true, MaxMembers: 2, MaxBytes: tc.maxBytes,
				Try: func(ctx context.Context) (context.Context, context.CancelFunc) {
					return context.WithTimeout(ctx, time.Minute)
				}})
			ctx := context.Background()
			type result struct {
				name string
				err  error
			}
			results := make(chan result, 10)
			write := func(name, key string) {
				go func() {
					_, err := s.Txn(ctx, putReq(key), []string{key})
					results <- result{name, err}
				}()
			}
			defer func() {
				for _, g := range []string{"w1", "a", tc.lkey} {
					func() { defer func() { recover() }(); kv.open(g) }()
				}
			}()

			write("w1", "w1") // idle: sent at once, alone, held at etcd
			expectArrival(t, kv, "w1")
			write("A", "a") // a batch flies, nothing measured, [A] not full: wait
			waitQueued(t, s, 1)
			// L: [A L] is full; L sends [A], its own write left out (its key
			// is in it already, or the two exceed MaxBytes). L is leading and
			// the only one queued: nobody is signalled.
			write("L", tc.lkey)
			var first string
			select {
			case first = <-kv.arrived: // [A] or, its caller carrying its own write, [L]
			case <-time.After(5 * time.Second):
				t.Fatal("L never sent a batch")
			}
			want := map[string]string{"a": tc.lkey, tc.lkey: "a"}[first] // the write left queued
			waitQueued(t, s, 1)

			// w1 answers: 1 batch of 4 flies, the round trip is measured and
			// the hold (a 16th of it) passes within a millisecond. w1's
			// caller signals the oldest queued write not leading: none.
			kv.open("w1")
			if r := <-results; r.name != "w1" || r.err != nil {
				t.Fatalf("first answer %v", r)
			}
			select {
			case got := <-kv.arrived:
				if got != want {
					t.Fatalf("etcd received %q, want the write left queued, %q", got, want)
				}
			case <-time.After(3 * time.Second):
				st := s.Stats()
				t.Fatalf("3 s after a slot freed (1 of 4 in flight, hold %v, round trip %v), L's write (queued %d) was not sent: "+
					"nothing woke it or armed a timer", st.Hold, st.RoundTrip, s.Queued())
			}
		})
	}
}
