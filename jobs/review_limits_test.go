package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// reviewPick returns an id (prefix-N) whose preferred worker, between the
// owners a and b, is a.
func reviewPick(prefix, a, b string) string {
	for i := 0; ; i++ {
		id := fmt.Sprintf("%s-%d", prefix, i)
		if rendezvous(id, a) > rendezvous(id, b) || rendezvous(id, a) == rendezvous(id, b) && a > b {
			return id
		}
	}
}

// waitOwner waits until s has a session.
func waitOwner(t *testing.T, s *etcdstore.Store) string {
	t.Helper()
	waitFor(t, func() bool { return s.Owner() != "" })
	return s.Owner()
}

// waitDone waits up to d for job id to end, and returns it as it stands.
func waitDone(t *testing.T, q *Queue, id string, d time.Duration) (*Job, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	if j, err := q.Wait(ctx, id); err == nil {
		return j, true
	}
	j, err := q.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return j, false
}

// Found by review; failed before its fix. A worker whose claim was taken over takes its key's slot from the
// newer claim of the same job, and so lets another job of the key run while
// that newer claim still runs: two jobs of a Concurrency-1 key commit work in
// the same span of time.
//
// JOBS.md, "Per-key limits": "a slot is taken from a claim only once that
// claim can commit nothing: no more than `Concurrency` jobs of one key
// commit work in the same span of time, takeovers, crashes and lost replies
// included"; invariant L2: "a slot is never taken from a live claim".
//
// What happens: worker 1 claims J (token t1) and is paused (a GC pause, CPU
// starvation, a slow network: its session expires) before it takes its
// slot. Worker 2 takes J over (token t2 > t1), takes slot 0 and runs J's
// step. Worker 1 resumes and reads slot 0: it names J with another token,
// which takeSlot calls "an earlier attempt of this job: its claim is over"
// (limit.go:255-256) without looking whether that token is older or newer
// than its own; it overwrites slot 0 with J/t1. Now slot 0 names a claim
// that can write nothing (J/t1), so the next job of the key, K, finds it
// stale and takes it, and runs beside J/t2, whose claim is live and whose
// checkpoints commit.
//
// (The test calls takeSlot for worker 1's claim with a context that has not
// ended: the pause means worker 1 has not yet seen its session go. The
// slot's write is not fenced by the claim, so whether the ctx happens to be
// cancelled first is a race, not a guarantee.)
//
// Fix: a holder of the same job is stale only when its token is lower than
// this claim's; a higher one means this claim is over (return ErrFenced, or
// errLimited). Better still, make the slot's compare-and-set also compare
// the claim's record (Claim.IsOwner) so a superseded claim can take nothing.
func TestReviewSlotTakenFromNewerClaimOfSameJob(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	g := newGauge()
	release := make(chan struct{})
	defer close(release)
	entered := make(chan string, 4)
	k := Kind{Name: "pay", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Concurrency: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			g.enter("m")
			defer g.leave("m")
			entered <- r.Key().ID
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return nil, nil
		}}}}
	s1 := newStore(t, prefix)
	q1 := newQueue(t, s1)
	w1 := newWorker(t, q1, []Kind{k}, Concurrency(0), DrainTimeout(0))
	q2 := newQueue(t, newStore(t, prefix))
	w2 := newWorker(t, q2, []Kind{k}, Concurrency(0), DrainTimeout(0))
	q3 := newQueue(t, newStore(t, prefix))
	w3 := newWorker(t, q3, []Kind{k}, Concurrency(0), DrainTimeout(0))
	for _, id := range []string{"J", "K"} {
		if _, err := q1.Submit(ctx, id, "pay", []byte(`{"merchant":"m"}`)); err != nil {
			t.Fatal(err)
		}
	}
	rec, err := s1.Get(ctx, q1.Key("J"))
	if err != nil {
		t.Fatal(err)
	}
	// Worker 1 claims J, and is paused before it takes its slot.
	claimed := make(chan int64, 1)
	proceed := make(chan struct{})
	took := make(chan error, 1)
	go s1.Run(context.Background(), q1.Key("J"), rec.Fingerprint, func(_ context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		claimed <- int64(c.Token())
		<-proceed
		var held []heldSlot
		took <- w1.takeSlot(context.Background(), c, keyedLimit{&w1.kinds["pay"].Limits[0], "m"}, &held)
		return etcdstore.Outcome{}, etcdstore.EndAbandon
	}, storex.WithoutCreate())
	t1 := <-claimed
	// Its session expires; worker 2 takes J over and runs its step under
	// slot 0.
	endSession(t, s1)
	go w2.Run(ctx, "J")
	if id := <-entered; id != "J" {
		t.Fatalf("%s ran; want J", id)
	}
	slots, err := q1.Slots(ctx, "merchant")
	if err != nil || len(slots) != 1 || slots[0].Job != "J" || int64(slots[0].Token) <= t1 {
		t.Fatalf("slots while J's takeover runs: %+v, %v; want one, J's newer claim (token above %d)", slots, err, t1)
	}
	t2 := slots[0].Token
	// Worker 1 resumes.
	close(proceed)
	if err := <-took; err != nil {
		t.Logf("worker 1's superseded claim did not take a slot: %v", err)
	}
	if held, err := storex.ClaimHeld(&s1.Admin, ctx, q1.Key("J"), t2); err != nil || !held {
		t.Fatalf("J's takeover (token %d) should still hold J: %v, %v", t2, held, err)
	}
	// K is tried while J's takeover still runs its step.
	ran := make(chan *Job, 1)
	go func() {
		j, err := w3.Run(ctx, "K")
		if err != nil {
			t.Errorf("run K: %v", err)
		}
		ran <- j
	}()
	select {
	case id := <-entered:
		slots, _ := q1.Slots(ctx, "merchant")
		high, _ := g.get("m")
		t.Fatalf("%s entered its step while J's live claim (token %d) runs its own: %d jobs of a Concurrency-1 key at once; "+
			"worker 1's superseded claim (token %d) overwrote J's slot, and K took it as stale. Slots now: %+v", id, t2, high, t1, slots)
	case j := <-ran:
		if j == nil || j.Limited != "merchant=m" {
			t.Fatalf("K: %+v; want held back by merchant=m", j)
		}
	}
}

