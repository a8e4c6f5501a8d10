package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/kernel"
	"github.com/idem-dev/idem/internal/storex"
)

// Schedule turns a cron expression or an interval into jobs, one per
// occurrence, each run once however many schedulers (one per data centre)
// run the schedule: an occurrence's job id is the schedule's name and the
// occurrence's time, which come from the schedule, never from a clock, so
// every scheduler names it alike and the first to submit it wins.
type Schedule struct {
	// Name names the schedule: 1 to 64 characters of [A-Za-z0-9._-]. An
	// occurrence's job id is OccurrenceID(Name, time).
	Name string
	// Cron is a standard five-field cron expression ("0 3 1 * *": 03:00 on
	// the first of every month) or a descriptor (@hourly, @daily,
	// @weekly, @monthly, @yearly), in Location. "@every" is refused: use
	// Every, whose occurrences do not depend on when a scheduler started.
	Cron string
	// Every, instead of Cron, makes an occurrence every Every (whole
	// seconds), counted from the Unix epoch: the same instants on every
	// scheduler.
	Every time.Duration
	// Location is the time zone of Cron (default UTC). Where it has
	// daylight saving, an occurrence is the first instant at which the
	// zone's wall clock reads its time or later: a wall time that happens
	// twice runs once (at its first instant), one skipped runs when the
	// clock jumps past it.
	Location *time.Location
	// Kind is the kind of the occurrences' jobs.
	Kind string
	// Params returns an occurrence's job parameters; it must return the
	// same bytes on every scheduler for the same time, or the schedulers'
	// submissions conflict (etcdstore.ErrMismatch, logged). Default:
	// {"schedule":Name,"occurrence":"<RFC 3339 time>"}. A Params that
	// panics skips that occurrence (logged, naming the panic), never the
	// scheduler's process.
	Params func(occurrence time.Time) []byte
	// CatchUp says what happens to occurrences missed while no scheduler
	// ran (default CatchUpLatest).
	CatchUp CatchUp
	// Overlap says what happens to an occurrence that comes while the
	// job of the previous one has not ended (default OverlapAllowAll).
	Overlap Overlap
	// Lateness is how late an occurrence may still be submitted as on
	// time (default a minute, and at most the interval between two
	// occurrences); an occurrence later than that is missed, and CatchUp
	// decides.
	Lateness time.Duration
	// MaxCatchUp bounds how many missed occurrences CatchUpAll runs: the
	// latest ones (default 10).
	MaxCatchUp int
	// MaxSkew is how far apart the schedulers' clocks may be (default 5
	// minutes). While a schedule runs, a scheduler counts an occurrence as
	// missed only once it is late by more than Lateness plus MaxSkew on its
	// own clock, so one whose clock runs ahead never skips, for the fleet,
	// an occurrence the others would submit on time. After an outage (the
	// first occurrence after the cursor is that late, and no scheduler
	// wrote the cursor for longer than Lateness plus twice MaxSkew: no
	// scheduler ran), CatchUp alone decides the past: an occurrence late by more than
	// Lateness on the clock of the scheduler that comes back is missed, so
	// that the tolerance never runs MaxSkew's worth of occurrences at once;
	// a clock ahead by more than Lateness then counts the newest ones as
	// missed a little early. A new schedule starts with its first occurrence
	// after it was created (on the clock of the scheduler that made its
	// cursor), never with its past. An
	// occurrence a fast scheduler submits before its time is held back
	// until then (RunAt) on each worker's clock.
	MaxSkew time.Duration

	spec cron.Schedule
	// forgotten is the decided occurrence this schedule's loop last said
	// it would not submit again (see prevRunning).
	forgotten time.Time
}

// CatchUp says what a scheduler does with missed occurrences: ones that
// came while every scheduler was down (or cut off) for longer than their
// Lateness. Occurrences older than half the store's retention are never
// run: their jobs may have been forgotten, and would run a second time.
type CatchUp int

const (
	// CatchUpLatest runs the most recent missed occurrence, and skips the
	// others: for work where the latest run covers the earlier ones (a
	// report, a sync).
	CatchUpLatest CatchUp = iota
	// CatchUpAll runs every missed occurrence, up to MaxCatchUp of them (the
	// latest), oldest first: for work that must happen once per occurrence
	// (a monthly invoice run).
	CatchUpAll
	// CatchUpNone skips missed occurrences.
	CatchUpNone
)

func (c CatchUp) String() string {
	switch c {
	case CatchUpLatest:
		return "latest"
	case CatchUpAll:
		return "all"
	case CatchUpNone:
		return "none"
	}
	return fmt.Sprintf("CatchUp(%d)", int(c))
}

// Overlap says what a scheduler does with an occurrence that comes while
// the job of the schedule's previous occurrence has not ended (it runs,
// waits, or is parked). Every scheduler decides alike: the decision is a
// compare-and-set on the schedule's cursor in etcd, which names the
// occurrence that runs (and the one buffered).
type Overlap int

const (
	// OverlapAllowAll submits every occurrence: jobs of several
	// occurrences may run at once.
	OverlapAllowAll Overlap = iota
	// OverlapSkip skips an occurrence that comes while the previous one
	// runs (counted and logged): never two at once.
	OverlapSkip
	// OverlapBufferOne holds the first occurrence that comes while the
	// previous one runs, and submits it when that one ends; further ones
	// that come meanwhile are skipped: never two at once, and none lost
	// to a run that overlaps it once.
	OverlapBufferOne
)

func (o Overlap) String() string {
	switch o {
	case OverlapAllowAll:
		return "allow-all"
	case OverlapSkip:
		return "skip"
	case OverlapBufferOne:
		return "buffer-one"
	}
	return fmt.Sprintf("Overlap(%d)", int(o))
}

// ValidateName checks the name of a schedule, a kind, an event or a limit: 1 to 64
// characters of [A-Za-z0-9._-]. Its error wraps ErrInvalid.
func ValidateName(name string) error {
	if err := validName(name, 64, true); err != nil {
		return fmt.Errorf("%w: name %q: %v", ErrInvalid, name, err)
	}
	return nil
}

