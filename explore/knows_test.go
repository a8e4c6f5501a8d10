package explore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// What a process knows, and what it must then not do: invariants 13-17,
// checked on the events its log and its actors report. They find a store
// that does the right thing too late (a claim that outlives what its
// process knows ended it) or to the wrong claim (a reaper that abandons a
// claim someone holds), which fencing would otherwise hide:
//
//  13. An actor that checks its claim before each effect (a heeding one)
//     never acts once its process knows the claim ended: after it logged
//     the loss of the claim's session, past the claim's deadline, or past
//     its record's expiry, by the process's own clock.
//  14. A process's reaper never abandons a claim an actor holds (before
//     its deadline).
//  15. A process never takes over a key whose outcome it still holds,
//     pending in the background, of a claim still held when its work
//     ended; nor one whose Run still runs the work of the claim it
//     replaces, lost with its session (only that claim's deadline or its
//     record's expiry give it up).
//  16. A claim that failed with ErrNotSent did not land: no record of its
//     attempt is written after the call began; nor did a checkpoint,
//     complete or abandon told ErrNotSent.
//  17. A claim is held until its deadline: its work is never told it
//     ended at its deadline before the deadline came (checked by the
//     actors: endedEarly).
//
// And liveness's last word: every key that the rules say is free (past
// its deadline, its session gone, abandoned) can be claimed.

// keyOfDigest returns the key of the world whose digest is d (the store
// logs keys as digests), or d.
func (w *world) keyOfDigest(d string) string {
	for _, k := range w.keys() {
		if storeKey(k).Digest() == d {
			return k
		}
	}
	return d
}

// claimInfo is what history says of one claim (key and token).
type claimInfo struct {
	owner    string
	deadline time.Time
}