// Found by review; failed before its fix. A job whose worker died is never taken by a worker that is not
// its preferred one while the preferred one is busy.
//
// JOBS.md, "Where jobs run": "A worker that is gone (its session ended)
// stops being preferred at once ... its jobs move to the next worker by the
// hash. A worker that is alive but busy, stuck or cut off from etcd loses
// its jobs to the others after the fallback."
//
// What happens: J's owner (a worker without a completer) dies while
// running J. J's preferred worker w1 is busy (Concurrency(1), running a
// long job); w2 is idle and should take J FallbackAfter (300 ms) after it
// saw J's owner die. It never does: for a job whose owner's session is gone
// completer.when sets t = now (completer.go:318-319) and then, for a worker
// that is not preferred, t = max(t, seenAt) + fallback (completer.go:330-
// 333). Every time dispatch pops the job it asks when() again, gets now +
// fallback, which is after now, and re-queues it (completer.go:362-364):
// the fallback is always still ahead. The same holds for a job whose event
// came (completer.go:312-313) and for a limited job woken by a slot that
// freed (completer.go:314-315; TestReviewWokenLimitedJobTakenByFallback).
//
// Fix: count the fallback from a fixed instant: when the job became due as
// this worker saw it (note it in the entry when the owner's death, the
// event or the wakeup is seen), not from now.
func TestReviewAbandonedJobOfBusyPreferredWorkerIsTaken(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	const fb = 300 * time.Millisecond
	stuck := make(chan struct{}) // the dead worker's step: stuck until the test ends
	defer close(stuck)
	busy := make(chan struct{})
	defer close(busy)
	entered := make(chan string, 8)
	kind := func(worker string) Kind {
		return Kind{Name: "spread", Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			entered <- worker + ":" + r.Key().ID
			switch {
			case worker == "w0":
				<-stuck // a process that stopped: it never returns in time
			case r.Key().ID[:1] == "b":
				select {
				case <-busy:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			}
			return nil, nil
		}}}}
	}
	s0, s1, s2 := newStore(t, prefix), newStore(t, prefix), newStore(t, prefix)
	o1, o2 := waitOwner(t, s1), waitOwner(t, s2)
	q0, q1, q2 := newQueue(t, s0), newQueue(t, s1), newQueue(t, s2)
	w0 := newWorker(t, q0, []Kind{kind("w0")}, Concurrency(0))
	job, blocker := reviewPick("j", o1, o2), reviewPick("b", o1, o2)
	if _, err := q0.Submit(ctx, job, "spread", nil); err != nil {
		t.Fatal(err)
	}
	go w0.Run(ctx, job)
	if got := <-entered; got != "w0:"+job {
		t.Fatalf("%s; want w0 to run %s", got, job)
	}
	// w1, J's preferred worker, is busy with one long job.
	w1 := newWorker(t, q1, []Kind{kind("w1")}, Concurrency(1), FallbackAfter(fb), DrainTimeout(0))
	if _, err := q1.Submit(ctx, blocker, "spread", nil); err != nil {
		t.Fatal(err)
	}
	if got := <-entered; got != "w1:"+blocker {
		t.Fatalf("%s; want w1 to run %s", got, blocker)
	}
	_ = w1
	w2 := newWorker(t, q2, []Kind{kind("w2")}, Concurrency(1), FallbackAfter(fb), DrainTimeout(0))
	waitAdverts(t, q2, 2)
	waitFor(t, func() bool { w2.comp.mu.Lock(); defer w2.comp.mu.Unlock(); return len(w2.comp.workers) == 2 })
	// J's worker dies.
	endSession(t, s0)
	start := time.Now()
	j, ok := waitDone(t, q2, job, 15*time.Second)
	if !ok || j.State != Succeeded {
		t.Fatalf("%s, whose worker died, is %s %v after its death (owner gone, preferred worker busy, another idle with a %v fallback); want taken by the idle worker after the fallback",
			job, j.State, time.Since(start).Round(time.Millisecond), fb)
	}
}