// ParseOverlap reads an Overlap's String.
func ParseOverlap(s string) (Overlap, error) {
	for o := OverlapAllowAll; o <= OverlapBufferOne; o++ {
		if o.String() == s {
			return o, nil
		}
	}
	return 0, fmt.Errorf("%w: overlap policy %q: allow-all, skip or buffer-one", ErrInvalid, s)
}

// OccurrenceID returns the job id of the occurrence of schedule name at t:
// "<name>@<t in UTC, RFC 3339, to the second>".
func OccurrenceID(name string, t time.Time) string {
	return name + "@" + t.UTC().Format(occurrenceLayout)
}

const occurrenceLayout = "2006-01-02T15:04:05Z"

// validate checks s and fills its defaults.
func (s *Schedule) validate(retention time.Duration) error {
	if err := validName(s.Name, 64, true); err != nil {
		return fmt.Errorf("%w: schedule name %q: %v", ErrInvalid, s.Name, err)
	}
	if err := validName(s.Kind, 64, true); err != nil {
		return fmt.Errorf("%w: schedule %s: kind %q: %v", ErrInvalid, s.Name, s.Kind, err)
	}
	if s.Location == nil {
		s.Location = time.UTC
	}
	switch {
	case s.Cron != "" && s.Every != 0:
		return fmt.Errorf("%w: schedule %s has both Cron and Every", ErrInvalid, s.Name)
	case s.Every != 0:
		if s.Every < time.Second || s.Every%time.Second != 0 {
			return fmt.Errorf("%w: schedule %s: Every %v must be whole seconds, at least 1 s", ErrInvalid, s.Name, s.Every)
		}
		s.spec = interval(s.Every)
	case s.Cron != "":
		spec, err := cron.ParseStandard(s.Cron)
		if err != nil {
			return fmt.Errorf("%w: schedule %s: cron %q: %v", ErrInvalid, s.Name, s.Cron, err)
		}
		switch sp := spec.(type) {
		case cron.ConstantDelaySchedule:
			return fmt.Errorf("%w: schedule %s: cron %q: @every counts from when a scheduler starts; use Every", ErrInvalid, s.Name, s.Cron)
		case *cron.SpecSchedule:
			if sp.Location != time.Local {
				// CRON_TZ= in the expression: its zone wins over Location.
				s.Location = sp.Location
			}
			sp.Location = time.UTC // read on the wall clock, below
			spec = zoned{spec: sp, loc: s.Location}
		}
		// A spec that names no real date ("0 0 30 2 *") never comes.
		if spec.Next(time.Now()).IsZero() {
			return fmt.Errorf("%w: schedule %s: cron %q never comes (no date matches it)", ErrInvalid, s.Name, s.Cron)
		}
		s.spec = spec
	default:
		return fmt.Errorf("%w: schedule %s has neither Cron nor Every", ErrInvalid, s.Name)
	}
	if s.CatchUp < CatchUpLatest || s.CatchUp > CatchUpNone {
		return fmt.Errorf("%w: schedule %s: unknown CatchUp %d", ErrInvalid, s.Name, s.CatchUp)
	}
	if s.Overlap < OverlapAllowAll || s.Overlap > OverlapBufferOne {
		return fmt.Errorf("%w: schedule %s: unknown Overlap %d", ErrInvalid, s.Name, s.Overlap)
	}
	if s.Lateness < 0 || s.MaxCatchUp < 0 || s.MaxSkew < 0 {
		return fmt.Errorf("%w: schedule %s: negative Lateness, MaxCatchUp or MaxSkew", ErrInvalid, s.Name)
	}
	if s.MaxSkew == 0 {
		s.MaxSkew = 5 * time.Minute
	}
	if s.Lateness == 0 {
		s.Lateness = time.Minute
		if s.Every > 0 {
			s.Lateness = min(s.Lateness, s.Every)
		}
	}
	if s.Lateness+s.MaxSkew >= retention/2 {
		return fmt.Errorf("%w: schedule %s: Lateness %v plus MaxSkew %v must be under half the store's retention (%v)", ErrInvalid, s.Name, s.Lateness, s.MaxSkew, retention)
	}
	if s.MaxCatchUp == 0 {
		s.MaxCatchUp = 10
	}
	return nil
}

// interval is Every's schedule: instants at multiples of d since the Unix
// epoch.
type interval time.Duration

func (d interval) Next(t time.Time) time.Time {
	n := int64(time.Duration(d) / time.Second)
	s := t.Unix()
	next := (s/n + 1) * n
	if s < 0 && s%n != 0 {
		next = (s / n) * n
	}
	return time.Unix(next, 0).UTC()
}

// params returns the parameters of the occurrence at t. A Params function
// that panics is an error wrapping ErrInvalid, naming it: the occurrence
// is skipped (logged), never the scheduler's process.
func (s *Schedule) params(t time.Time) (b []byte, err error) {
	if s.Params != nil {
		defer func() {
			if v := recover(); v != nil {
				err = fmt.Errorf("%w: schedule %s: its Params function panicked on occurrence %s: %v", ErrInvalid, s.Name, t.UTC().Format(occurrenceLayout), v)
			}
		}()
		return s.Params(t), nil
	}
	b, _ = json.Marshal(map[string]string{"schedule": s.Name, "occurrence": t.UTC().Format(occurrenceLayout)})
	return b, nil
}

// Scheduler submits the occurrences of schedules as jobs of a Queue. Run one
// per data centre (or more): each occurrence is submitted by whichever
// scheduler comes first, and run once. A shared cursor per schedule in
// etcd (the latest occurrence any scheduler handled) tells a scheduler that
// starts what was missed.
//
// NewScheduler starts a piece of work per schedule, on the store's clock;
// Close stops them.
type Scheduler struct {
	q         *Queue
	schedules []*Schedule
	cancel    context.CancelFunc
	wg        clock.Group
}

