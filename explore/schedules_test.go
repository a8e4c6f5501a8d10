package explore

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// Schedule worlds: every process runs a scheduler of one schedule (a
// scheduler per data centre), on its own clock, skewed by up to 3 s while
// the schedule tolerates 1 s of lateness, through crashes, closes and
// pauses. In some worlds the schedule is a cron expression in
// Europe/Paris and the world's time starts just before a change of
// daylight saving time. The oracle, written apart from the scheduler's own
// rule: the occurrences between the schedule's first cursor and its last
// are each submitted once, or counted as skipped in a scheduler's log.

// schedWorld is a world's schedule.
type schedWorld struct {
	spec     jobs.Schedule
	dst      bool     // cron in Europe/Paris, across a change of daylight saving
	inside   bool     // the world starts at the change, and time moves in minutes around it
	skipped  int      // occurrences the schedulers logged as skipped
	early    []string // skips of occurrences that were not late by the true time
	stopped  bool     // the schedulers were stopped for the checks
	lastSeen time.Time
	// skips are the occurrences the schedulers' logs say they skipped, by
	// identity: one occurrence, or every one in (after, latest].
	skips []skipLog
}

// skipLog is what one skip log names: an occurrence (at), or those in
// (after, latest].
type skipLog struct{ at, after, latest time.Time }

// skip notes the occurrences a scheduler's skip log names.
func (s *schedWorld) skip(r slog.Record) {
	var l skipLog
	r.Attrs(func(a slog.Attr) bool {
		if a.Value.Kind() != slog.KindTime {
			return true
		}
		switch a.Key {
		case "occurrence":
			l.at = a.Value.Time()
		case "after":
			l.after = a.Value.Time()
		case "latest":
			l.latest = a.Value.Time()
		}
		return true
	})
	s.skips = append(s.skips, l)
}

// judgeSkip judges a scheduler's skip of the missed occurrences in
// (after, latest], logged at true time now on a clock reading own. While
// the schedule runs, only an occurrence late by the true time may be
// skipped: a scheduler whose clock runs ahead (within MaxSkew) must not
// skip one the fleet would still run. After an outage (the scheduler says
// so) CatchUp alone decides the past by the scheduler's own clock (issue
// 38): the outage must be true (the first occurrence after the cursor
// late by the true time: no scheduler handled it), and each skipped
// occurrence late on that clock.
func (s *schedWorld) judgeSkip(who string, after, latest time.Time, outage bool, now, own time.Time, ledger *ledger) []string {
	if latest.IsZero() {
		return nil
	}
	late := s.spec.Lateness
	if !outage {
		if now.Sub(latest) < late {
			return []string{fmt.Sprintf("%s skipped the occurrence %s at %s (true time), %v before it was late",
				who, latest.Format(time.RFC3339), now.Format(time.RFC3339Nano), late-now.Sub(latest))}
		}
		return nil
	}
	var bad []string
	if occ := expectedOccurrences(s, after, latest); len(occ) > 0 && now.Sub(occ[0]) <= late {
		bad = append(bad, fmt.Sprintf("%s skipped occurrences after %s as after an outage at %s (true time), though the first, %s, was not late yet",
			who, after.Format(time.RFC3339), now.Format(time.RFC3339Nano), occ[0].Format(time.RFC3339)))
	}
	if own.Sub(latest) <= late {
		bad = append(bad, fmt.Sprintf("%s skipped the occurrence %s after an outage at %s on its own clock, %v before it was late by it",
			who, latest.Format(time.RFC3339), own.Format(time.RFC3339Nano), late-own.Sub(latest)))
	}
	if own.Sub(latest) <= late+s.spec.MaxSkew {
		// Within the skew tolerance: skipped by the outage rule alone.
		ledger.hit("path:schedule's CatchUp decided the past after an outage")
	}
	return bad
}

// skipped reports whether a scheduler's log named occurrence t skipped.
func (s *schedWorld) skippedAt(t time.Time) bool {
	for _, l := range s.skips {
		if l.at.Equal(t) || !l.latest.IsZero() && t.After(l.after) && !t.After(l.latest) {
			return true
		}
	}
	return false
}

