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
	ReapCheck                      // the lost write can no longer land: read the record once more (ReapChecked)
)

// Reap judges the record the reaper read at now (nil: absent); until is
// when the last of the claim's lost writes may still land (its last send
// and the longest a request takes to be applied). Its own claim (the lost
// write landed) is abandoned, so the next claimant anywhere takes the key
// over at once. A record written after seen (the highest revision the
// claim saw etcd at) that is not its own, or one done, keeps any lost
// write from landing while it is there: done, if it is there until then
// (retained past until); if it may be deleted before (the sweeper and
// EvictIf delete expired records), the reaper looks again once it has
// expired. Otherwise (absent, expired, or an in-flight or Moved record the
// claim saw, which a lost write may have compared: a claim with
// OverMoved writes over a Moved record it read) the key is fenced, with
// the claim's own OverMoved (a fence without it meets the Moved record as
// the lost write did, and is refused: done then). The fence is
// conditioned on that very state, so once it lands the lost write never
// can (revisions only grow), and it lives a retention. (The model checker
// found a lost create landing on a key whose record the reaper had taken
// as a guard, deleted as expired in between.)
func Reap(rec *Record, owner, attempt string, seen int64, now, until time.Time) Reaping {
	switch {
	case rec != nil && rec.State == InFlight && rec.Owner == owner && SameAttempt(rec.Attempt, attempt):
		return ReapAbandon
	case rec == nil || rec.Expired(now) || (rec.State == InFlight || rec.State == Moved) && rec.Revision <= seen:
		return ReapFence
	case !rec.Expired(until):
		return ReapDone
	}
	return ReapRetry
}

// FenceSet is the shard set a reaper's fence compares (the fence claims
// with the lost claim's OverMoved): over a Moved record, lost, the set the
// lost claim compared, since the Moved record may be the hand-over a newer
// set made, which only a write under the old set may replace, as the lost
// write would; else own, the set the reaper's process holds now.
func FenceSet(overMoved bool, lost, own int64) int64 {
	if overMoved {
		return lost
	}
	return own
}

// ReapChecked judges the record read once the lost write can no longer
// land (ReapCheck): abandon it if it landed, else done.
func ReapChecked(rec *Record, owner, attempt string) Reaping {
	if rec != nil && rec.State == InFlight && rec.Owner == owner && SameAttempt(rec.Attempt, attempt) {
		return ReapAbandon
	}
	return ReapDone
}

// ReapFenced judges how the reaper's fencing claim (for a claim of
// owner's session that saw etcd up to seen, whose lost writes may land
// until then) ended: won as a fence (written abandoned), done; won as its
// own claim (the lost write had landed meanwhile: recognised by its
// attempt), abandon it. Refused by a record that keeps the lost write out
// (done, another operation, Moved, or held by a live owner), done if that
// record is there until then, as Reap says. But a conflict with a record
// of owner's own session written at or before seen proves nothing: the
// lost write may have compared it (it judged it an orphan of this
// process), and what makes it live now is this process holding its
// attempt (running it, saving its outcome, or reaping it), which ends; the
// reaper looks again later. (Found by the model checker: two reapers of
// one process, the second judging the first's claim held here and giving
// up, and its lost takeover landing after as an orphan of a live session.)
func ReapFenced(a Answer, owner string, seen int64, until time.Time) Reaping {
	switch a.Verdict {
	case Won:
		if r := a.Record; r.State == InFlight && r.Owner == "" {
			return ReapDone
		}
		return ReapAbandon
	case SetChanged:
		// The shard set moved since the fence's (and so since the lost
		// write's, which compared the same or an older one): revisions
		// only grow, the lost write's compare can never hold from now on.
		// It may have landed before: a read now says (ReapChecked).
		return ReapCheck
	case Conflict, Replay, Mismatch, IsMoved:
		r := a.Record
		switch {
		case r == nil, a.Verdict == Conflict && r.Owner == owner && r.Revision <= seen, r.Expired(until):
			return ReapRetry
		}
		return ReapDone
	}
	return ReapRetry
}