// NewScheduler validates schedules and starts submitting their occurrences.
func NewScheduler(q *Queue, schedules []Schedule) (*Scheduler, error) {
	if q == nil {
		return nil, fmt.Errorf("new scheduler: %w: nil queue", ErrInvalid)
	}
	s := &Scheduler{q: q}
	seen := map[string]bool{}
	for i := range schedules {
		sc := schedules[i]
		if err := sc.validate(q.retention()); err != nil {
			return nil, fmt.Errorf("new scheduler: %w", err)
		}
		if seen[sc.Name] {
			return nil, fmt.Errorf("new scheduler: %w: two schedules named %s", ErrInvalid, sc.Name)
		}
		if q.set != nil && sc.Overlap != OverlapAllowAll {
			// Its decisions fence its occurrences' submissions with its
			// cursor, in one Txn: on a shard set, the two are on
			// different clusters.
			return nil, fmt.Errorf("new scheduler: %w: schedule %s: overlap policy %s needs one etcd cluster (its decisions fence each occurrence's submission with the cursor in one transaction); on a shard set only %s",
				ErrInvalid, sc.Name, sc.Overlap, OverlapAllowAll)
		}
		seen[sc.Name] = true
		s.schedules = append(s.schedules, &sc)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	for _, sc := range s.schedules {
		s.wg.Go(q.clock, ctx, "schedule "+sc.Name, func(ctx context.Context) { s.loop(ctx, sc) })
	}
	return s, nil
}

// Close stops submitting. An occurrence being submitted is finished first
// or not at all: its submission is one Txn.
func (s *Scheduler) Close() error {
	s.cancel()
	s.wg.Wait(s.q.clock, context.Background())
	return nil
}

// loop runs one schedule: catch up from the cursor, then submit each
// occurrence as its time comes (and a buffered one soon after the job
// before it ends).
func (s *Scheduler) loop(ctx context.Context, sc *Schedule) {
	log := s.q.log.With("schedule", sc.Name)
	for fails, again := 0, 0; ctx.Err() == nil; {
		next, waitFor, err := s.tick(ctx, sc)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			fails++
			log.Info("idem: schedule: cannot submit occurrences now; retrying", "err", err)
			clock.Sleep(s.q.clock, ctx, min(time.Duration(200<<min(fails, 6))*time.Millisecond, 10*time.Second))
			continue
		}
		fails = 0
		now := s.q.clock.Now()
		d := next.Sub(now)
		if d > 0 {
			again = 0
		} else if again++; again > 3 {
			// The cursor keeps moving under this scheduler's decisions:
			// read it again, without spinning.
			d = 20 * time.Millisecond
		}
		if waitFor != "" {
			// An occurrence is buffered: look at the job before it every
			// second (a read), to submit it soon after that job ends.
			d = min(d, bufferedPoll)
		}
		// Until an instant, not for a while: a clock that moves past it
		// meanwhile must not put the next tick a whole interval later.
		// (Found by TestOverlapPolicies, 1 run in 20 under -race: its
		// clock jumped to the next occurrence between the reading of
		// the time and the timer, and the scheduler slept past it.)
		clock.SleepUntil(s.q.clock, ctx, now.Add(d))
	}
}

// bufferedPoll is how often a scheduler looks at the job an occurrence
// is buffered behind (OverlapBufferOne).
const bufferedPoll = time.Second

// tick submits what is due of sc: every occurrence after the cursor up to
// now, as the catch-up policy says for the missed ones and the overlap
// policy for those that come while the previous one runs; then moves the
// cursor to the latest, and returns when the next occurrence comes (and
// the job to follow meanwhile, when an occurrence is buffered).
func (s *Scheduler) tick(ctx context.Context, sc *Schedule) (time.Time, string, error) {
	now := s.q.clock.Now()
	cur, rev, err := s.cursor(ctx, sc, now)
	if err != nil {
		return time.Time{}, "", err
	}
	p := sc.planFrom(cur.Last, cur.At, now, s.q.retention())
	submit, last, skipped, latest := p.Submit, p.Last, p.Skipped, p.LatestSkipped
	if skipped > 0 {
		// Those skipped are every occurrence after the cursor up to latest
		// that is not submitted: after and latest name them. after_outage:
		// no scheduler ran at the first of them, and lateness was judged
		// on this clock alone (kernel.PlanRule).
		s.q.log.Warn("idem: schedule: skipped missed occurrences", "schedule", sc.Name, "skipped", skipped, "after", cur.Last, "latest", latest, "catch_up", sc.CatchUp.String(), "after_outage", p.AfterOutage)
	}
	next := sc.spec.Next(maxTime(last, cur.Last, now.Add(-time.Second)))
	if next.IsZero() {
		next = now.Add(time.Hour) // a cron spec with no date left: look again later
	}
	switch {
	case cur.Paused:
		if len(submit) > 0 {
			s.q.log.Warn("idem: schedule: skipped occurrences: the schedule is paused", "schedule", sc.Name, "skipped", len(submit), "after", cur.Last, "latest", submit[len(submit)-1])
		}
	case sc.Overlap != OverlapAllowAll:
		waitFor, moved, err := s.exclusive(ctx, sc, cur, rev, submit, last, now)
		if err != nil || moved {
			return now, "", err // another scheduler moved the cursor: read it again
		}
		return next, waitFor, nil
	default:
		for _, t := range submit {
			if err := s.submit(ctx, sc, t, nil); err != nil {
				return time.Time{}, "", err
			}
		}
	}
	if last.After(cur.Last) {
		if err := s.advance(ctx, sc, last); err != nil {
			return time.Time{}, "", err
		}
	}
	return next, "", nil
}

// cursorFence is the cursor an occurrence was decided under: its revision
// and what it says.
type cursorFence struct {
	rev int64
	cur cursorValue
}