// Found by review; failed before its fix. A limited job woken by a freed slot is never taken by a worker that
// is not its preferred one while the preferred one is busy.
//
// JOBS.md, "Per-key limits": a job held back "is tried again when a slot of
// its key frees (the completers follow the slots)"; "Where jobs run": "A
// worker that is alive but busy ... loses its jobs to the others after the
// fallback".
//
// What happens: L is held back by its merchant's slot (held by H). L's
// preferred worker w1 is busy; w2 is idle. H ends and frees the slot: w2
// marks L woken, and completer.when returns now + fallback for it
// (completer.go:314-315, 330-333) each time dispatch asks, so L is
// re-queued forever (completer.go:362-364). The woken mark also overrides
// L's NotBefore (the limitPoll), so not even the poll runs it. L runs only
// once w1 is free.
//
// Fix: as for TestReviewAbandonedJobOfBusyPreferredWorkerIsTaken: count the
// fallback from when the wakeup was seen.
func TestReviewWokenLimitedJobTakenByFallback(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	const fb = 300 * time.Millisecond
	busy := make(chan struct{})
	defer close(busy)
	holdH := make(chan struct{})
	entered := make(chan string, 8)
	var once sync.Once
	kind := func(worker string) Kind {
		return Kind{Name: "pay", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Concurrency: 1}},
			Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
				entered <- worker + ":" + r.Key().ID
				var wait <-chan struct{}
				switch r.Key().ID[:1] {
				case "b":
					wait = busy
				case "H":
					wait = holdH
				}
				if wait != nil {
					select {
					case <-wait:
					case <-ctx.Done():
						return nil, ctx.Err()
					}
				}
				return nil, nil
			}}}}
	}
	s0, s1, s2 := newStore(t, prefix), newStore(t, prefix), newStore(t, prefix)
	o1, o2 := waitOwner(t, s1), waitOwner(t, s2)
	q0, q1, q2 := newQueue(t, s0), newQueue(t, s1), newQueue(t, s2)
	w0 := newWorker(t, q0, []Kind{kind("w0")}, Concurrency(0), DrainTimeout(0))
	// H holds merchant m's only slot, on a worker without a completer.
	if _, err := q0.Submit(ctx, "H", "pay", []byte(`{"merchant":"m"}`)); err != nil {
		t.Fatal(err)
	}
	hDone := make(chan struct{})
	go func() { defer close(hDone); w0.Run(ctx, "H") }()
	if got := <-entered; got != "w0:H" {
		t.Fatalf("%s; want w0 to run H", got)
	}
	defer once.Do(func() { close(holdH) })
	// w1, L's preferred worker, is busy with one long job (of no merchant).
	blocker, job := reviewPick("b", o1, o2), reviewPick("L", o1, o2)
	newWorker(t, q1, []Kind{kind("w1")}, Concurrency(1), FallbackAfter(fb), DrainTimeout(0))
	if _, err := q1.Submit(ctx, blocker, "pay", nil); err != nil {
		t.Fatal(err)
	}
	if got := <-entered; got != "w1:"+blocker {
		t.Fatalf("%s; want w1 to run %s", got, blocker)
	}
	w2 := newWorker(t, q2, []Kind{kind("w2")}, Concurrency(1), FallbackAfter(fb), DrainTimeout(0))
	waitAdverts(t, q2, 2)
	waitFor(t, func() bool { w2.comp.mu.Lock(); defer w2.comp.mu.Unlock(); return len(w2.comp.workers) == 2 })
	if _, err := q1.Submit(ctx, job, "pay", []byte(`{"merchant":"m"}`)); err != nil {
		t.Fatal(err)
	}
	// w2 sees L held back by H's slot (its index, or a try).
	waitFor(t, func() bool {
		w2.comp.mu.Lock()
		defer w2.comp.mu.Unlock()
		for _, ids := range w2.comp.blocked {
			if ids[job] {
				return true
			}
		}
		return false
	})
	// H ends: the slot frees.
	once.Do(func() { close(holdH) })
	<-hDone
	start := time.Now()
	j, ok := waitDone(t, q2, job, 15*time.Second)
	if !ok || j.State != Succeeded {
		t.Fatalf("%s, held back by merchant=m, is %s (limited %q) %v after the slot freed (preferred worker busy, another idle with a %v fallback); want taken by the idle worker after the fallback",
			job, j.State, j.Limited, time.Since(start).Round(time.Millisecond), fb)
	}
}

