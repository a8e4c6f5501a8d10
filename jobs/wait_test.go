package jobs

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// waitUntil follows job id on a Watch until ok says yes, and returns it.
func waitUntil(t *testing.T, q *Queue, id string, ok func(*Job) bool) *Job {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		st, _, err := q.holder(ctx, id) // (its shard, on a shard set)
		if err != nil {
			t.Fatalf("follow %s: %v", id, err)
		}
		feed, err := storex.Follow(st, ctx, q.tenant, storex.FollowOptions{ID: id})
		if err != nil {
			t.Fatalf("follow %s: %v", id, err)
		}
		for _, rec := range feed.Records() {
			if j, err := FromRecord(rec, q.clock.Now()); err == nil && ok(j) {
				feed.Close()
				return j
			}
		}
		for {
			changes, err := feed.Next(ctx)
			if err != nil {
				if ctx.Err() != nil {
					feed.Close()
					j, _ := q.Get(context.Background(), id)
					t.Fatalf("job %s never reached the state waited for; it is %+v", id, j)
				}
				break
			}
			for _, c := range changes {
				if c.Record == nil {
					continue
				}
				if j, err := FromRecord(c.Record, q.clock.Now()); err == nil && ok(j) {
					feed.Close()
					return j
				}
			}
		}
		feed.Close()
	}
}

// timeline records when (on a fake clock) and by which token steps ran.
type timeline struct {
	mu   sync.Mutex
	runs map[string][]time.Time
}

func (tl *timeline) note(step string, at time.Time) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if tl.runs == nil {
		tl.runs = map[string][]time.Time{}
	}
	tl.runs[step] = append(tl.runs[step], at)
}

func (tl *timeline) of(step string) []time.Time {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return append([]time.Time(nil), tl.runs[step]...)
}

// A 12 h sleep whose worker goes away after 8 h sleeps 4 more: the wake-up
// time was saved once, when the sleep began; the job is held by no worker
// while it sleeps, the step before it never runs again, and the sleep costs
// no attempt.
func TestSleepResumedAfterACrashSleepsWhatIsLeft(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	var tl timeline
	k := func(q *Queue) Kind {
		return Kind{Name: "reminder", Steps: []Step{
			{Name: "book", Run: func(ctx context.Context, r *Run) ([]byte, error) { tl.note("book", q.clock.Now()); return nil, nil }},
			SleepStep("nap", 12*time.Hour),
			{Name: "remind", Run: func(ctx context.Context, r *Run) ([]byte, error) { tl.note("remind", q.clock.Now()); return nil, nil }},
		}}
	}
	qa := newQueue(t, newStore(t, prefix, etcdstore.WithRetention(72*time.Hour)))
	qa.setClock(fc.view(0))
	wa := newWorker(t, qa, []Kind{k(qa)}, Concurrency(1))
	if _, err := qa.Submit(ctx, "r-1", "reminder", nil); err != nil {
		t.Fatal(err)
	}
	j := waitUntil(t, qa, "r-1", func(j *Job) bool { return j.State == Scheduled })
	if want := t0.Add(12 * time.Hour); !j.NotBefore.Equal(want) || j.Owner != "" || j.Attempts != 0 {
		t.Fatalf("sleeping job: not before %v, owner %q, attempts %d; want %v, no owner, no attempt counted", j.NotBefore, j.Owner, j.Attempts, want)
	}
	wa.Close() // the worker goes away

	fc.set(t0.Add(8 * time.Hour))
	qb := newQueue(t, newStore(t, prefix, etcdstore.WithRetention(72*time.Hour)))
	qb.setClock(fc.view(0))
	wb := newWorker(t, qb, []Kind{k(qb)}, Concurrency(1))
	j, err := wb.Run(ctx, "r-1") // asked to run it 8 h in: it still sleeps
	if err != nil || j.State != Scheduled || !j.NotBefore.Equal(t0.Add(12*time.Hour)) {
		t.Fatalf("Run 8 h into a 12 h sleep = %+v, %v; want it left scheduled for %v", j, err, t0.Add(12*time.Hour))
	}
	if got := tl.of("remind"); len(got) != 0 {
		t.Fatalf("the step after the sleep ran at %v, 8 h into a 12 h sleep", got)
	}
	fc.set(t0.Add(12 * time.Hour)) // 4 h more: the completer's timer fires
	j = waitJob(t, qb, "r-1")
	if j.State != Succeeded || j.Attempts != 1 {
		t.Fatalf("job %s after %d attempts; want succeeded, the sleep costing no attempt", j.State, j.Attempts)
	}
	if got := tl.of("book"); len(got) != 1 {
		t.Fatalf("step book ran %d times; want once", len(got))
	}
	if got := tl.of("remind"); len(got) != 1 || got[0].Before(t0.Add(12*time.Hour)) {
		t.Fatalf("step remind ran at %v; want once, 12 h after the sleep began (%v)", got, t0.Add(12*time.Hour))
	}
}