var paris = func() *time.Location {
	loc, err := time.LoadLocation("Europe/Paris")
	if err != nil {
		panic(err)
	}
	return loc
}()

// dstStarts are instants just before Paris changes its clocks in 2027:
// forward at 01:00Z on 28 March, back at 01:00Z on 31 October.
var dstStarts = []time.Time{
	time.Date(2027, 3, 28, 0, 20, 0, 0, time.UTC),
	time.Date(2027, 10, 30, 23, 50, 0, 0, time.UTC),
}

// dstChanges are the instants Paris changes its clocks in 2027.
var dstChanges = []time.Time{
	time.Date(2027, 3, 28, 1, 0, 0, 0, time.UTC),
	time.Date(2027, 10, 31, 1, 0, 0, 0, time.UTC),
}

// pickSchedule draws whether the world runs a schedule, and which; it
// returns the time the world starts at.
func (w *world) pickSchedule(rng interface{ IntN(int) int }) time.Time {
	start := time.Unix(1_800_000_000, 0)
	if rng.IntN(4) != 0 {
		return start
	}
	w.sched = &schedWorld{spec: jobs.Schedule{Name: "tick", Kind: "tick", Every: 20 * time.Second,
		Lateness: time.Second, MaxSkew: 5 * time.Second, CatchUp: jobs.CatchUp(rng.IntN(3)), MaxCatchUp: 5,
		Overlap: []jobs.Overlap{jobs.OverlapAllowAll, jobs.OverlapAllowAll, jobs.OverlapSkip, jobs.OverlapBufferOne}[rng.IntN(4)]}}
	if rng.IntN(2) == 0 {
		w.sched.dst = true
		w.sched.spec.Every = 0
		w.sched.spec.Cron = []string{"*/20 * * * *", "30 2 * * *", "*/5 2 * * *"}[rng.IntN(3)]
		w.sched.spec.Location = paris
		start = dstStarts[rng.IntN(len(dstStarts))]
		if rng.IntN(2) == 0 {
			// Start 90 s before the change itself, and stay around it:
			// the clocks spend their minutes inside the change (no
			// day-long pause), each skewed differently across it.
			w.sched.inside = true
			start = dstChanges[rng.IntN(len(dstChanges))].Add(-90 * time.Second)
		}
	}
	return start
}

// startScheduler runs p's scheduler, on p's store and clock, for as long
// as p lives.
func (w *world) startScheduler(p *process) {
	if w.sched == nil {
		return
	}
	q, err := w.jobsQueue(p, w.zoneOf(p), jobs.WithLogger(slog.New(&ledgerLog{w: w, p: p})))
	if err != nil {
		panic(err)
	}
	if _, err := jobs.NewScheduler(q, []jobs.Schedule{w.sched.spec}); err != nil {
		panic(err)
	}
	// Every process runs the occurrences too, as idem's workers do: each
	// sleeps (durably) for 0-50 s by its occurrence, so that occurrences
	// 20 s apart overlap or not.
	tick := jobs.Kind{Name: "tick", MaxAttempts: 20, Backoff: time.Second, MaxBackoff: 4 * time.Second, Steps: []jobs.Step{
		{Name: "work", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			w.ranOnShard(p, r)
			h := fnv.New32a()
			h.Write([]byte(r.Key().ID))
			return nil, r.Sleep(time.Duration(h.Sum32()%51) * time.Second)
		}},
	}}
	if _, err := jobs.NewWorker(q, []jobs.Kind{tick}, jobs.Concurrency(2), jobs.DrainTimeout(5*time.Second), jobs.WorkerName(p.name+"/tick")); err != nil {
		panic(err)
	}
	// The scheduler stops with the process: its work is the process's
	// background work, killed or closed with it.
}

