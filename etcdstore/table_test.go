package etcdstore

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The decision table, one row per test, in its order: new key, fingerprint
// differs, done, in flight under a live owner, in flight and stale.

func TestNewKeyRunsWorkAndSavesOutcome(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{Tenant: "acme", ID: "order-1"}

	var runs atomic.Int32
	res, err := s.Do(ctx, key, []byte(`{"amount":100}`), func(ctx context.Context, c *Claim) ([]byte, error) {
		runs.Add(1)
		return []byte("charged 100"), nil
	})
	if err != nil {
		t.Fatalf("Do: %v", err)
	}
	if res.Replayed || string(res.Body) != "charged 100" || runs.Load() != 1 {
		t.Fatalf("Do = %+v, runs %d; want fresh result, 1 run", res, runs.Load())
	}
	rec, err := s.Get(ctx, key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.State != Done || string(rec.Outcome.Body) != "charged 100" || rec.Token != res.Token {
		t.Fatalf("record = %+v; want done with the body and token %d", rec, res.Token)
	}
	// The token is the revision at which the record was created.
	resp, err := cli.Get(ctx, s.ks.record(key))
	if err != nil {
		t.Fatal(err)
	}
	if got := int64(res.Token); got != resp.Kvs[0].CreateRevision {
		t.Fatalf("token %d; want the record's CreateRevision %d", got, resp.Kvs[0].CreateRevision)
	}
	if resp.Kvs[0].Lease == 0 {
		t.Fatal("record is not attached to a retention lease")
	}
}

func TestMismatchNeverRunsNeverReplaysNeverWrites(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}

	// In flight: a claim held by this process.
	c, _, err := s.Claim(ctx, key, fpOf(t, `{"amount":100}`))
	if err != nil {
		t.Fatal(err)
	}
	check := func(state string) {
		t.Helper()
		before := revision(t, cli)
		var ran bool
		_, err := s.Do(ctx, key, []byte(`{"amount":200}`), func(context.Context, *Claim) ([]byte, error) {
			ran = true
			return nil, nil
		})
		var me *MismatchError
		if !errors.As(err, &me) || !errors.Is(err, ErrMismatch) || me.Key != key {
			t.Fatalf("%s: Do with other params = %v; want *MismatchError for %v", state, err, key)
		}
		if ran {
			t.Fatalf("%s: work ran on a mismatch", state)
		}
		if after := revision(t, cli); after != before {
			t.Fatalf("%s: revision moved %d -> %d on a mismatch", state, before, after)
		}
	}
	check("in flight")
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
	check("done")
}

func TestDoneReplaysWithoutRunningOrWriting(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	other := newStore(t, cli, prefix) // another process
	ctx := testCtx(t)
	key := Key{ID: "k"}
	body := bytes.Repeat([]byte{0, 1, 2, 0xff}, 1000) // binary, not text

	first, err := s.Do(ctx, key, []byte(`{"a":1,"b":2}`), func(context.Context, *Claim) ([]byte, error) { return body, nil })
	if err != nil {
		t.Fatal(err)
	}
	before := revision(t, cli)
	for _, st := range []*Store{s, other} {
		// Same params, spelled differently: canonical JSON makes them equal.
		res, err := st.Do(ctx, key, []byte("{ \"b\": 2, \"a\": 1.0 }"), func(context.Context, *Claim) ([]byte, error) {
			t.Fatal("work ran on a replay")
			return nil, nil
		})
		if err != nil {
			t.Fatalf("replay: %v", err)
		}
		if !res.Replayed || !bytes.Equal(res.Body, body) || res.Token != first.Token {
			t.Fatalf("replay = replayed %v, %d bytes, token %d; want replayed, identical body, token %d", res.Replayed, len(res.Body), res.Token, first.Token)
		}
	}
	if after := revision(t, cli); after != before {
		t.Fatalf("replays moved the revision %d -> %d", before, after)
	}
}