// submit submits the occurrence at t. Occurrences that can never be
// submitted are logged and skipped rather than hold every later one. A
// fence (an occurrence decided under an overlap policy, whose late
// submission could overlap a later one) makes the submission land only
// while the schedule's cursor is at the fence's revision, else it is an
// error wrapping storex.ErrValueChanged; and the job's write marks the
// cursor with the occurrence (Submitted) in the same transaction.
func (s *Scheduler) submit(ctx context.Context, sc *Schedule, t time.Time, fence *cursorFence) error {
	// Held back until its time on the workers' clocks: this scheduler's
	// may run ahead.
	opts := []SubmitOption{RunAt(t)}
	var found bool // the job was there (a backfill's): the cursor is not marked
	if fence != nil {
		marked := fence.cur
		marked.Submitted = t
		marked.describe(sc)
		b, _ := json.Marshal(marked)
		opts = append(opts, func(c *submitConfig) {
			c.fence = []etcdstore.EnqueueOption{storex.IfValueThen(cursorName(s.q.tenant, sc.Name), fence.rev, b)}
			c.found = &found
		})
		defer func() {
			if found {
				// Marked now, while the job is known to be there: gone
				// later (ended early elsewhere), it is not taken for
				// never submitted. Refused, the cursor moved: whoever
				// reads it next finds the job, or its mark.
				marked := fence.cur
				marked.Submitted = t
				s.setCursor(ctx, sc, fence.rev, marked) //nolint:errcheck // best effort; prevRunning marks it too
			}
		}()
	}
	params, err := sc.params(t)
	if err == nil {
		_, err = s.q.Submit(ctx, OccurrenceID(sc.Name, t), sc.Kind, params, opts...)
	}
	switch {
	case errors.Is(err, etcdstore.ErrMismatch):
		s.q.log.Error("idem: schedule: another scheduler submitted this occurrence with other params; keeping its job", "schedule", sc.Name, "occurrence", t, "err", err)
	case errors.Is(err, etcdstore.ErrTooLarge), errors.Is(err, etcdstore.ErrInvalidParams), errors.Is(err, ErrNotJob), errors.Is(err, ErrInvalid):
		s.q.log.Error("idem: schedule: skipping an occurrence that cannot be submitted", "schedule", sc.Name, "occurrence", t, "err", err)
	case err != nil:
		return fmt.Errorf("occurrence %s: %w", t.Format(occurrenceLayout), err)
	}
	return nil
}

// exclusive decides the due occurrences of a schedule whose occurrences
// must not overlap, one compare-and-set of the cursor each, and submits
// those decided to run. moved reports that another scheduler moved the
// cursor first; waitFor is the job to follow while one is buffered.
//
// The decision comes before the submission: a scheduler that dies between
// the two leaves an occurrence the cursor names (Prev) without its job,
// and the next tick of any scheduler submits it (prevRunning). An outcome
// that may have happened is treated as having happened.
func (s *Scheduler) exclusive(ctx context.Context, sc *Schedule, cur cursorValue, rev int64, submit []time.Time, last, now time.Time) (waitFor string, moved bool, err error) {
	running, undecided, err := s.prevRunning(ctx, sc, cur, rev, now)
	if errors.Is(err, storex.ErrValueChanged) {
		return "", true, nil
	}
	if err != nil {
		return "", false, err
	}
	if undecided && (len(submit) > 0 || !cur.Buffered.IsZero()) {
		// Look again in a second: the previous job has not started yet.
		return OccurrenceID(sc.Name, cur.Prev), false, nil
	}
	if !running && !cur.Buffered.IsZero() {
		nv := cur
		nv.Prev, nv.Buffered, nv.PrevAt = cur.Buffered, time.Time{}, now
		if rev, err = s.setCursor(ctx, sc, rev, nv); err != nil || rev == 0 {
			return "", rev == 0, err
		}
		cur, running = nv, true
		s.q.log.Info("idem: schedule: submitting the buffered occurrence: the previous one ended", "schedule", sc.Name, "occurrence", cur.Prev)
		if err := s.submit(ctx, sc, cur.Prev, &cursorFence{rev, cur}); err != nil {
			return "", errors.Is(err, storex.ErrValueChanged), ignoreMoved(err)
		}
	}
	for _, t := range submit {
		nv := cur
		nv.Last = t
		fate, why := kernel.Overlap(running, sc.Overlap == OverlapBufferOne, !cur.Buffered.IsZero())
		switch fate {
		case kernel.OccurrenceRuns:
			nv.Prev, nv.PrevAt = t, now
		case kernel.OccurrenceBuffered:
			nv.Buffered = t
		}
		if fate == kernel.OccurrenceSkipped {
			// Said before the decision is written: a decision that may
			// have landed is treated as having landed.
			s.q.log.Warn("idem: schedule: skipped an occurrence: "+why, "schedule", sc.Name, "skipped", 1, "occurrence", t, "overlap", sc.Overlap.String())
		}
		if rev, err = s.setCursor(ctx, sc, rev, nv); err != nil || rev == 0 {
			return "", rev == 0, err
		}
		cur = nv
		switch {
		case nv.Prev.Equal(t):
			running = true
			if err := s.submit(ctx, sc, t, &cursorFence{rev, cur}); err != nil {
				return "", errors.Is(err, storex.ErrValueChanged), ignoreMoved(err)
			}
			if now.Before(t.Add(sc.MaxSkew)) {
				// Its job has not started (it is held back until its time
				// on the workers' clocks, which may run behind this one):
				// whether the next ones overlap it is decided once it has
				// (see prevRunning), not now.
				return OccurrenceID(sc.Name, t), false, nil
			}
		}
	}
	if last.After(cur.Last) {
		// Missed occurrences the catch-up policy skipped (logged): past.
		nv := cur
		nv.Last = last
		if rev, err = s.setCursor(ctx, sc, rev, nv); err != nil || rev == 0 {
			return "", rev == 0, err
		}
		cur = nv
	}
	if running && !cur.Buffered.IsZero() {
		return OccurrenceID(sc.Name, cur.Prev), false, nil
	}
	return "", false, nil
}

// ignoreMoved is err, or nil when it says the cursor moved (the caller
// reads it again).
func ignoreMoved(err error) error {
	if errors.Is(err, storex.ErrValueChanged) {
		return nil
	}
	return err
}