// Found by review; failed before its fix. A rate limit whose period is longer than the store's retention is
// not kept: its slot is deleted with its retention lease, and the next
// attempt starts well within the period.
//
// JOBS.md, "Per-key limits": "At most `Burst` attempts of a key start in
// any `Burst/Rate` seconds"; Limit's comment (limit.go:36-38) the same. The
// doc also says "A rate slot is kept for the store's retention", but
// nothing checks that Burst/Rate fits in it: Limit.validate accepts any Rate
// down to one in a million seconds (limit.go:116), and Kind.validate checks
// MaxBackoff and Deadline against the retention but not a limit's period.
//
// What happens: with a 2 s retention, a limit of one attempt per 10 s
// (Rate 0.1, Burst 1): the first job takes the rate slot until +10 s, which
// is written on a retention lease (etcdstore.Retained, limit.go:369) and
// deleted after about 2-3 s; a second job of the same key then starts at
// once, 3 s after the first. With the default 24 h retention, a limit of one
// a day and a half lets two through in a day.
//
// Fix: refuse a Limit whose Burst/Rate exceeds the store's retention (as
// MaxBackoff is), or write rate slots on a lease as long as the period
// (or on none, deleting them when their time has come).
func TestReviewRateSlotOutlivesRetention(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	st := newStore(t, prefix, etcdstore.WithRetention(2*time.Second), etcdstore.WithBucketWidth(time.Second))
	q := newQueue(t, st)
	var mu sync.Mutex
	starts := map[string]time.Time{}
	k := Kind{Name: "tick", Backoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Rate: 0.1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			mu.Lock()
			starts[r.Key().ID] = time.Now()
			mu.Unlock()
			return nil, nil
		}}}}
	w, err := NewWorker(q, []Kind{k}, Concurrency(0))
	if errors.Is(err, ErrInvalid) && strings.Contains(err.Error(), "retention") {
		return // refused: the fix (a period longer than the retention is a configuration error)
	}
	if err != nil {
		t.Fatalf("a limit of one per 10 s on a store keeping things 2 s: %v", err)
	}
	t.Cleanup(func() { w.Close() })
	period := 10 * time.Second
	if _, err := q.Submit(ctx, "r1", "tick", []byte(`{"merchant":"m"}`)); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "r1"); err != nil || j.State != Succeeded {
		t.Fatalf("r1: %+v, %v", j, err)
	}
	mu.Lock()
	first := starts["r1"]
	mu.Unlock()
	slot := limitPrefix(q.tenant) + "merchant/m/r/0"
	// Wait, within the period, for the rate slot to go.
	for time.Since(first) < period-time.Second {
		v, err := storex.GetValue(st, ctx, slot)
		if err != nil {
			t.Fatal(err)
		}
		if v.Revision == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	// (Submitted now: a job record, too, is kept for the retention.)
	if _, err := q.Submit(ctx, "r2", "tick", []byte(`{"merchant":"m"}`)); err != nil {
		t.Fatal(err)
	}
	j, err := w.Run(ctx, "r2")
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	second, ran := starts["r2"]
	mu.Unlock()
	if ran && second.Sub(first) < period {
		t.Fatalf("r2 started %v after r1 (state %s); the limit allows one attempt per %v: the rate slot was deleted with its %v retention lease",
			second.Sub(first).Round(time.Millisecond), j.State, period, st.Retention())
	}
}

