package kernel

import "time"

// A per-key concurrency limit is a number of slots, each an etcd value
// that an attempt takes (a compare-and-set on its revision) before it runs
// a step and frees when it ends. A slot names the job and the token of the
// claim that took it; a slot whose claim can write nothing more is free to
// take. Since a job's steps commit only under their claim (fenced), no
// more jobs of a key than its slots ever commit in one span of revisions.

// Slot is a concurrency slot as read: its index among the key's slots,
// its revision, and whom it holds (Damaged: a value that names nobody).
type Slot struct {
	Index   int
	Rev     int64
	Job     string
	Token   int64
	Damaged bool
}

// SlotPlan is what the slots read say to a claim that needs one.
type SlotPlan struct {
	// Ours is an earlier try of this very claim that landed (its reply was
	// lost): the claim holds it.
	Ours *Slot
	// Later is the token of a later claim of the same job that holds a
	// slot: this claim was taken over and must take nothing (0: none).
	Later int64
	// Taken are the indices of every slot written; Stale those whose claim
	// can write nothing more, known from the slots alone (damaged, or an
	// earlier claim of this job); Others the slots of other jobs, stale
	// only once their claims are over (a read: Store.ClaimHeld), which is
	// worth asking only when the limit is full without them.
	Taken  map[int]bool
	Stale  []Slot
	Others []Slot
}

// JudgeSlots reads the slots of one limit's key for the claim of job with
// token.
func JudgeSlots(slots []Slot, job string, token int64) SlotPlan {
	p := SlotPlan{Taken: map[int]bool{}}
	for i := range slots {
		s := slots[i]
		switch {
		case s.Damaged:
			p.Stale = append(p.Stale, s) // nobody's
		case s.Job == job && s.Token == token:
			p.Ours = &s
			return p
		case s.Job == job && s.Token < token:
			p.Stale = append(p.Stale, s) // an earlier attempt of this job: its claim is over
		case s.Job == job:
			p.Later = s.Token
			return p
		default:
			p.Others = append(p.Others, s)
		}
		p.Taken[s.Index] = true
	}
	return p
}

// Full reports whether every slot of a limit of concurrency is held, as
// far as the plan knows.
func (p SlotPlan) Full(concurrency int) bool { return len(p.Taken)-len(p.Stale) >= concurrency }

// Pick returns the slot to take: the first index below the bound that was
// never written (rev 0), else a stale one below it (at its revision); ok
// is false when there is none (holders above a lowered bound fill it).
func (p SlotPlan) Pick(concurrency int) (index int, rev int64, ok bool) {
	for i := range concurrency {
		if !p.Taken[i] {
			return i, 0, true
		}
	}
	for _, s := range p.Stale {
		if s.Index < concurrency {
			return s.Index, s.Rev, true
		}
	}
	return 0, 0, false
}

// RateSlot is a rate slot as read: when it may be used again (unix ms; 0
// when its value is unreadable, which frees it).
type RateSlot struct {
	Index int
	Rev   int64
	Until int64
}

// PickRate returns the rate slot to take at now among burst: the first
// index never written (rev 0), else the first whose time has come (at its
// revision); ok false when each is used, with the soonest time one frees.
func PickRate(slots []RateSlot, burst int, now time.Time) (index int, rev int64, soonest time.Time, ok bool) {
	used := map[int]RateSlot{}
	free := map[int]bool{}
	for _, s := range slots {
		if s.Index < 0 || s.Index >= burst {
			continue
		}
		used[s.Index] = s
		if s.Until > now.UnixMilli() {
			if at := time.UnixMilli(s.Until); soonest.IsZero() || at.Before(soonest) {
				soonest = at
			}
			continue
		}
		free[s.Index] = true // its time has come: free, at its revision
	}
	for i := range burst {
		if s, ok := used[i]; !ok {
			return i, 0, time.Time{}, true
		} else if free[i] {
			return i, s.Rev, time.Time{}, true
		}
	}
	return 0, 0, soonest, false
}

// RateSlack is how long after it read its clock to take a rate slot an
// attempt may still start: a twentieth of the slot's period, at least
// 100 ms (an etcd write across data centres), at most a second. The slot
// is set that much longer than its period.
func RateSlack(period time.Duration) time.Duration {
	return min(max(period/20, 100*time.Millisecond), time.Second)
}

// RateLate reports whether an attempt whose rate slot was set from a time
// it must start by (startBy) is too late to start at now: the next attempt
// could take the slot less than a period after this one starts. The slot
// counts as used.
func RateLate(startBy, now time.Time) bool { return now.After(startBy) }