// prevRunning reports whether the job of the cursor's Prev occurrence has
// not ended (parked counts as not ended), submitting it if it was decided
// and never submitted (its scheduler died between the two). A job that is
// not there and whose occurrence is older than the retention less twice
// MaxSkew may have been forgotten: it counts as ended. A cursor that names
// no Prev (written by an older version, or under OverlapAllowAll) is asked
// of the job of its Last occurrence, if there is one.
//
// undecided reports that the previous job has not started yet and its
// occurrence is less than MaxSkew old on this scheduler's clock: this
// scheduler's clock may run ahead of the fleet's, and the job is held back
// (RunAt) until its time on the workers' clocks. No decision is made on it
// yet: a scheduler decides once the job started, or MaxSkew passed.
func (s *Scheduler) prevRunning(ctx context.Context, sc *Schedule, cur cursorValue, rev int64, now time.Time) (running, undecided bool, err error) {
	prev, decided := cur.Prev, true
	if prev.IsZero() {
		prev, decided = cur.Last, false
	}
	if prev.IsZero() {
		return false, false, nil
	}
	id := OccurrenceID(sc.Name, prev)
	j, err := s.q.Get(ctx, id)
	gone := false // its record was there past its retention, deleted now
	if errors.Is(err, etcdstore.ErrNotFound) && decided {
		// Its record may still be in etcd past its retention: its job
		// was submitted, and ended or was forgotten. A claim that read
		// the record live before (or on a clock behind this one) could
		// still take it over and run it beside the next occurrence:
		// forgotten here for good first.
		var live *Job
		var ferr error
		live, gone, ferr = s.forget(ctx, sc, id, now)
		switch {
		case ferr != nil:
			return false, false, ferr
		case live != nil:
			j, err = live, nil // written since the read: judged below
		case cur.Submitted.Equal(prev):
			return false, false, nil // submitted: ended, or forgotten
		}
	}
	if (err == nil || gone) && decided && !cur.Submitted.Equal(prev) {
		// There: submitted (by its decider, whose mark did not land, or by
		// a backfill). Marked, so that its absence later is not taken for
		// "never submitted"; the cursor moved: read again.
		marked := cur
		marked.Submitted = prev
		if _, err := s.setCursor(ctx, sc, rev, marked); err != nil {
			return false, false, err
		}
		return false, false, fmt.Errorf("schedule %s: marked the submission of %s: %w", sc.Name, id, storex.ErrValueChanged)
	}
	if errors.Is(err, etcdstore.ErrNotFound) {
		if !decided {
			return false, false, nil // skipped, or never a job of this schedule
		}
		// Its job was created, if ever, after the decision, which came
		// at the earliest MaxSkew before the occurrence (a scheduler whose
		// clock runs ahead), and is kept a retention after its last
		// write. Before then (on a clock up to MaxSkew ahead), absent
		// means never submitted.
		// A buffered occurrence is decided when the one before it ends
		// (PrevAt), maybe long after its own time: its job is absent
		// until its scheduler submits it, not forgotten.
		if kernel.MayBeForgotten(prev, cur.PrevAt, now, s.q.retention(), sc.MaxSkew) {
			// It may have been forgotten: never submitted again, so never
			// run twice; it may also never have run (its scheduler failed
			// to submit it for as long): said once.
			if !sc.forgotten.Equal(prev) {
				sc.forgotten = prev
				s.q.log.Warn("idem: schedule: skipped an occurrence: decided to run, its job is not there and may have been forgotten; not submitted again",
					"schedule", sc.Name, "skipped", 1, "occurrence", prev)
			}
			return false, false, nil
		}
		s.q.log.Info("idem: schedule: submitting an occurrence decided to run but not submitted", "schedule", sc.Name, "occurrence", prev)
		if err := s.submit(ctx, sc, prev, &cursorFence{rev, cur}); err != nil {
			return false, false, err
		}
		if j, err = s.q.Get(ctx, id); errors.Is(err, etcdstore.ErrNotFound) {
			return false, false, nil // it cannot be submitted (logged): it never runs
		}
	}
	if err != nil {
		return false, false, err
	}
	if kernel.NotStarted(j.State == Scheduled || j.State == Queued, j.Attempts, prev, now, sc.MaxSkew) {
		return true, true, nil
	}
	return !j.State.Final(), false, nil
}

// forget makes the absence of job id final. A record that etcd still holds
// past its retention (by this scheduler's clock) is deleted, if it is
// still as read (etcdstore.Store.EvictIf): a claim that read it live
// before, or on a clock behind this one, cannot take it over after this
// scheduler took it for ended and decided the next occurrence. It returns
// the job when its record is live (written since q.Get found none), gone
// when a record was there and is deleted now, neither when there is none.
func (s *Scheduler) forget(ctx context.Context, sc *Schedule, id string, now time.Time) (live *Job, gone bool, err error) {
	if s.q.store == nil {
		return nil, false, nil // a shard set: no overlap policies there
	}
	key := s.q.Key(id)
	for try := 0; try < 8; try++ {
		rec, err := storex.Peek(&s.q.store.Admin, ctx, key)
		if errors.Is(err, etcdstore.ErrNotFound) {
			return nil, false, nil
		}
		if err != nil {
			return nil, false, err
		}
		switch kernel.Forget(&kernel.Record{Fence: rec.Fence, Expires: rec.Expires}, now) {
		case kernel.NoJob:
			// A placeholder a failed claim left (no job): the job is
			// gone; the fence stays, to refuse that claim's late writes.
			return nil, false, nil
		case kernel.LiveJob:
			j, err := FromRecord(rec, now)
			return j, false, err
		}
		ok, err := s.q.store.EvictIf(ctx, key, rec.Revision)
		if err != nil {
			return nil, false, err
		}
		if ok {
			if rec.State != etcdstore.Done {
				s.q.log.Warn("idem: schedule: the previous occurrence's job was forgotten: its retention passed before it ended; deleted, so it never runs beside the next",
					"schedule", sc.Name, "job", id, "expired", rec.Expires)
			}
			return nil, true, nil
		}
	}
	return nil, false, fmt.Errorf("schedule %s: job %s: %w: its record kept changing", sc.Name, id, etcdstore.ErrUnavailable)
}