// Found by review; failed before its fix. A job whose key is an ordinary, readable value (a merchant's name
// of 30 Japanese characters, 90 bytes) is failed instead of limited.
//
// JOBS.md, "Per-key limits": "A job whose parameters give no key
// (`ParamKey` finds no field) is not limited; parameters the key function
// cannot read fail the job, with the error naming the limit." Nothing says a
// key has a length limit. Here ParamKey reads the key fine; the job fails
// anyway.
//
// What happens: limitsOf (limit.go:164-166) fails the job when the key,
// URL-path-escaped, is over 256 bytes. Escaping triples every non-ASCII
// byte, so a key of 86 bytes of UTF-8 (29 CJK characters) is enough. The
// job fails before it runs, although its parameters are valid and its key
// readable.
//
// Fix: name the slots by a digest of long keys (e.g. the first bytes of the
// key and a SHA-256 of the whole), keeping the key itself in the slot's
// value for Slots; or at least document the bound and check it at Submit.
func TestReviewLongUnicodeKeyFailsTheJob(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	k := Kind{Name: "pay", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Concurrency: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	name := ""
	for i := 0; i < 30; i++ {
		name += "店"
	}
	if _, err := q.Submit(ctx, "jp", "pay", []byte(`{"merchant":"`+name+`"}`)); err != nil {
		t.Fatal(err)
	}
	j, err := w.Run(ctx, "jp")
	if err != nil {
		t.Fatal(err)
	}
	if j.State != Succeeded {
		t.Fatalf("a job of merchant %q (%d bytes): %s (%s); want it limited by its merchant and run", name, len(name), j.State, j.Err)
	}
}

// Found by review; failed before its fix. Jobs held back by a rate limit are not free while they wait: every
// one of them is claimed and given back each time the key's next slot's
// time comes.
//
// JOBS.md, "Per-key limits", "Waiting is free": "it is tried again when a
// slot of its key frees ... or, for a rate, when the next slot's time comes.
// Completers do not even try a job whose key's slots their index shows
// taken: a merchant with ten thousand jobs queued costs no Txn per job while
// it waits."
//
// What happens: a job that finds a key's rate slots used is given back with
// NotBefore = the soonest slot's time (limit.go:365, 433), the same time for
// every job of the key. At that time every waiting job is due; the
// completer claims them all (room, completer.go:553, looks at concurrency
// slots only), one takes the slot, every other reads the slots and is given
// back to the next soonest. N jobs of a key cost about N²/2 claims and
// give-backs instead of about N: 40 jobs at 20 a second here. (Each writes
// the job's record twice: claim and give-back.)
//
// Fix: follow the rate slots in the completer's index as the concurrency
// slots are (the values are on the feed already: setSlot skips /r/), and
// let only as many jobs of a key due as it has slots whose time has come;
// or give held-back jobs staggered NotBefores (soonest + i·period/Burst).
func TestReviewRateLimitedJobsWaitForFree(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	k := Kind{Name: "tick", Limits: []Limit{{Name: "merchant", Key: ParamKey("merchant"), Rate: 20, Burst: 1}},
		Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}}}
	const n = 40
	for i := 0; i < n; i++ {
		if _, err := q.Submit(ctx, fmt.Sprintf("r%d", i), "tick", []byte(`{"merchant":"m"}`)); err != nil {
			t.Fatal(err)
		}
	}
	cli := cluster.MustClient(t)
	before, err := cli.Get(ctx, "/nothing")
	if err != nil {
		t.Fatal(err)
	}
	newWorker(t, q, []Kind{k}, Concurrency(4), FallbackAfter(0))
	for i := 0; i < n; i++ {
		if j := waitJob(t, q, fmt.Sprintf("r%d", i)); j.State != Succeeded {
			t.Fatalf("r%d: %s", i, j.State)
		}
	}
	after, err := cli.Get(ctx, "/nothing")
	if err != nil {
		t.Fatal(err)
	}
	writes := after.Header.Revision - before.Header.Revision
	// A job that runs at once costs a claim, a rate slot and its end
	// (3 writes); allow as much again for waiting.
	if per := float64(writes) / n; per > 6 {
		t.Fatalf("%d jobs of one rate-limited key took %d etcd writes, %.1f a job; a job run at once takes 3", n, writes, per)
	}
}

