package jobs

import (
	"time"

	"github.com/robfig/cron/v3"
)

// zoned is a cron schedule read on the wall clock of a time zone, with one
// rule for the wall times daylight saving repeats or skips: an occurrence
// is the first instant at which the zone's wall clock reads its time or
// later. A wall time that happens twice (the hour repeated when clocks go
// back) runs once, at its first instant; one that never happens (the hour
// skipped when clocks go forward) runs at the first instant after the gap,
// when the clock jumps past it, as Vixie cron does: never twice, never
// silently not at all. robfig/cron alone matches the repeated hour twice
// and the skipped one never.
type zoned struct {
	spec cron.Schedule // read on a wall clock without daylight saving (UTC)
	loc  *time.Location
}

// Next returns the first occurrence after t.
func (z zoned) Next(t time.Time) time.Time {
	w := wall(t.In(z.loc))
	for i := 0; i < 10000; i++ {
		if w = z.spec.Next(w); w.IsZero() {
			return w
		}
		if at := firstAt(w, z.loc); at.After(t) {
			return at.UTC()
		}
	}
	return time.Time{}
}

// wall is t's wall clock reading, as a time in UTC.
func wall(t time.Time) time.Time {
	return time.Date(t.Year(), t.Month(), t.Day(), t.Hour(), t.Minute(), t.Second(), t.Nanosecond(), time.UTC)
}

// firstAt returns the first instant at which loc's wall clock reads w (a
// wall time, in UTC) or later.
func firstAt(w time.Time, loc *time.Location) time.Time {
	// The instants w names under the offsets in force around it.
	var cands []time.Time
	for _, near := range []time.Time{w.Add(-36 * time.Hour), w.Add(36 * time.Hour)} {
		_, off := near.In(loc).Zone()
		cands = append(cands, w.Add(-time.Duration(off)*time.Second))
	}
	lo, hi := cands[0], cands[1]
	if hi.Before(lo) {
		lo, hi = hi, lo
	}
	for _, c := range []time.Time{lo, hi} {
		if wall(c.In(loc)).Equal(w) {
			return c // the earlier instant that reads w exactly
		}
	}
	// A gap: no instant reads w. The first one that reads later lies
	// between the two (the clock jumped over w there).
	for hi.Sub(lo) > time.Second {
		mid := lo.Add(hi.Sub(lo) / 2).Truncate(time.Second)
		if mid.Equal(lo) {
			break
		}
		if wall(mid.In(loc)).Before(w) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi
}