// plan returns the occurrences after from, up to now, to submit, the latest
// occurrence up to now, and how many missed ones it skips, by the kernel's
// rule (PlanRule).
func (sc *Schedule) plan(from, now time.Time, retention time.Duration) (submit []time.Time, last time.Time, skipped int, latestSkipped time.Time) {
	p := sc.planFrom(from, time.Time{}, now, retention)
	return p.Submit, p.Last, p.Skipped, p.LatestSkipped
}

// planFrom is plan's rule for a cursor at from, last written by a scheduler
// at written (zero: unknown).
func (sc *Schedule) planFrom(from, written, now time.Time, retention time.Duration) kernel.Plan {
	r := kernel.PlanRule{Next: sc.spec.Next, Retention: retention, Lateness: sc.Lateness, MaxSkew: sc.MaxSkew,
		MaxCatchUp: sc.MaxCatchUp, CatchUp: kernel.CatchUp(sc.CatchUp)}
	return r.PlanFrom(from, written, now)
}

func maxTime(ts ...time.Time) time.Time {
	m := ts[0]
	for _, t := range ts[1:] {
		if t.After(m) {
			m = t
		}
	}
	return m
}

// cursorValue is a schedule's cursor in etcd.
type cursorValue struct {
	// Last is the latest occurrence a scheduler handled (submitted or
	// skipped).
	Last time.Time `json:"last"`
	// At is when a scheduler last wrote the cursor, on its clock (zero in
	// cursors written before issue 38): a fleet that runs writes it at
	// every occurrence, so an old one says that no scheduler ran.
	At   time.Time `json:"at,omitzero"`
	Kind string    `json:"kind"`
	// Spec is the schedule's cron expression or interval, for operators.
	Spec string `json:"spec"`
	// Location, Overlap and CatchUp are the schedule's, as its last
	// scheduler knew them; DefaultParams is set when its occurrences' params
	// are the default ones (a backfill from the command line can make them).
	Location      string `json:"location,omitempty"`
	Overlap       string `json:"overlap,omitempty"`
	CatchUp       string `json:"catch_up,omitempty"`
	DefaultParams bool   `json:"default_params,omitempty"`
	// Paused: occurrences that come are skipped (Queue.PauseSchedule).
	Paused bool `json:"paused,omitempty"`
	// Prev is the latest occurrence decided to run, under an Overlap
	// policy other than OverlapAllowAll; Buffered the one held until Prev's
	// job ends (OverlapBufferOne).
	Prev     time.Time `json:"prev,omitzero"`
	Buffered time.Time `json:"buffered,omitzero"`
	// PrevAt is when Prev was decided, on its scheduler's clock: a
	// buffered occurrence is decided when the one before it ends, which
	// may be long after its own time (a day, after a long pause). Its job
	// is not forgotten before a retention after that.
	PrevAt time.Time `json:"prev_at,omitzero"`
	// Submitted is the occurrence whose job was submitted under this
	// cursor: the job's write sets it (etcdstore.IfValueThen), or a
	// scheduler that found the job there. Prev's job absent while
	// Submitted names Prev ended, or was forgotten: it is never
	// submitted again. A cursor that names no Submitted (written before
	// this field, or decided and not yet submitted) is judged by time.
	Submitted time.Time `json:"submitted,omitzero"`
}

// describe fills what cv says of sc.
func (cv *cursorValue) describe(sc *Schedule) {
	cv.Kind, cv.Spec, cv.Location = sc.Kind, sc.specString(), sc.Location.String()
	cv.Overlap, cv.CatchUp, cv.DefaultParams = sc.Overlap.String(), sc.CatchUp.String(), sc.Params == nil
}

// cursorName is the name of a schedule's cursor among the store's values
// (storex.Value): s/<tenant>/<schedule>.
func cursorName(tenant, schedule string) string { return "s/" + tenant + "/" + schedule }

// cursorKey is the key a schedule's cursor goes with on a shard set: the
// shard that places it keeps the cursor (Shards.GetValue), and hands
// it over as keys are handed over.
func (q *Queue) cursorKey(schedule string) etcdstore.Key {
	return etcdstore.Key{Tenant: q.tenant, ID: "schedule." + schedule}
}

// cursorAt is where a cursor was read: its revision in the queue's store,
// or, on a shard set, the shard and revision of its placed value.
type cursorAt struct {
	rev    int64
	placed storex.Placed
}

func (a cursorAt) revision() int64 {
	if a.placed.Shard != "" {
		return a.placed.Revision
	}
	return a.rev
}

// cursorGet reads schedule's cursor: its value (nil: there is none) and
// where it was read.
func (q *Queue) cursorGet(ctx context.Context, schedule string) ([]byte, cursorAt, error) {
	if q.set != nil {
		p, err := q.set.GetValue(ctx, q.cursorKey(schedule))
		if err != nil || !p.Exists {
			return nil, cursorAt{placed: p}, err
		}
		return p.Value, cursorAt{placed: p}, nil
	}
	v, err := storex.GetValue(q.store, ctx, cursorName(q.tenant, schedule))
	if err != nil || v.Revision == 0 {
		return nil, cursorAt{rev: v.Revision}, err
	}
	return v.Value, cursorAt{rev: v.Revision}, nil
}

// cursorPut writes schedule's cursor if it is still as read at (a zero at:
// only if there is none), and reports whether it did; if not, it returns
// the cursor as it stands (nil: none).
func (q *Queue) cursorPut(ctx context.Context, schedule string, b []byte, at cursorAt) ([]byte, cursorAt, bool, error) {
	if q.set != nil {
		p, ok, err := q.set.SetValue(ctx, q.cursorKey(schedule), b, at.placed)
		if err != nil || !p.Exists {
			return nil, cursorAt{placed: p}, ok, err
		}
		return p.Value, cursorAt{placed: p}, ok, nil
	}
	v, ok, err := storex.SetValue(q.store, ctx, cursorName(q.tenant, schedule), b, at.rev)
	if err != nil || v.Revision == 0 {
		return nil, cursorAt{rev: v.Revision}, ok, err
	}
	return v.Value, cursorAt{rev: v.Revision}, ok, nil
}