// Run.Sleep inside a step: the code before it runs again when the job
// wakes (documented), the sleep does not; a run that reaches its waits in
// another order fails with ErrNondeterministic.
func TestSleepInsideAStep(t *testing.T) {
	ctx := testCtx(t)
	q := newQueue(t, newStore(t, testPrefix(t)))
	var mu sync.Mutex
	before, after := 0, 0
	k := Kind{Name: "nap", Steps: []Step{{Name: "only", Run: func(ctx context.Context, r *Run) ([]byte, error) {
		mu.Lock()
		before++
		mu.Unlock()
		if err := r.Sleep(300 * time.Millisecond); err != nil {
			return nil, err
		}
		mu.Lock()
		after++
		mu.Unlock()
		return []byte(`"rested"`), nil
	}}}}
	start := time.Now()
	newWorker(t, q, []Kind{k}, Concurrency(1))
	if _, err := q.Submit(ctx, "n-1", "nap", nil); err != nil {
		t.Fatal(err)
	}
	j := waitJob(t, q, "n-1")
	if j.State != Succeeded || string(j.Output("only")) != `"rested"` || time.Since(start) < 300*time.Millisecond {
		t.Fatalf("job %+v after %v", j, time.Since(start))
	}
	if before != 2 || after != 1 {
		t.Fatalf("code before the sleep ran %d times, after it %d; want 2 and 1", before, after)
	}

	flip := Kind{Name: "flip", MaxAttempts: 1, Steps: []Step{{Name: "only", OnError: Fail, Run: func(ctx context.Context, r *Run) ([]byte, error) {
		if r.Attempt() == 1 && len(r.st.Waits) == 0 {
			return nil, r.Sleep(time.Millisecond)
		}
		_, err := r.Await("go", time.Second) // where the first run slept
		return nil, err
	}}}}
	q2 := newQueue(t, newStore(t, testPrefix(t)))
	newWorker(t, q2, []Kind{flip}, Concurrency(1))
	if _, err := q2.Submit(ctx, "f-1", "flip", nil); err != nil {
		t.Fatal(err)
	}
	if j := waitJob(t, q2, "f-1"); j.State != Failed || !strings.Contains(j.Err, ErrNondeterministic.Error()) {
		t.Fatalf("job %+v; want failed as nondeterministic", j)
	}
}

// An event signalled before the job waits is kept; signalled twice, from
// two processes, it is delivered once; another payload is refused; the
// payload is the await step's output.
func TestAwaitAnEventSignalledBeforeAndTwice(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q1 := newQueue(t, newStore(t, prefix))
	q2 := newQueue(t, newStore(t, prefix))
	var mu sync.Mutex
	var got [][]byte
	k := Kind{Name: "refund", Steps: []Step{
		AwaitStep("approval", "approved", time.Minute, Fail),
		{Name: "pay", Run: func(ctx context.Context, r *Run) ([]byte, error) {
			mu.Lock()
			got = append(got, r.Output("approval"))
			mu.Unlock()
			return nil, nil
		}},
	}}
	if _, err := q1.Submit(ctx, "rf-1", "refund", nil); err != nil {
		t.Fatal(err)
	}
	for _, q := range []*Queue{q1, q2, q1} {
		if err := q.Signal(ctx, "rf-1", "approved", []byte(`{"by":"ada"}`)); err != nil {
			t.Fatalf("Signal: %v", err)
		}
	}
	if err := q2.Signal(ctx, "rf-1", "approved", []byte(`{"by":"bob"}`)); !errors.Is(err, ErrSignalMismatch) {
		t.Fatalf("Signal with another payload = %v; want ErrSignalMismatch", err)
	}
	newWorker(t, q2, []Kind{k}, Concurrency(1))
	j := waitJob(t, q1, "rf-1")
	if j.State != Succeeded || string(j.Output("approval")) != `{"by":"ada"}` || j.Attempts != 1 {
		t.Fatalf("job %+v; want succeeded in one attempt with ada's approval", j)
	}
	if len(got) != 1 || string(got[0]) != `{"by":"ada"}` {
		t.Fatalf("pay saw %q; want ada's approval once", got)
	}
	if err := q2.Signal(ctx, "rf-1", "approved", []byte(`{"by":"ada"}`)); !errors.Is(err, ErrFinal) {
		t.Fatalf("Signal to an ended job = %v; want ErrFinal", err)
	}
}