// checkSchedule compares the occurrences submitted (jobs in the history)
// with those of the schedule between its first cursor and its last, by a
// rule computed apart from the scheduler's: each one once, or counted as
// skipped.
func (w *world) checkSchedule(hist map[string][]version) []string {
	if w.sched == nil {
		return nil
	}
	ctx := context.Background()
	// The occurrences the shared cursor passed over: each write that
	// moved it forward, from L1 to L2, passed over those in (L1, L2]. (A
	// restore may take it back, or away: it is made again from then on.)
	// Under the store's prefix; in a shard world, a value placed by key
	// under a shard's (a marker where it was handed over from: no cursor).
	cursor := "j/s/" + jobTenant + "/" + w.sched.spec.Name
	if w.cfg.shards {
		cursor = "j/" + shard.ValueName(etcdstore.Key{Tenant: jobTenant, ID: "schedule." + w.sched.spec.Name})
	}
	type span struct{ from, to time.Time }
	var spans []span
	var cur time.Time
	// pending: what the last cursor decided to run (Prev) or holds
	// (Buffered, until Prev's job ends): not lost if not submitted yet.
	var pending, restoredAway []time.Time
	for _, ev := range w.feed.since(w.start+1, w.lastWrite+1) {
		if rest, ok := w.storeRest(string(ev.Kv.Key)); !ok || rest != cursor {
			continue
		}
		if ev.Type == mvccpb.DELETE {
			// A restore took the cursor away: what it had decided and not
			// submitted yet is lost with it (a restore's cost, not a skip).
			restoredAway = append(restoredAway, pending...)
			cur = time.Time{}
			continue
		}
		var cv struct {
			Last     time.Time `json:"last"`
			Prev     time.Time `json:"prev"`
			Buffered time.Time `json:"buffered"`
		}
		if json.Unmarshal(ev.Kv.Value, &cv) != nil {
			continue
		}
		pending = []time.Time{cv.Prev, cv.Buffered}
		if !cur.IsZero() && cv.Last.After(cur) {
			spans = append(spans, span{cur, cv.Last})
		}
		cur = cv.Last
	}
	_ = ctx
	got := map[time.Time]int{}
	prefix := jobTenant + "/" + w.sched.spec.Name + "@"
	for key, vs := range hist {
		id, ok := strings.CutPrefix(key, prefix)
		if !ok || len(vs) == 0 {
			continue
		}
		t, err := time.Parse("2006-01-02T15:04:05Z", id)
		if err != nil {
			continue
		}
		got[t]++
	}
	if len(spans) == 0 {
		if len(w.sched.early) > 0 {
			return w.sched.early
		}
		return nil
	}
	w.ledger.hit("path:schedule ran")
	if w.cfg.shards {
		w.ledger.hit("path:schedule ran on a shard set")
	}
	var bad []string
	missing, wanted := 0, 0
	var lost []string // occurrences neither submitted nor named skipped
	inSpan := func(t time.Time) bool {
		for _, sp := range spans {
			if t.After(sp.from) && !t.After(sp.to) {
				return true
			}
		}
		return false
	}
	seen := map[time.Time]bool{}
	for _, sp := range spans {
		for _, t := range expectedOccurrences(w.sched, sp.from, sp.to) {
			if seen[t] {
				continue
			}
			seen[t] = true
			wanted++
			if got[t] == 0 && !slices.ContainsFunc(pending, t.Equal) && !slices.ContainsFunc(restoredAway, t.Equal) {
				missing++
				if !w.sched.skippedAt(t) {
					lost = append(lost, t.Format(time.RFC3339))
				}
			}
		}
	}
	for t := range seen {
		delete(got, t)
	}
	var extra []string
	for t := range got {
		if inSpan(t) {
			extra = append(extra, t.Format(time.RFC3339))
		}
	}
	sort.Strings(extra)
	if len(extra) > 0 {
		bad = append(bad, fmt.Sprintf("schedule %s: occurrences no rule has: %v", w.sched.spec.Name, extra))
	}
	if missing > w.sched.skipped {
		bad = append(bad, fmt.Sprintf("schedule %s: %d of the %d occurrences its cursor passed over never submitted, %d counted as skipped",
			w.sched.spec.Name, missing, wanted, w.sched.skipped))
	}
	if len(lost) > 0 {
		// Judged by identity, not by count: each one the cursor passed
		// over is submitted, or a scheduler's log named it skipped.
		sort.Strings(lost)
		bad = append(bad, fmt.Sprintf("schedule %s: occurrences the cursor passed over, never submitted, that no skip names: %v", w.sched.spec.Name, lost))
	}
	for _, e := range w.sched.early {
		bad = append(bad, "schedule "+w.sched.spec.Name+": "+e)
	}
	if w.sched.skipped > 0 {
		w.ledger.hit("path:schedule skipped missed occurrences")
	}
	if w.sched.dst {
		w.ledger.hit("path:schedule across daylight saving")
	}
	if w.sched.inside {
		w.ledger.hit("path:schedule's clocks inside a daylight-saving change")
	}
	bad = append(bad, w.checkOverlap(hist)...)
	return bad
}