func (w *world) checkKnown(hist map[string][]version, claims func(key string, token int64) (claimInfo, bool), rolledBack map[string]bool, skew func(proc string) time.Duration) []string {
	var bad []string
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }

	lost := map[string]int{} // "proc owner" -> first seq the process logged the session lost
	type hold struct {
		grant, until int
		proc         string
		run          bool // the work of a Run (Do, the proxy, gRPC): the store knows when it ends
	}
	inTime := map[string]bool{}    // "key token" -> its work ended while the claim was held
	holds := map[string][]*hold{}  // "key token" -> holds by actors
	open := map[string]*hold{}     // "actor key" -> the hold under way
	pending := map[string]string{} // final-write task -> process, while it runs
	for _, e := range w.events {
		switch e.kind {
		case evSessionLost:
			if _, ok := lost[e.proc+" "+e.owner]; !ok {
				lost[e.proc+" "+e.owner] = e.seq
			}
		case evGrant:
			h := &hold{grant: e.seq, proc: e.proc, run: e.via == "do" || e.via == "bulk" || e.via == "proxy" || e.via == "grpc"}
			holds[fmt.Sprintf("%s %d", e.key, e.token)] = append(holds[fmt.Sprintf("%s %d", e.key, e.token)], h)
			open[e.actor+" "+e.key] = h
			// 15. A takeover in the process that holds the outcome of a
			// claim still held when its work ended (an outcome that came
			// past the claim's deadline, or after its session was lost,
			// came too late to keep the key).
			// And a takeover, in the process whose Run still runs the
			// work of the claim it replaces, of a claim its process
			// lost the session of (only its deadline or its record's
			// expiry give it up while its work runs).
			if e.tookOver && e.proc != "" {
				replaced := replacedToken(hist[e.key], e.token)
				for _, h := range holds[fmt.Sprintf("%s %d", e.key, replaced)] {
					if !h.run || h.proc != e.proc || h.until != 0 || h.grant >= e.seq {
						continue
					}
					ci, ok := claims(e.key, replaced)
					now := e.at.Add(skew(e.proc))
					if !ok || !ci.deadline.IsZero() && !now.Before(ci.deadline) {
						continue
					}
					if last := lastWriteOf(hist, w, e.key, replaced, e.at); last != nil && !now.Before(last.rec.Expires) {
						continue
					}
					fail("%s: %s took the key over (token %d) at %d while the same process still ran the work of the claim it replaced (token %d, granted at %d)", e.key, e.proc, e.token, e.seq, replaced, h.grant)
				}
			}
			if e.tookOver && e.proc != "" {
				k := "complete " + storeKey(e.key).String() + " "
				for task, proc := range pending {
					if proc != e.proc || !strings.HasPrefix(task, k) {
						continue
					}
					var token int64
					fmt.Sscan(strings.TrimPrefix(task, k), &token)
					// Only a takeover of that very claim's record: one that
					// another process took over already fenced the pending
					// outcome out, and taking that one over is its right.
					if inTime[fmt.Sprintf("%s %d", e.key, token)] && replacedToken(hist[e.key], e.token) == token {
						fail("%s: %s took the key over (token %d) at %d while the same process still held its outcome, pending: %s", e.key, e.proc, e.token, e.seq, task)
					}
				}
			}
		case evHoldEnd:
			if h := open[e.actor+" "+e.key]; h != nil && h.until == 0 {
				h.until = e.seq
				// Did the work end while its claim was still held?
				id := fmt.Sprintf("%s %d", e.key, e.token)
				if ci, ok := claims(e.key, e.token); ok && h.proc != "" {
					_, gone := lost[h.proc+" "+ci.owner]
					late := !ci.deadline.IsZero() && !e.at.Add(skew(h.proc)).Before(ci.deadline)
					inTime[id] = !gone && !late
				}
			}
		case evTaskStart:
			pending[e.task] = e.proc
		case evTaskDone:
			delete(pending, e.task)
		case evCrash:
			for task, proc := range pending {
				if proc == e.proc {
					delete(pending, task) // gone with its process
				}
			}
		}
	}

	lastWrite := func(key string, token int64, at time.Time) *version { return lastWriteOf(hist, w, key, token, at) }
	sessionEnded := map[string]int{} // owner -> seq its session ended in etcd
	for _, e := range w.events {
		if _, ok := sessionEnded[e.owner]; !ok && e.kind == evSessionEnd && e.owner != "" {
			sessionEnded[e.owner] = e.seq
		}
	}
	for _, e := range w.events {
		switch {
		case e.kind == evEffect && e.heeds && e.proc != "" && !rolledBack[e.key]:
			// 13.
			ci, ok := claims(e.key, e.token)
			if !ok {
				continue
			}
			if at, ok := lost[e.proc+" "+ci.owner]; ok && at < e.seq && !e.deadlineOnly {
				fail("%s step %d: %s acted under token %d at %d, after %s logged the loss of the claim's session %s at %d", e.key, e.step, e.actor, e.token, e.seq, e.proc, ci.owner, at)
			}
			now := e.at.Add(skew(e.proc))
			if !ci.deadline.IsZero() && !now.Before(ci.deadline) {
				fail("%s step %d: %s acted under token %d at %d (clock %v), past the claim's deadline %v", e.key, e.step, e.actor, e.token, e.seq, now.Format("15:04:05.000"), ci.deadline.Format("15:04:05.000"))
			}
			last := lastWrite(e.key, e.token, e.at)
			if last != nil && last.rec.State == etcdstore.InFlight && !now.Before(last.rec.Expires) {
				fail("%s step %d: %s acted under token %d at %d (clock %v), past its record's expiry %v", e.key, e.step, e.actor, e.token, e.seq, now.Format("15:04:05.000"), last.rec.Expires.Format("15:04:05.000"))
			}
		case e.kind == evReaped:
			// 14. (A claim past its deadline or its record's expiry, or
			// whose session ended, is no longer held by the rules: anyone
			// may take it over, the reaper too.)
			now := e.at.Add(skew(e.proc))
			if ci, ok := claims(e.key, e.token); ok {
				if !ci.deadline.IsZero() && !now.Before(ci.deadline) {
					continue
				}
				if at, ok := sessionEnded[ci.owner]; ok && at < e.seq {
					continue
				}
			}
			if last := lastWrite(e.key, e.token, e.at); last != nil && !now.Before(last.rec.Expires) {
				continue
			}
			for _, h := range holds[fmt.Sprintf("%s %d", e.key, e.token)] {
				if h.grant < e.seq && (h.until == 0 || h.until > e.seq) {
					fail("%s: %s's reaper abandoned the claim of token %d at %d, held by an actor since %d", e.key, e.proc, e.token, e.seq, h.grant)
				}
			}
		case e.kind == evNotSent:
			// 16.
			for _, v := range hist[e.key] {
				if v.rev > e.token && !v.deleted && storex.SameAttempt(v.rec.Attempt, e.attempt) {
					fail("%s: a claim was told it was not sent (%s), yet a record of its attempt %s exists (revision %d)", e.key, e.err, e.attempt, v.rev)
					break
				}
			}
		case e.kind == evWriteNotSent:
			// 16, for a claim's writes.
			for _, v := range hist[e.key] {
				if v.rev <= e.from || v.rev > e.to || v.deleted || int64(v.rec.Token) != e.token {
					continue
				}
				landed := false
				switch e.body {
				case "checkpoint":
					landed = string(v.rec.Checkpoint) == strconv.Itoa(e.step)
				case "complete":
					landed = v.rec.State == etcdstore.Done
				case "abandon":
					landed = v.rec.State == etcdstore.InFlight && v.rec.Owner == ""
				}
				if landed {
					fail("%s: a %s of token %d was told it was not sent (%s), yet it landed (revision %d)", e.key, e.body, e.token, e.err, v.rev)
					break
				}
			}
		case e.kind == evProbe && e.body == "unreachable":
			fail("liveness: once faults stopped, %s", e.err)
		case e.kind == evProbe && e.err != "":
			fail("liveness: %s is free by the rules (%s), and a claim of it was refused: %s", e.key, e.body, e.err)
		}
	}
	return bad
}

