package kernel

import "time"

// A schedule's occurrences are jobs named by the schedule; its cursor, a
// value every scheduler of it shares, says the latest occurrence handled,
// and under an overlap policy the occurrence that runs (Prev), the one
// buffered, and which was submitted. These are the decisions about the
// cursor and the records it names.

// CatchUp is a schedule's policy for missed occurrences.
type CatchUp uint8

// The catch-up policies.
const (
	CatchUpLatest CatchUp = iota // run the most recent missed occurrence
	CatchUpAll                   // run every missed one, up to a bound
	CatchUpNone                  // skip them
)

// Plan is which occurrences a scheduler submits at a tick.
type Plan struct {
	Submit        []time.Time // to submit, oldest first
	Last          time.Time   // the latest occurrence up to now
	Skipped       int         // missed ones skipped
	LatestSkipped time.Time
	// AfterOutage says no scheduler ran: the first occurrence after the
	// cursor is late on every clock within MaxSkew, and no scheduler wrote
	// the cursor for longer than Lateness plus MaxSkew by any of them.
	// CatchUp decided every occurrence late on this clock.
	AfterOutage bool
}

// PlanRule is a schedule's rule for its occurrences.
type PlanRule struct {
	Next       func(time.Time) time.Time // the schedule's next occurrence after a time (zero: none)
	Retention  time.Duration             // the store's
	Lateness   time.Duration
	MaxSkew    time.Duration
	MaxCatchUp int
	CatchUp    CatchUp
}

// PlanFrom returns the occurrences after from (the cursor, last written
// by a scheduler at written on its clock; zero: unknown), up to now, to
// submit. An occurrence older than half the retention is never submitted
// (its job may have been forgotten, and would run twice). While the
// schedule runs, one is missed only once it is late by more than Lateness
// plus MaxSkew on this clock, so a scheduler whose clock runs ahead never
// skips, for the fleet, an occurrence the others would submit on time.
// After an outage the skew tolerance would make every occurrence of the
// last MaxSkew "on time" at once (300 for a schedule every second): CatchUp
// is then the one rule for the past, and an occurrence is missed once it
// is late by more than Lateness on this clock. An outage is two facts
// true on every clock within MaxSkew of this one: the first occurrence
// after the cursor is late (by more than Lateness plus MaxSkew here), and
// no scheduler wrote the cursor for longer than Lateness plus MaxSkew (its
// write is older than Lateness plus twice MaxSkew here). The first alone
// is no outage: a fleet whose tick is a little late (an etcd election)
// looks so to a clock MaxSkew ahead (review). Missed ones go as CatchUp
// says.
func (r PlanRule) PlanFrom(from, written, now time.Time) Plan {
	var p Plan
	oldest := now.Add(-r.Retention / 2)
	if from.Before(oldest) {
		// The count goes on from the last one skipped (an occurrence at
		// oldest itself is the next loop's).
		for t := r.Next(from); !t.IsZero() && t.Before(oldest); t = r.Next(t) {
			p.Skipped++
			p.LatestSkipped, from = t, t
			if p.Skipped == 1_000_000 {
				from = oldest // more than anyone counts: the rest uncounted
				break
			}
		}
	}
	var missed, submit []time.Time
	edge := now.Add(-r.Lateness - r.MaxSkew)
	stalled := !written.IsZero() && written.Before(now.Add(-r.Lateness-2*r.MaxSkew))
	if first := r.Next(from); !first.IsZero() && first.Before(edge) && stalled {
		p.AfterOutage, edge = true, now.Add(-r.Lateness)
	}
	for t := r.Next(from); !t.IsZero() && !t.After(now); t = r.Next(t) {
		p.Last = t
		if t.Before(edge) {
			missed = append(missed, t)
			if len(missed) > r.MaxCatchUp {
				p.LatestSkipped = missed[0]
				missed = missed[1:]
				p.Skipped++
			}
			continue
		}
		submit = append(submit, t)
	}
	switch {
	case len(missed) == 0:
	case r.CatchUp == CatchUpNone:
		p.Skipped += len(missed)
		p.LatestSkipped = missed[len(missed)-1]
		missed = nil
	case r.CatchUp == CatchUpLatest:
		p.Skipped += len(missed) - 1
		if len(missed) > 1 {
			p.LatestSkipped = missed[len(missed)-2]
		}
		missed = missed[len(missed)-1:]
	}
	p.Submit = append(missed, submit...)
	return p
}

// Overlapping is what an occurrence becomes under an overlap policy.
type Overlapping uint8

// The fates of an occurrence under an overlap policy.
const (
	OccurrenceRuns     Overlapping = iota + 1 // the previous one ended: it runs (the cursor's Prev)
	OccurrenceBuffered                        // held until the previous one ends (buffer one)
	OccurrenceSkipped                         // skipped (Why)
)

// Overlap decides an occurrence that comes while the previous one runs
// (running), or not, under a policy that buffers one (bufferOne) or skips,
// with an occurrence buffered already or not.
func Overlap(running, bufferOne, buffered bool) (Overlapping, string) {
	switch {
	case !running:
		return OccurrenceRuns, ""
	case bufferOne && !buffered:
		return OccurrenceBuffered, ""
	case bufferOne:
		return OccurrenceSkipped, "an occurrence is buffered already while the previous one runs"
	}
	return OccurrenceSkipped, "the previous occurrence still runs"
}

// MayBeForgotten reports whether the job of an occurrence decided to run
// (prev, decided at prevAt: a buffered occurrence is decided when the one
// before it ends, maybe long after its own time), absent now, may have
// been forgotten: its job was created, if ever, after the decision, which
// came at the earliest MaxSkew before the occurrence, and is kept a
// retention after its last write. Before then (on a clock up to MaxSkew
// ahead), absent means never submitted.
func MayBeForgotten(prev, prevAt, now time.Time, retention, maxSkew time.Duration) bool {
	since := prev
	if prevAt.After(since) {
		since = prevAt
	}
	return !now.Before(since.Add(retention - 2*maxSkew))
}

// NotStarted reports whether the job of the previous occurrence (at prev)
// has not started yet and is less than maxSkew old on this clock: this
// scheduler's clock may run ahead of the fleet's, and the job is held back
// until its time on the workers' clocks. No decision is made on it yet.
func NotStarted(waiting bool, attempts int, prev, now time.Time, maxSkew time.Duration) bool {
	return waiting && attempts == 0 && now.Before(prev.Add(maxSkew))
}

// Forgetting is what a scheduler does with the record of the previous
// occurrence's job that a read found gone or past its retention.
type Forgetting uint8

// The steps of forgetting a job.
const (
	NoJob    Forgetting = iota + 1 // no record (or a fence a failed claim left): the job is gone
	LiveJob                        // a live record: the job is there (written since)
	EvictJob                       // past its retention: delete it if still as read (EvictIf), then it is gone for good
)

// Forget judges the record (nil: absent) of a job that a read found
// absent, so that its absence is final: a record etcd still holds past its
// retention (by this clock) is deleted, so that no claim that read it live
// before (or on a clock behind this one) can take it over after the
// scheduler took it for ended and decided the next occurrence.
func Forget(rec *Record, now time.Time) Forgetting {
	switch {
	case rec == nil, rec.Fence:
		return NoJob
	case now.Before(rec.Expires):
		return LiveJob
	}
	return EvictJob
}