// pauser pauses the world's schedule through p, for every scheduler, and
// resumes it some simulated seconds later (each call retried a few times
// through faults; a resume that never lands leaves it paused, its
// occurrences counted as skipped).
func (w *world) pauser(a *actor, p *process) {
	q, err := w.jobsQueue(p, w.zoneOf(p))
	if err != nil {
		panic(err)
	}
	for _, paused := range []bool{true, false} {
		for try := 0; try < 5; try++ {
			w.s.step(a)
			err := q.PauseSchedule(a.ctx, w.sched.spec.Name, paused)
			w.note("%s: pause schedule %v: %v", a.name, paused, err)
			if err == nil || !retryable(err) {
				break
			}
		}
		if paused {
			clock.Sleep(p.clock, a.ctx, time.Duration(5+w.rng.IntN(40))*time.Second)
		}
	}
}

// checkOverlap checks O1: under an overlap policy other than allow-all,
// the jobs of two occurrences never overlap: an occurrence's job is
// created only after the job of the occurrence before it ended (or was
// forgotten), and a job forgotten is not taken over again (a new attempt,
// a new token) once the next occurrence's job exists, nor made again once
// it ended or was forgotten (its record deleted).
func (w *world) checkOverlap(hist map[string][]version) []string {
	if w.sched.spec.Overlap == jobs.OverlapAllowAll || w.cfg.restores {
		return nil // a restore takes jobs and the cursor back
	}
	type life struct {
		t              time.Time
		created, ended int64 // revisions; ended 0: never
		vs             []version
	}
	var lives []life
	var bad []string
	prefix := jobTenant + "/" + w.sched.spec.Name + "@"
	for key, vs := range hist {
		id, ok := strings.CutPrefix(key, prefix)
		if !ok || len(vs) == 0 || vs[0].deleted {
			continue
		}
		t, err := time.Parse("2006-01-02T15:04:05Z", id)
		if err != nil {
			continue
		}
		l := life{t: t, created: vs[0].rev, vs: vs}
		for _, v := range vs {
			if v.deleted || v.rec.State == etcdstore.Done {
				l.ended = v.rev
				break
			}
		}
		for i := 1; i < len(vs); i++ {
			// (A fence a failed claim leaves on the key is no job.)
			if vs[i-1].deleted && !vs[i].deleted && !vs[i].rec.Fence {
				bad = append(bad, fmt.Sprintf("O1: schedule %s (%s): occurrence %s's job was made again at revision %d after its record was deleted at %d",
					w.sched.spec.Name, w.sched.spec.Overlap, id, vs[i].rev, vs[i-1].rev))
				break
			}
		}
		lives = append(lives, l)
	}
	sort.Slice(lives, func(i, j int) bool { return lives[i].t.Before(lives[j].t) })
	var spread time.Duration // a clock ahead by up to it judges expiry early
	for _, x := range w.cfg.skew {
		for _, y := range w.cfg.skew {
			spread = max(spread, x-y)
		}
	}
	for i := 1; i < len(lives); i++ {
		a, b := lives[i-1], lives[i]
		// a's job was forgotten when b's was made: the retention of its
		// last write before then had passed (nobody wrote it: its worker was
		// paused, or cut off, longer than the retention). A job's step must
		// write within the retention (docs/JOBS.md).
		var last *version
		for i := range a.vs {
			if a.vs[i].rev < b.created {
				last = &a.vs[i]
			}
		}
		if at, ok := w.timeOf(b.created); ok && last != nil && !last.deleted && last.rec.State != etcdstore.Done && !at.Add(spread).Before(last.rec.Expires) {
			w.ledger.hit("path:occurrence's job forgotten while it ran (paused past the retention)")
			// Its worker, paused, may still finish it (its token); a new
			// claim of it (another token) is a new run beside b's.
			for _, v := range a.vs {
				if v.rev > b.created && !v.deleted && !v.rec.Fence && v.rec.State != etcdstore.Done && v.rec.Token != last.rec.Token && (b.ended == 0 || v.rev < b.ended) {
					bad = append(bad, fmt.Sprintf("O1: schedule %s (%s): occurrence %s's job, forgotten, was taken over again (token %d) at revision %d while %s's ran",
						w.sched.spec.Name, w.sched.spec.Overlap, a.t.Format(time.RFC3339), v.rec.Token, v.rev, b.t.Format(time.RFC3339)))
					break
				}
			}
			continue
		}
		if a.ended == 0 || b.created < a.ended {
			bad = append(bad, fmt.Sprintf("O1: schedule %s (%s): occurrence %s's job was created at revision %d while %s's ran (ended at %d)",
				w.sched.spec.Name, w.sched.spec.Overlap, b.t.Format(time.RFC3339), b.created, a.t.Format(time.RFC3339), a.ended))
		}
	}
	if len(lives) > 1 {
		w.ledger.hit("path:occurrences that must not overlap checked (" + w.sched.spec.Overlap.String() + ")")
	}
	return bad
}