// cursor reads sc's cursor, creating it at now when the schedule is new:
// a new schedule's first occurrence is its first one after it was created
// (issue 38: created MaxSkew back, a schedule every 10 s submitted 30 jobs
// at its first tick, one every second 300).
func (s *Scheduler) cursor(ctx context.Context, sc *Schedule, now time.Time) (cursorValue, int64, error) {
	name := cursorName(s.q.tenant, sc.Name)
	v, at, err := s.q.cursorGet(ctx, sc.Name)
	if err != nil {
		return cursorValue{}, 0, err
	}
	var cv cursorValue
	if v != nil {
		if err := json.Unmarshal(v, &cv); err != nil {
			return cursorValue{}, 0, fmt.Errorf("schedule %s: cursor %s: %w", sc.Name, name, err)
		}
		return cv, at.revision(), nil
	}
	cv = cursorValue{Last: now.UTC().Truncate(time.Second), At: now.UTC()}
	cv.describe(sc)
	b, _ := json.Marshal(cv)
	cur, now2, ok, err := s.q.cursorPut(ctx, sc.Name, b, at)
	if err != nil {
		return cv, 0, err
	}
	if ok {
		return cv, now2.revision(), nil
	}
	if cur == nil {
		return cursorValue{}, 0, fmt.Errorf("schedule %s: %w: its cursor changed while it was made", sc.Name, storex.ErrValueChanged)
	}
	// Another scheduler made it first.
	if err := json.Unmarshal(cur, &cv); err != nil {
		return cursorValue{}, 0, fmt.Errorf("schedule %s: cursor %s: %w", sc.Name, name, err)
	}
	return cv, now2.revision(), nil
}

// setCursor writes cv as sc's cursor if its revision is still rev, and
// returns the new revision, or 0 when another scheduler moved it first.
func (s *Scheduler) setCursor(ctx context.Context, sc *Schedule, rev int64, cv cursorValue) (int64, error) {
	cv.describe(sc)
	cv.At = s.q.clock.Now().UTC()
	b, _ := json.Marshal(cv)
	if s.q.set != nil {
		// (Only the overlap policies set a cursor at a revision, and
		// NewScheduler refuses them on a shard set.)
		return 0, fmt.Errorf("schedule %s: %w: an overlap policy on a shard set", sc.Name, ErrInvalid)
	}
	v, ok, err := storex.SetValue(s.q.store, ctx, cursorName(s.q.tenant, sc.Name), b, rev)
	if err != nil || !ok {
		return 0, err
	}
	return v.Revision, nil
}

// advance moves sc's cursor forward to last, never back: a compare-and-set
// on its revision, read again when another scheduler moved it meanwhile.
func (s *Scheduler) advance(ctx context.Context, sc *Schedule, last time.Time) error {
	name := cursorName(s.q.tenant, sc.Name)
	v, at, err := s.q.cursorGet(ctx, sc.Name)
	if err != nil {
		return err
	}
	for try := 0; try < 8; try++ {
		var cv cursorValue
		if v != nil {
			if err := json.Unmarshal(v, &cv); err != nil {
				return fmt.Errorf("schedule %s: cursor %s: %w", sc.Name, name, err)
			}
		}
		if !last.After(cv.Last) {
			return nil
		}
		cv.Last, cv.At = last.UTC(), s.q.clock.Now().UTC()
		cv.describe(sc)
		b, _ := json.Marshal(cv)
		var ok bool
		if v, at, ok, err = s.q.cursorPut(ctx, sc.Name, b, at); err != nil || ok {
			return err
		}
		clock.Sleep(s.q.clock, ctx, time.Duration(rand.IntN(20))*time.Millisecond)
	}
	return fmt.Errorf("schedule %s: the cursor kept moving", sc.Name)
}

func (sc *Schedule) specString() string {
	if sc.Every > 0 {
		return "every " + sc.Every.String()
	}
	return sc.Cron
}

// ScheduleInfo is what etcd holds of a schedule: its cursor.
type ScheduleInfo struct {
	Name string
	Kind string
	// Spec is its cron expression, or "every <interval>"; Location the
	// cron expression's time zone.
	Spec     string
	Location string
	// Overlap and CatchUp are its policies ("" when the cursor predates
	// them: allow-all and latest).
	Overlap, CatchUp string
	// Paused: its occurrences are skipped until it is resumed.
	Paused bool
	// Last is the latest occurrence a scheduler handled; Prev the latest
	// decided to run and Buffered the one held until Prev's job ends
	// (under Overlap skip or buffer-one).
	Last, Prev, Buffered time.Time
	// DefaultParams: the occurrences' params are the default ones, so a
	// backfill from the command line can make them.
	DefaultParams bool
	spec          cron.Schedule
}

// Next returns the schedule's next n occurrences after t, or none when its
// spec cannot be read.
func (si ScheduleInfo) Next(t time.Time, n int) []time.Time {
	if si.spec == nil {
		return nil
	}
	var out []time.Time
	for len(out) < n {
		if t = si.spec.Next(t); t.IsZero() {
			break
		}
		out = append(out, t)
	}
	return out
}

