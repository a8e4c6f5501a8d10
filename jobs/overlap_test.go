package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// waitCursorWhere follows schedule name's cursor on a Watch until ok says
// yes, and returns it.
func waitCursorWhere(t *testing.T, q *Queue, name string, ok func(cursorValue) bool) cursorValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli := cluster.MustClient(t)
	key := q.store.Prefix() + "j/" + cursorName(q.tenant, name)
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var cv cursorValue
	if len(resp.Kvs) == 1 && json.Unmarshal(resp.Kvs[0].Value, &cv) == nil && ok(cv) {
		return cv
	}
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1)) {
		for _, ev := range wr.Events {
			if json.Unmarshal(ev.Kv.Value, &cv) == nil && ok(cv) {
				return cv
			}
		}
	}
	t.Fatalf("schedule %s's cursor never reached the state waited for; last %+v", name, cv)
	return cv
}

func exists(t *testing.T, q *Queue, id string) bool {
	t.Helper()
	_, err := q.Get(testCtx(t), id)
	if err != nil && !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatal(err)
	}
	return err == nil
}

// OverlapSkip: an occurrence that comes while the previous one's job has
// not ended is skipped; once it ended, the next occurrence runs.
// OverlapBufferOne: the first such occurrence is held and submitted when
// the job before it ends; a second one meanwhile is skipped.
func TestOverlapPolicies(t *testing.T) {
	for _, policy := range []Overlap{OverlapSkip, OverlapBufferOne} {
		t.Run(policy.String(), func(t *testing.T) {
			ctx := testCtx(t)
			base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
			master := newFakeClock(base.Add(10 * time.Second))
			q := newQueue(t, newStore(t, testPrefix(t)))
			q.setClock(master.view(0))
			sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second, Overlap: policy}
			s, err := NewScheduler(q, []Schedule{sc})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			at := func(m int) time.Time { return base.Add(time.Duration(m) * time.Minute) }
			id := func(m int) string { return OccurrenceID("sync", at(m)) }
			waitCursor(t, q, sc.Name)
			master.set(at(1).Add(5 * time.Second))
			cv := waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(1)) })
			if !cv.Prev.Equal(at(1)) {
				t.Fatalf("cursor %+v; want occurrence 1 decided to run", cv)
			}
			waitExists(t, q, id(1)) // submitted after the decision
			// No worker runs it: it has not ended when the next ones come.
			master.set(at(2).Add(5 * time.Second))
			cv = waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(2)) })
			master.set(at(3).Add(5 * time.Second))
			cv = waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(3)) })
			// (A decision to run is written before its job: had 2 or 3 been
			// decided to run, Prev would name it.)
			if exists(t, q, id(2)) || exists(t, q, id(3)) || !cv.Prev.Equal(at(1)) {
				t.Fatalf("while occurrence 1 runs: job 2 %v, job 3 %v, cursor %+v; want neither submitted", exists(t, q, id(2)), exists(t, q, id(3)), cv)
			}
			if want := map[Overlap]time.Time{OverlapSkip: {}, OverlapBufferOne: at(2)}[policy]; !cv.Buffered.Equal(want) {
				t.Fatalf("buffered %v; want %v", cv.Buffered, want)
			}
			if _, err := q.Cancel(ctx, id(1), "done by hand"); err != nil {
				t.Fatal(err)
			}
			if policy == OverlapBufferOne {
				// The scheduler looks at job 1 every second: the buffered
				// occurrence is submitted once it ended, before the next
				// one comes.
				master.set(at(3).Add(6 * time.Second))
				waitExists(t, q, id(2))
				cv = waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Prev.Equal(at(2)) })
				if !cv.Buffered.IsZero() || exists(t, q, id(3)) {
					t.Fatalf("after the buffered one was submitted: cursor %+v, job 3 %v", cv, exists(t, q, id(3)))
				}
				if _, err := q.Cancel(ctx, id(2), "done by hand"); err != nil {
					t.Fatal(err)
				}
			}
			master.set(at(4).Add(5 * time.Second))
			waitExists(t, q, id(4))
			if exists(t, q, id(3)) {
				t.Fatal("occurrence 3, which came while another ran, was submitted")
			}
		})
	}
}