// expectedOccurrences lists the occurrences in (first, last], computed
// minute by minute: for a cron schedule, each wall time of Paris that its
// fields name, at the first instant at which Paris's wall clock reads it or
// later; for an interval, the multiples of it since the epoch.
func expectedOccurrences(sw *schedWorld, first, last time.Time) []time.Time {
	var out []time.Time
	if !sw.dst {
		n := int64(sw.spec.Every / time.Second)
		for s := (first.Unix()/n + 1) * n; s <= last.Unix(); s += n {
			out = append(out, time.Unix(s, 0).UTC())
		}
		return out
	}
	match := func(h, m int) bool {
		switch sw.spec.Cron {
		case "*/20 * * * *":
			return m%20 == 0
		case "30 2 * * *":
			return h == 2 && m == 30
		case "*/5 2 * * *":
			return h == 2 && m%5 == 0
		}
		panic("unknown cron " + sw.spec.Cron)
	}
	seen := map[time.Time]bool{}
	for d := first.Add(-48 * time.Hour); !d.After(last.Add(48 * time.Hour)); d = d.Add(24 * time.Hour) {
		y, mo, da := d.In(paris).Date()
		for h := 0; h < 24; h++ {
			for m := 0; m < 60; m++ {
				if !match(h, m) {
					continue
				}
				wall := time.Date(y, mo, da, h, m, 0, 0, time.UTC)
				if seen[wall] {
					continue
				}
				seen[wall] = true
				// The first instant whose Paris wall clock reads wall or
				// later, by scanning minutes.
				at := wall.Add(-3 * time.Hour) // before it: Paris is ahead of UTC
				for wallOf(at).Before(wall) {
					at = at.Add(time.Minute)
				}
				if at.After(first) && !at.After(last) {
					out = append(out, at.UTC())
				}
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Before(out[j]) })
	// Two wall times the clock jumped over land on one instant: one
	// occurrence.
	var uniq []time.Time
	for i, t := range out {
		if i == 0 || !t.Equal(out[i-1]) {
			uniq = append(uniq, t)
		}
	}
	return uniq
}

// wallOf is t's Paris wall clock reading, as a UTC value.
func wallOf(t time.Time) time.Time {
	p := t.In(paris)
	return time.Date(p.Year(), p.Month(), p.Day(), p.Hour(), p.Minute(), p.Second(), 0, time.UTC)
}