func TestInFlightLiveOwnerConflicts(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	owner := newStore(t, cli, prefix)
	other := newStore(t, cli, prefix, WithRetryAfter(3*time.Second))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	c, _, err := owner.Claim(ctx, key, fp)
	if err != nil {
		t.Fatal(err)
	}
	for name, st := range map[string]*Store{"same process": owner, "other process": other} {
		before := revision(t, cli)
		_, _, err := st.Claim(ctx, key, fp)
		var ce *ConflictError
		if !errors.As(err, &ce) || !errors.Is(err, ErrConflict) {
			t.Fatalf("%s: Claim of an in-flight key = %v; want *ConflictError", name, err)
		}
		if ce.Token != c.Token() || ce.RetryAfter <= 0 {
			t.Fatalf("%s: conflict %+v; want token %d and a retry hint", name, ce, c.Token())
		}
		if after := revision(t, cli); after != before {
			t.Fatalf("%s: a conflict moved the revision %d -> %d", name, before, after)
		}
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
}

func TestConflictRetryAfterFollowsDeadline(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	owner := newStore(t, cli, prefix)
	other := newStore(t, cli, prefix, WithRetryAfter(time.Hour))
	ctx := testCtx(t)
	c, _, err := owner.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithDeadline(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	_, _, err = other.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"))
	var ce *ConflictError
	if !errors.As(err, &ce) || ce.RetryAfter > time.Minute {
		t.Fatalf("conflict = %v; want a retry hint no later than the deadline", err)
	}
}

func TestStaleOwnerIsTakenOverOnce(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	dead := newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	old, _, err := dead.Claim(ctx, key, fp)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Checkpoint(ctx, []byte("step-1")); err != nil {
		t.Fatal(err)
	}
	// The owner's process dies: its session lease goes, and its owner key
	// with it.
	if _, err := cli.Revoke(ctx, dead.sessionLeaseID()); err != nil {
		t.Fatal(err)
	}
	<-old.Done()
	if !errors.Is(old.Err(), ErrSessionLost) {
		t.Fatalf("claim context cause = %v; want ErrSessionLost", old.Err())
	}

	// Several processes race to take over; exactly one wins.
	const racers = 8
	type result struct {
		c   *Claim
		err error
	}
	results := make(chan result, racers)
	for i := 0; i < racers; i++ {
		st := newStore(t, cli, prefix)
		go func() {
			c, _, err := st.Claim(ctx, key, fp)
			results <- result{c, err}
		}()
	}
	var winner *Claim
	for i := 0; i < racers; i++ {
		r := <-results
		switch {
		case r.err == nil && winner == nil:
			winner = r.c
		case r.err == nil:
			t.Fatalf("two takeovers won: tokens %d and %d", winner.Token(), r.c.Token())
		case !errors.Is(r.err, ErrConflict):
			t.Fatalf("losing takeover = %v; want ErrConflict", r.err)
		}
	}
	if winner == nil {
		t.Fatal("no takeover won")
	}
	if !winner.TookOver() || winner.Token() <= old.Token() || string(winner.LastCheckpoint()) != "step-1" {
		t.Fatalf("takeover: tookOver %v, token %d (old %d), checkpoint %q; want true, greater, step-1",
			winner.TookOver(), winner.Token(), old.Token(), winner.LastCheckpoint())
	}
	if p := winner.Previous(); p == nil || p.Token != old.Token() {
		t.Fatalf("Previous = %+v; want the old claim", p)
	}
	if err := winner.Complete(ctx, Outcome{Body: []byte("new")}); err != nil {
		t.Fatal(err)
	}
	// The old worker wakes up: every write it tries is fenced out.
	if err := old.Complete(ctx, Outcome{Body: []byte("old")}); !errors.Is(err, ErrFenced) {
		t.Fatalf("late Complete = %v; want ErrFenced", err)
	}
	rec, err := winner.s.Get(ctx, key)
	if err != nil || string(rec.Outcome.Body) != "new" {
		t.Fatalf("outcome = %v, %v; want the new owner's", rec, err)
	}
}

func TestDeadlinePassedIsTakenOver(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	slow := newStore(t, cli, prefix)
	fast := newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	old, _, err := slow.Claim(ctx, key, fp, WithDeadline(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	<-old.Done() // the claim's own context ends at its deadline
	if !errors.Is(old.Err(), ErrDeadline) {
		t.Fatalf("cause = %v; want ErrDeadline", old.Err())
	}
	c, _, err := fast.Claim(ctx, key, fp)
	if err != nil {
		t.Fatalf("claim after the deadline: %v", err)
	}
	if !c.TookOver() || c.Token() <= old.Token() {
		t.Fatalf("tookOver %v token %d; want a takeover with a token above %d", c.TookOver(), c.Token(), old.Token())
	}
	if err := old.Complete(ctx, Outcome{}); !errors.Is(err, ErrFenced) {
		t.Fatalf("late Complete = %v; want ErrFenced", err)
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
}

func TestOwnerAliveWithinDeadlineConflicts(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	c, _, err := a.Claim(ctx, Key{ID: "k"}, fpOf(t, "p"), WithDeadline(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release(ctx)
	if _, _, err := b.Claim(ctx, Key{ID: "k"}, fpOf(t, "p")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Claim = %v; want ErrConflict", err)
	}
}

func TestAbandonedClaimIsResumedAtOnce(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	c, _, err := a.Claim(ctx, key, fp)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(ctx, []byte("step-2")); err != nil {
		t.Fatal(err)
	}
	if err := c.Abandon(ctx); err != nil {
		t.Fatal(err)
	}
	// Another live process resumes it without waiting for a lease.
	n, _, err := b.Claim(ctx, key, fp)
	if err != nil {
		t.Fatalf("claim of an abandoned key: %v", err)
	}
	if !n.TookOver() || string(n.LastCheckpoint()) != "step-2" || n.Token() <= c.Token() {
		t.Fatalf("resume: tookOver %v checkpoint %q token %d; want true, step-2, above %d", n.TookOver(), n.LastCheckpoint(), n.Token(), c.Token())
	}
	if err := n.Complete(ctx, Outcome{Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
}

func TestOrphanOfThisProcessIsTakenOverAtOnce(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	s := newStore(t, cli, prefix)
	other := newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	fp := fpOf(t, "p")

	// A handler claimed, then gave up without ending its claim (as after an
	// ambiguous error): the record is owned by this live session, but nobody
	// here runs it.
	orphan, _, err := s.Claim(ctx, key, fp)
	if err != nil {
		t.Fatal(err)
	}
	s.unregister(orphan)

	// Another process still sees a live owner.
	if _, _, err := other.Claim(ctx, key, fp); !errors.Is(err, ErrConflict) {
		t.Fatalf("other process: %v; want ErrConflict", err)
	}
	// This process knows better.
	c, _, err := s.Claim(ctx, key, fp)
	if err != nil {
		t.Fatalf("same process: %v; want a takeover of its orphan", err)
	}
	if c.Token() <= orphan.Token() || !c.TookOver() {
		t.Fatalf("token %d tookOver %v; want above %d, true", c.Token(), c.TookOver(), orphan.Token())
	}
	if err := orphan.Complete(ctx, Outcome{}); !errors.Is(err, ErrFenced) {
		t.Fatalf("orphan's late Complete = %v; want ErrFenced", err)
	}
	if err := c.Complete(ctx, Outcome{Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
}

func TestReleaseLetsRetryRunAgain(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	var runs atomic.Int32
	fail := errors.New("card declined by a flaky network")
	work := func(context.Context, *Claim) ([]byte, error) {
		if runs.Add(1) == 1 {
			return nil, fail
		}
		return []byte("charged"), nil
	}
	if _, err := s.Do(ctx, key, nil, work, OnError(EndRelease)); !errors.Is(err, fail) {
		t.Fatalf("first Do = %v; want the work's error", err)
	}
	if _, err := s.Get(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after release, Get = %v; want ErrNotFound", err)
	}
	res, err := s.Do(ctx, key, nil, work, OnError(EndRelease))
	if err != nil || string(res.Body) != "charged" || runs.Load() != 2 {
		t.Fatalf("retry = %+v, %v, runs %d; want charged after 2 runs", res, err, runs.Load())
	}
}

func TestSavedErrorIsReplayed(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	var runs atomic.Int32
	work := func(context.Context, *Claim) ([]byte, error) {
		runs.Add(1)
		return nil, errors.New("insufficient funds")
	}
	if _, err := s.Do(ctx, key, nil, work); err == nil || err.Error() != "insufficient funds" {
		t.Fatalf("first Do = %v; want the work's error", err)
	}
	res, err := s.Do(ctx, key, nil, work)
	var se *SavedError
	if !errors.As(err, &se) || se.Message != "insufficient funds" || !res.Replayed {
		t.Fatalf("replay = %+v, %v; want a replayed *SavedError", res, err)
	}
	if runs.Load() != 1 {
		t.Fatalf("work ran %d times; want 1", runs.Load())
	}
}

func TestAbandonOnErrorResumesFromCheckpoint(t *testing.T) {
	cli := client(t)
	prefix := testPrefix(t)
	a, b := newStore(t, cli, prefix), newStore(t, cli, prefix)
	ctx := testCtx(t)
	key := Key{ID: "k"}
	var resumedFrom string
	_, err := a.Do(ctx, key, nil, func(ctx context.Context, c *Claim) ([]byte, error) {
		if err := c.Checkpoint(ctx, []byte("charged; email not sent")); err != nil {
			return nil, err
		}
		return nil, errors.New("smtp down")
	}, OnError(EndAbandon))
	if err == nil {
		t.Fatal("want the work's error")
	}
	res, err := b.Do(ctx, key, nil, func(ctx context.Context, c *Claim) ([]byte, error) {
		resumedFrom = string(c.LastCheckpoint())
		return []byte("emailed"), nil
	})
	if err != nil || string(res.Body) != "emailed" || resumedFrom != "charged; email not sent" {
		t.Fatalf("resume = %+v, %v from %q; want emailed from the checkpoint", res, err, resumedFrom)
	}
}

func TestCancelledWorkIsAbandonedNotSaved(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	cctx, cancel := context.WithCancel(ctx)
	_, err := s.Do(cctx, key, nil, func(ctx context.Context, c *Claim) ([]byte, error) {
		cancel() // the client hangs up mid-work
		<-ctx.Done()
		return nil, ctx.Err()
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Do = %v; want context.Canceled", err)
	}
	rec, err := s.Get(ctx, key)
	if err != nil || rec.State != InFlight || rec.Owner != "" {
		t.Fatalf("record = %+v, %v; want in flight, abandoned", rec, err)
	}
	res, err := s.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return []byte("ok"), nil })
	if err != nil || string(res.Body) != "ok" {
		t.Fatalf("next request = %+v, %v; want it to resume and finish", res, err)
	}
}

// A work that panics may have acted before it did: by default the panic is
// saved as the key's outcome (a retry must not run it again); with
// EndAbandon the claim is abandoned for the next request to resume. Either
// way the claim ends and the panic continues.
func TestPanickingWorkEndsAsOnErrorSays(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	for _, tc := range []struct {
		key  string
		opts []RunOption
		want func(*Record) bool
	}{
		{"saved", nil, func(r *Record) bool { return r.State == Done && strings.Contains(r.Outcome.Err, "boom") }},
		{"kept", []RunOption{OnError(EndAbandon)}, func(r *Record) bool { return r.State == InFlight && r.Owner == "" }},
	} {
		key := Key{ID: tc.key}
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("the panic was swallowed")
				}
			}()
			s.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { panic("boom") }, tc.opts...)
		}()
		if s.Metrics().Running != 0 {
			t.Fatalf("%s: Running = %d after the panic; want 0", tc.key, s.Metrics().Running)
		}
		rec, err := s.Get(ctx, key)
		if err != nil || !tc.want(rec) {
			t.Fatalf("%s: record = %+v, %v", tc.key, rec, err)
		}
	}
}