// A paused schedule's occurrences are skipped on every scheduler, not run
// later; resumed, the next ones run.
func TestPauseAndResumeSchedule(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base.Add(10 * time.Second))
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	if err := q.PauseSchedule(ctx, "sync", true); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("pausing a schedule no scheduler ran = %v; want ErrNotFound", err)
	}
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync", Lateness: 20 * time.Second, MaxSkew: time.Second}
	s, err := NewScheduler(q, []Schedule{sc})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitCursor(t, q, sc.Name)
	for range 2 { // twice: the same
		if err := q.PauseSchedule(ctx, "sync", true); err != nil {
			t.Fatal(err)
		}
	}
	at := func(m int) time.Time { return base.Add(time.Duration(m) * time.Minute) }
	master.set(at(1).Add(5 * time.Second))
	waitCursorWhere(t, q, "sync", func(cv cursorValue) bool { return cv.Last.Equal(at(1)) })
	if exists(t, q, OccurrenceID("sync", at(1))) {
		t.Fatal("a paused schedule submitted an occurrence")
	}
	infos, err := Schedules(ctx, &q.store.Admin, q.tenant)
	if err != nil || len(infos) != 1 || !infos[0].Paused || infos[0].Overlap != "allow-all" {
		t.Fatalf("Schedules = %+v, %v; want sync, paused, allow-all", infos, err)
	}
	if next := infos[0].Next(at(1), 2); len(next) != 2 || !next[0].Equal(at(2)) || !next[1].Equal(at(3)) {
		t.Fatalf("next occurrences %v; want %v and %v", next, at(2), at(3))
	}
	if err := q.PauseSchedule(ctx, "sync", false); err != nil {
		t.Fatal(err)
	}
	master.set(at(2).Add(5 * time.Second))
	waitExists(t, q, OccurrenceID("sync", at(2)))
	if exists(t, q, OccurrenceID("sync", at(1))) {
		t.Fatal("the occurrence that came while paused ran after the resume")
	}
}

// A backfill submits each occurrence of a past range once: again, it
// submits nothing; the future and the forgotten past are refused.
func TestBackfill(t *testing.T) {
	ctx := testCtx(t)
	base := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	master := newFakeClock(base.Add(time.Hour))
	q := newQueue(t, newStore(t, testPrefix(t)))
	q.setClock(master.view(0))
	sc := Schedule{Name: "sync", Every: time.Minute, Kind: "sync"}
	n, err := q.Backfill(ctx, sc, base.Add(time.Minute), base.Add(3*time.Minute))
	if err != nil || n != 3 {
		t.Fatalf("Backfill = %d, %v; want 3 occurrences", n, err)
	}
	for m := 1; m <= 3; m++ {
		if !exists(t, q, OccurrenceID("sync", base.Add(time.Duration(m)*time.Minute))) {
			t.Fatalf("occurrence %d not submitted", m)
		}
	}
	if n, err := q.Backfill(ctx, sc, base, base.Add(4*time.Minute)); err != nil || n != 2 {
		t.Fatalf("Backfill over it = %d, %v; want only the 2 new ones (0 and 4)", n, err)
	}
	for name, r := range map[string][2]time.Time{
		"future":   {base, base.Add(2 * time.Hour)},
		"reversed": {base.Add(2 * time.Minute), base.Add(time.Minute)},
		"too old":  {base.Add(-13 * time.Hour), base},
	} {
		if _, err := q.Backfill(ctx, sc, r[0], r[1]); !errors.Is(err, ErrInvalid) {
			t.Errorf("Backfill %s = %v; want ErrInvalid", name, err)
		}
	}
}