// A job waiting for an event is held by no worker and woken by the signal
// through the completer's watch; Worker.Run leaves it waiting (no takeover)
// until the event comes.
func TestAwaitWokenBySignal(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	q := newQueue(t, newStore(t, prefix))
	k := Kind{Name: "approve", Steps: []Step{AwaitStep("wait", "go", 0, Fail)}}
	if _, err := q.Submit(ctx, "a-1", "approve", nil); err != nil {
		t.Fatal(err)
	}
	w := newWorker(t, newQueue(t, newStore(t, prefix)), []Kind{k}, Concurrency(2))
	j := waitUntil(t, q, "a-1", func(j *Job) bool { return j.State == Waiting })
	if j.Awaiting != "go" || j.Owner != "" || j.Attempts != 0 {
		t.Fatalf("waiting job %+v; want awaiting go, unowned, no attempt counted", j)
	}
	again, err := w.Run(ctx, "a-1")
	if err != nil || again.State != Waiting || again.Token != j.Token {
		t.Fatalf("Run of a waiting job = %+v, %v; want it left as it was (token %d)", again, err, j.Token)
	}
	if err := q.Signal(ctx, "a-1", "go", []byte(`"now"`)); err != nil {
		t.Fatal(err)
	}
	if j := waitJob(t, q, "a-1"); j.State != Succeeded || string(j.Output("wait")) != `"now"` || j.Attempts != 1 {
		t.Fatalf("job %+v; want succeeded with the payload, in one attempt", j)
	}
}

// An await that times out returns ErrTimeout, and the step fails as its
// policy says; what it decided is saved, so a signal that comes later
// changes nothing.
func TestAwaitTimesOut(t *testing.T) {
	ctx := testCtx(t)
	t0 := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	fc := newFakeClock(t0)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(fc.view(0))
	k := Kind{Name: "approve", Steps: []Step{AwaitStep("wait", "go", time.Hour, Fail)}}
	newWorker(t, q, []Kind{k}, Concurrency(1))
	if _, err := q.Submit(ctx, "t-1", "approve", nil); err != nil {
		t.Fatal(err)
	}
	j := waitUntil(t, q, "t-1", func(j *Job) bool { return j.State == Waiting })
	if !j.NotBefore.Equal(t0.Add(time.Hour)) {
		t.Fatalf("waiting job times out at %v; want %v", j.NotBefore, t0.Add(time.Hour))
	}
	fc.set(t0.Add(time.Hour))
	j = waitJob(t, q, "t-1")
	if j.State != Failed || !strings.Contains(j.Err, ErrTimeout.Error()) {
		t.Fatalf("job %+v; want failed with the timeout", j)
	}
}

// Bad signals are refused with an error naming what is wrong, and write
// nothing.
func TestSignalRefusals(t *testing.T) {
	ctx := testCtx(t)
	s := newStore(t, testPrefix(t), etcdstore.WithMaxRecordSize(4096))
	q := newQueue(t, s)
	if _, err := q.Submit(ctx, "s-1", "any", nil); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		id, name string
		payload  []byte
		want     error
	}{
		{"nobody", "go", nil, etcdstore.ErrNotFound},
		{"s-1", "", nil, ErrInvalid},
		{"s-1", "a/b", nil, ErrInvalid},
		{"s-1", "go", make([]byte, 2049), ErrInvalid},
		{"bad id", "go", nil, etcdstore.ErrInvalidKey},
	} {
		if err := q.Signal(ctx, c.id, c.name, c.payload); !errors.Is(err, c.want) {
			t.Errorf("Signal(%q, %q, %d bytes) = %v; want %v", c.id, c.name, len(c.payload), err, c.want)
		}
	}
	if vs, err := storex.Values(s, ctx, eventPrefix(q.tenant)); err != nil || len(vs) != 0 {
		t.Fatalf("events after refused signals: %v, %v; want none", vs, err)
	}
}

// A wait is saved in milliseconds: its end is rounded up, never down, so a
// sleep that began between two milliseconds does not end early (found by
// the explorer, invariant W1).
func TestSleepBetweenMillisecondsIsNotShort(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	t0 := base.Add(300 * time.Microsecond)
	fc := newFakeClock(t0)
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(fc.view(0))
	k := Kind{Name: "nap", Steps: []Step{SleepStep("nap", time.Second)}}
	w := newWorker(t, q, []Kind{k}, Concurrency(0))
	if _, err := q.Submit(ctx, "n-1", "nap", nil); err != nil {
		t.Fatal(err)
	}
	if j, err := w.Run(ctx, "n-1"); err != nil || j.State != Scheduled {
		t.Fatalf("Run = %+v, %v; want it asleep", j, err)
	}
	fc.set(base.Add(time.Second)) // 999.7 ms after the sleep began
	if j, err := w.Run(ctx, "n-1"); err != nil || j.State != Scheduled {
		t.Fatalf("Run 999.7 ms into a 1 s sleep = %+v, %v; want it still asleep", j, err)
	}
	fc.set(base.Add(time.Second + time.Millisecond)) // rounded up: at most a millisecond more
	if j, err := w.Run(ctx, "n-1"); err != nil || j.State != Succeeded {
		t.Fatalf("Run 1.0007 s into a 1 s sleep = %+v, %v; want it woken and done", j, err)
	}
}