// Found by review; failed before its fix. Of two workers on one store (one process running two kinds with
// different concurrencies, say), only the first is advertised: the second's
// kinds have no worker in the process's zone as far as the others know, and
// its zone's jobs of those kinds run in another zone.
//
// JOBS.md, "Where jobs run": "Each worker advertises itself in etcd ... its
// zone and the kinds it runs", and "a job submitted in a data centre runs
// there while that data centre has a worker of its kind".
//
// What happens: the advert's name is the store's owner alone
// (w/<tenant>/<owner>, spread.go:81). The second worker's SetValue (rev 0)
// finds the first's advert there, with other kinds, and gives up on it
// (spread.go:82-88: neither ok nor the same value; it tries again every
// second, forever). Every completer then sees dc-a's process run only
// "other": a "spread" job submitted in dc-a prefers dc-b's worker (the only
// advertised one of its kind), which takes it at once, while dc-a's worker
// waits its fallback.
//
// Fix: one advert per worker (w/<tenant>/<owner>/<worker id>), or merge the
// kinds of the process's workers into one advert; a rendezvous over owners
// then needs the owner's kinds as the union.
func TestReviewTwoWorkersOnOneStoreBothAdvertised(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	log := &runLog{ran: map[string]string{}}
	qa := newQueue(t, newStore(t, prefix), WithZone("dc-a"))
	other := Kind{Name: "other", Steps: []Step{{Name: "s", Run: func(ctx context.Context, r *Run) ([]byte, error) { return nil, nil }}}}
	w1 := newWorker(t, qa, []Kind{other}, Concurrency(1))
	waitAdverts(t, qa, 1)
	w2 := newWorker(t, qa, []Kind{log.kind("dc-a", nil)}, Concurrency(4))
	qb := newQueue(t, newStore(t, prefix), WithZone("dc-b"))
	w3 := newWorker(t, qb, []Kind{log.kind("dc-b", nil)}, Concurrency(4))
	// (Fixed: one advert per worker, three in all; every completer knows them.)
	waitAdverts(t, qa, 3)
	for _, w := range []*Worker{w1, w2, w3} {
		waitFor(t, func() bool { w.comp.mu.Lock(); defer w.comp.mu.Unlock(); return len(w.comp.workers) == 3 })
	}
	var ids []string
	for i := 0; i < 10; i++ {
		ids = append(ids, fmt.Sprintf("a-%d", i))
		if _, err := qa.Submit(ctx, ids[i], "spread", nil); err != nil {
			t.Fatal(err)
		}
	}
	elsewhere := 0
	for _, id := range ids {
		if j := waitJob(t, qa, id); j.State != Succeeded {
			t.Fatalf("%s: %s", id, j.State)
		}
		log.mu.Lock()
		if log.ran[id] != "dc-a" {
			elsewhere++
		}
		log.mu.Unlock()
	}
	if elsewhere > 0 {
		vals, _ := storex.Values(qa.store, ctx, advertPrefix(qa.tenant))
		var ads []string
		for _, v := range vals {
			ads = append(ads, string(v.Value))
		}
		t.Fatalf("%d of %d jobs submitted in dc-a, which has a worker of their kind, ran in dc-b; adverts: %v", elsewhere, len(ids), ads)
	}
}