// lastWriteOf is the last write of claim (key, token) at or before at.
func lastWriteOf(hist map[string][]version, w *world, key string, token int64, at time.Time) *version {
	var last *version
	for i := range hist[key] {
		v := &hist[key][i]
		t, ok := w.timeOf(v.rev)
		if !ok || t.After(at) {
			break
		}
		if !v.deleted && int64(v.rec.Token) == token {
			last = v
		}
	}
	return last
}

// probe claims every key whose record the rules say is free (in flight past
// its deadline, under a session that ended, or abandoned) and gives it up
// at once: what the rules promise, tried. It runs as an actor of p, once
// the world settled.
func (w *world) probe(a *actor, p *process) {
	ctx := a.ctx
	for _, bad := range w.keysReachable(a) {
		w.log(event{kind: evProbe, body: "unreachable", err: bad})
	}
	live := w.liveOwners()
	for _, key := range w.keys() {
		if strings.HasPrefix(key, jobTenant+"/") {
			continue // jobs have their own drain
		}
		rctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		rec, err := w.liveRecord(rctx, storeKey(key))
		cancel()
		if errors.Is(err, etcdstore.ErrNotFound) && w.cfg.shards {
			// Free: a new operation can be claimed, wherever the set in
			// force puts it (and given up again, leaving it free).
			w.probeFree(a, p, key)
			continue
		}
		if err != nil || rec.State != etcdstore.InFlight {
			continue
		}
		why := ""
		now := p.clock.Now()
		switch {
		case rec.Owner == "":
			why = "abandoned"
		case !rec.Deadline.IsZero() && !now.Before(rec.Deadline):
			why = "past its deadline"
		case rec.Owner != "~deadline" && live[rec.Owner] == "":
			why = "its session ended"
		default:
			continue
		}
		var c *etcdstore.Claim
		for try := 0; try < 30; try++ {
			c, _, err = p.keys.Claim(ctx, storeKey(key), rec.Fingerprint, etcdstore.WithAttempt(w.nextAttempt()))
			if err == nil || !errors.Is(err, etcdstore.ErrUnavailable) {
				break
			}
			clock.Sleep(p.clock, ctx, time.Second) // its session being replaced, say
		}
		switch {
		case err != nil && (errors.Is(err, etcdstore.ErrConflict) || errors.Is(err, etcdstore.ErrUnavailable)):
			w.log(event{kind: evProbe, key: key, body: why, err: err.Error()})
		case c != nil:
			w.ledger.hit("path:liveness probe claimed a free key")
			w.log(event{kind: evGrant, key: key, token: int64(c.Token()), attempt: c.Attempt(), proc: p.name, actor: a.name, tookOver: c.TookOver(), via: "probe"})
			w.log(event{kind: evHoldEnd, key: key, token: int64(c.Token()), actor: a.name})
			c.Abandon(ctx)
		}
	}
}

