package kernel

import "time"

// Reaping is what a process's reaper does about a claim of its session
// whose claim write had an unknown outcome: that write may have landed, or
// may still land, as an in-flight record under a live session that nobody
// runs.
type Reaping uint8

// The reaper's steps.
const (
	ReapDone    Reaping = iota + 1 // nothing (more) to do: no lost write can land
	ReapAbandon                    // the lost write landed: abandon the claim it made
	ReapFence                      // fence the key: claim it again with the same attempt, written abandoned (ClaimRequest.Fence)
	ReapRetry                      // etcd could not say: try again later
)

// Reap judges the record the reaper read at now (nil: absent): its own
// claim (the lost write landed) is abandoned, so the next claimant anywhere
// takes the key over at once. A record written after seen (the highest
// revision the claim saw etcd at), not its own, needs nothing: no lost
// write can land on it; nor does one that is done or moved. Otherwise
// (absent, or a state the claim saw, which a lost write may have compared)
// the key is fenced: that write is conditioned on that very state, so once
// the fence lands the lost one never can (etcd revisions only grow). A
// record past its retention is fenced too, whoever wrote it: the sweeper
// or an EvictIf may delete it next, and a lost create would then land on
// the empty key (found by the model checker); the fence lives a retention.
func Reap(rec *Record, owner, attempt string, seen int64, now time.Time) Reaping {
	switch {
	case rec != nil && rec.State == InFlight && rec.Owner == owner && SameAttempt(rec.Attempt, attempt):
		return ReapAbandon
	case rec != nil && (rec.Revision > seen || rec.State != InFlight) && !rec.Expired(now):
		return ReapDone
	}
	return ReapFence
}

// ReapFenced judges how the reaper's fencing claim (for a claim of
// owner's session that saw etcd up to seen) ended: won as a fence
// (written abandoned), done; won as its own claim (the lost write had
// landed meanwhile: recognised by its attempt), abandon it; done, another
// operation or Moved, done: the lost write never wrote over such a record.
// Held by a live owner, done, but for a record of owner's own session
// written at or before seen: that record may be one the lost write
// compared (it judged it an orphan of this process), and what makes it
// live now is this process holding its attempt (running it, saving its
// outcome, or reaping it), which ends; the reaper looks again later.
// (Found by the model checker: two reapers of one process, the second
// judging the first's claim held here and giving up, and its lost
// takeover landing after as an orphan of a live session.)
func ReapFenced(a Answer, owner string, seen int64) Reaping {
	switch a.Verdict {
	case Won:
		if r := a.Record; r.State == InFlight && r.Owner == "" {
			return ReapDone
		}
		return ReapAbandon
	case Conflict:
		if r := a.Record; r != nil && (r.Owner != owner || r.Revision > seen) {
			return ReapDone
		}
	case Replay, Mismatch, IsMoved:
		return ReapDone
	}
	return ReapRetry
}