// Schedule rebuilds the schedule the cursor describes (without a Params
// function: the default params), or an error saying why it cannot.
func (si ScheduleInfo) Schedule(retention time.Duration) (Schedule, error) {
	sc := Schedule{Name: si.Name, Kind: si.Kind}
	if d, ok := strings.CutPrefix(si.Spec, "every "); ok {
		every, err := time.ParseDuration(d)
		if err != nil {
			return sc, fmt.Errorf("%w: schedule %s: spec %q: %v", ErrInvalid, si.Name, si.Spec, err)
		}
		sc.Every = every
	} else {
		sc.Cron = si.Spec
		if si.Location != "" {
			loc, err := time.LoadLocation(si.Location)
			if err != nil {
				return sc, fmt.Errorf("%w: schedule %s: location %q: %v", ErrInvalid, si.Name, si.Location, err)
			}
			sc.Location = loc
		}
	}
	if err := sc.validate(retention); err != nil {
		return sc, err
	}
	return sc, nil
}

// Schedules returns the schedules of tenant (DefaultTenant when empty) that
// schedulers ran on the store of admin, from their cursors in etcd, in name
// order. It needs no session: operators' tools call it with an Admin.
func Schedules(ctx context.Context, admin *etcdstore.Admin, tenant string) ([]ScheduleInfo, error) {
	if tenant == "" {
		tenant = DefaultTenant
	}
	var out []ScheduleInfo
	// A queue of one cluster's cursors, and a shard set's (placed values:
	// on a shard, those it holds; a value handed over reads as a marker,
	// which is no cursor).
	for _, prefix := range []string{cursorName(tenant, ""), storex.PlacedName(etcdstore.Key{Tenant: tenant, ID: "schedule."})} {
		vs, err := storex.Values(admin, ctx, prefix)
		if err != nil {
			return nil, fmt.Errorf("schedules: %w", err)
		}
		for _, v := range vs {
			var cv cursorValue
			if err := json.Unmarshal(v.Value, &cv); err != nil {
				continue
			}
			si := ScheduleInfo{Name: v.Name[len(prefix):], Kind: cv.Kind, Spec: cv.Spec, Location: cv.Location, Overlap: cv.Overlap,
				CatchUp: cv.CatchUp, Paused: cv.Paused, Last: cv.Last, Prev: cv.Prev, Buffered: cv.Buffered, DefaultParams: cv.DefaultParams}
			if sc, err := si.Schedule(365 * 24 * time.Hour); err == nil {
				si.spec = sc.spec
			}
			out = append(out, si)
		}
	}
	return out, nil
}

// PauseSchedule pauses (paused true) or resumes schedule name of the
// queue's tenant, for every scheduler of it: while it is paused, its
// occurrences are skipped (counted and logged), not run later. The
// schedule must have run (its cursor exists: etcdstore.ErrNotFound).
// Pausing a paused schedule changes nothing.
func (q *Queue) PauseSchedule(ctx context.Context, name string, paused bool) error {
	if err := validName(name, 64, true); err != nil {
		return fmt.Errorf("pause schedule: %w: name %q: %v", ErrInvalid, name, err)
	}
	for try := 0; try < 8; try++ {
		v, at, err := q.cursorGet(ctx, name)
		if err != nil {
			return fmt.Errorf("pause schedule %s: %w", name, err)
		}
		if v == nil {
			return fmt.Errorf("pause schedule %s: %w: no scheduler ran it (tenant %s)", name, etcdstore.ErrNotFound, q.tenant)
		}
		var cv cursorValue
		if err := json.Unmarshal(v, &cv); err != nil {
			return fmt.Errorf("pause schedule %s: cursor: %w", name, err)
		}
		if cv.Paused == paused {
			return nil
		}
		cv.Paused = paused
		b, _ := json.Marshal(cv)
		if _, _, ok, err := q.cursorPut(ctx, name, b, at); err != nil || ok {
			if err != nil {
				return fmt.Errorf("pause schedule %s: %w", name, err)
			}
			return nil
		}
	}
	return fmt.Errorf("pause schedule %s: %w: the cursor kept moving", name, etcdstore.ErrUnavailable)
}

// MaxBackfill bounds the occurrences one Backfill submits.
const MaxBackfill = 10_000

// Backfill submits the occurrences of sc from from to to (both included)
// as jobs, each with its occurrence's id, so each still runs once: an
// occurrence a scheduler submitted already is not submitted again. It
// returns how many occurrences it submitted anew. The range must lie in
// the past and within half the store's retention (an older occurrence's
// job may have been forgotten, and would run twice), with at most
// MaxBackfill occurrences. A backfill ignores sc's Overlap: its jobs may
// run at once, as workers take them.
func (q *Queue) Backfill(ctx context.Context, sc Schedule, from, to time.Time) (int, error) {
	if err := sc.validate(q.retention()); err != nil {
		return 0, fmt.Errorf("backfill: %w", err)
	}
	now := q.clock.Now()
	switch {
	case to.Before(from):
		return 0, fmt.Errorf("backfill %s: %w: from %v is after to %v", sc.Name, ErrInvalid, from, to)
	case to.After(now):
		return 0, fmt.Errorf("backfill %s: %w: to %v is in the future: its occurrences are the schedulers'", sc.Name, ErrInvalid, to)
	case from.Before(now.Add(-q.retention() / 2)):
		return 0, fmt.Errorf("backfill %s: %w: from %v is older than half the store's retention (%v): those jobs may be forgotten, and would run twice",
			sc.Name, ErrInvalid, from, q.retention())
	}
	var times []time.Time
	for t := sc.spec.Next(from.Add(-time.Nanosecond)); !t.IsZero() && !t.After(to); t = sc.spec.Next(t) {
		if len(times) == MaxBackfill {
			return 0, fmt.Errorf("backfill %s: %w: more than %d occurrences in the range", sc.Name, ErrInvalid, MaxBackfill)
		}
		times = append(times, t)
	}
	n := 0
	for _, t := range times {
		params, err := sc.params(t)
		if err == nil {
			_, err = q.Submit(ctx, OccurrenceID(sc.Name, t), sc.Kind, params, RunAt(t), RefuseDuplicate())
		}
		switch {
		case err == nil:
			n++
		case errors.Is(err, ErrDuplicate):
		default:
			return n, fmt.Errorf("backfill %s: occurrence %s: %w", sc.Name, t.Format(occurrenceLayout), err)
		}
	}
	return n, nil
}