// liveOwners returns the sessions alive in etcd, by owner id.
func (w *world) liveOwners() map[string]string {
	live := map[string]string{}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, ls := range w.leases {
		if ls.owner != "" {
			live[ls.owner] = fmt.Sprintf("lease %x", int64(ls.id))
		}
	}
	return live
}

// pendingWrites lists the final writes that live processes still retry in
// the background: once faults stop, each lands or is fenced out.
func (w *world) pendingWrites() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	pending := map[string]string{}
	for _, e := range w.events {
		switch e.kind {
		case evTaskStart:
			pending[e.task] = e.proc
		case evTaskDone:
			delete(pending, e.task)
		}
	}
	dead := map[string]bool{}
	for _, e := range w.events {
		if e.kind == evCrash || e.kind == evClose {
			dead[e.proc] = true
		}
	}
	var out []string
	for task, proc := range pending {
		if !dead[proc] {
			out = append(out, fmt.Sprintf("%s still retries its final write %s", proc, task))
		}
	}
	return out
}

// probeFree claims key, which has no live record anywhere, as a new
// operation, and releases it: in a shard world, on the shard the set in
// force puts it on, whatever Moved records older sets left.
func (w *world) probeFree(a *actor, p *process, key string) {
	fp := fingerprint(key, false)
	var c *etcdstore.Claim
	var err error
	for try := 0; try < 30; try++ {
		c, _, err = p.keys.Claim(a.ctx, storeKey(key), fp, etcdstore.WithAttempt(w.nextAttempt()))
		if err == nil || !errors.Is(err, etcdstore.ErrUnavailable) {
			break
		}
		clock.Sleep(p.clock, a.ctx, time.Second)
	}
	switch {
	case err != nil && !errors.Is(err, etcdstore.ErrMismatch) && !errors.Is(err, etcdstore.ErrConflict):
		w.log(event{kind: evProbe, key: key, body: "no record", err: err.Error()})
	case c != nil:
		w.ledger.hit("path:liveness probe claimed a free key")
		w.log(event{kind: evGrant, key: key, token: int64(c.Token()), attempt: c.Attempt(), proc: p.name, actor: a.name, via: "probe"})
		w.log(event{kind: evHoldEnd, key: key, token: int64(c.Token()), actor: a.name})
		c.Release(a.ctx)
	}
}

// replacedToken returns the token of the record the claim of token
// replaced (its key's version before the claim's first write), or 0.
func replacedToken(vs []version, token int64) int64 {
	for i, v := range vs {
		if !v.deleted && int64(v.rec.Token) == token {
			if i > 0 && !vs[i-1].deleted {
				return int64(vs[i-1].rec.Token)
			}
			return 0
		}
	}
	return 0
}
