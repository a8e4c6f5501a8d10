package explore

import (
	"google.golang.org/grpc/codes"

	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/storex"
)

// The invariants checked after every schedule (and liveness, checked when
// the faults stop: see heal):
//
//  1. No key's work has two live owners at once: whenever a claim is
//     granted, every other claim of the key still held by its worker has
//     provably lost its right to run: its session ended, or its deadline
//     passed, or its record expired (by the clock of the process that
//     took it over; across shards, of the one that wrote the Moved
//     record, which may be any). A claim recognised again by its attempt id is the
//     same claim.
//  2. An effect is applied at most once per key and step, unless a
//     takeover with a greater token happened: every later application of
//     a step comes from a claim that took the key over (by the record's
//     history in etcd), with a greater token than the one before. A
//     proxied request (the save policy) reaches the upstream at most once
//     per operation, takeovers included (2b).
//  3. A saved outcome is replayed byte for byte: every answer a caller
//     took as the operation's outcome is the key's one saved outcome.
//  4. A Complete is told the truth: a Complete answered with an error
//     saying its outcome was not saved (ErrClaimEnded, ErrFenced) did not
//     save it.
//  5. Checkpoints never go backwards: along a key's history in etcd, from
//     one claim to the next, the recovery point never decreases.
//  6. A graceful close loses no outcome: no process revokes its session
//     while a final write of its own is pending, before Close has waited
//     its bound (WithEndTimeout) for it.
//  11. A saved outcome stays readable for its whole retention: no done
//     record is deleted before its expiry (but by an eviction), and every
//     record an Admin that met no dictionary reads decodes.
//  12. The tokens of a key never go backwards, across epoch raises and
//     restores included: every claim of a key has a greater token than
//     every claim of it before.
//
// A restore loses what was written after its snapshot, by design: keys
// whose records a restore rolled back are exempt from 2, 3 and 5 (12 and
// liveness still hold for them).

type evKind int

const (
	evGrant        evKind = iota // a claim is held by a worker (or a proxied request)
	evHoldEnd                    // the worker no longer holds it
	evEffect                     // an effect reached the sink
	evResult                     // what a caller got
	evSessionEnd                 // a process's session ended
	evCrash                      // a process crashed
	evClose                      // a process was closed
	evTaskStart                  // a background write started
	evTaskDone                   // a background write finished
	evClock                      // the simulated clock moved
	evEpoch                      // the shard epoch was raised
	evSnapshot                   // the prefix was saved
	evRestore                    // and restored
	evUnreadable                 // an audit found a record it cannot read
	evNotSaved                   // a Complete answered that its outcome was not saved
	evSessionLost                // a process noticed its session was lost (it logged so)
	evReaped                     // a process's reaper abandoned a claim (it logged so)
	evNotSent                    // a claim failed with ErrNotSent: it never left the process
	evProbe                      // liveness: a key free by the rules was claimed, or refused
	evWriteNotSent               // a claim's write (checkpoint, complete, abandon) failed with ErrNotSent
	evCloseStart                 // a store began to close (it logged so)
	evCloseLoses                 // a closing store gave a final write up (it logged so)
	evEvict                      // an operator evicted a done record through a process
)

var kindNames = map[evKind]string{evGrant: "grant", evHoldEnd: "hold-end", evEffect: "effect", evResult: "result",
	evSessionEnd: "session-end", evCrash: "crash", evClose: "close", evTaskStart: "task", evTaskDone: "task-done", evClock: "clock",
	evEpoch: "epoch", evSnapshot: "snapshot", evRestore: "restore", evUnreadable: "unreadable", evNotSaved: "not-saved",
	evSessionLost: "session-lost", evReaped: "reaped", evNotSent: "not-sent", evProbe: "probe", evWriteNotSent: "write-not-sent",
	evCloseStart: "close-start", evCloseLoses: "close-loses", evEvict: "evict"}

type event struct {
	seq  int
	at   time.Time
	kind evKind

	key, attempt, proc, actor, owner, via, task string
	token                                       int64
	step                                        int // effects: the step; grants: the inherited checkpoint
	accepted, tookOver, replayed, mismatch      bool
	heeds                                       bool // effects: the actor checked its claim just before
	// deadlineOnly: effects of an actor that heeds only its claim's
	// deadline (idemgrpc ends a handler's context before it; a lost
	// session does not end it: the handler runs to its end).
	deadlineOnly bool
	status       int
	body, err    string
	sent         time.Time // results: when the request that got this answer was sent
	from, to     int64     // not-sent writes: the world's latest write when the call began and ended
}

func (e event) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s", kindNames[e.kind])
	add := func(k string, v any) {
		if s := fmt.Sprint(v); s != "" && s != "0" && s != "false" {
			fmt.Fprintf(&b, " %s=%s", k, s)
		}
	}
	add("key", e.key)
	add("token", e.token)
	add("attempt", e.attempt)
	add("proc", e.proc)
	add("actor", e.actor)
	add("owner", e.owner)
	add("via", e.via)
	add("task", e.task)
	add("step", e.step)
	add("accepted", e.accepted)
	add("heeds", e.heeds)
	add("deadlineOnly", e.deadlineOnly)
	add("tookOver", e.tookOver)
	add("status", e.status)
	add("replayed", e.replayed)
	if e.body != "" {
		fmt.Fprintf(&b, " body=%.60q", e.body)
	}
	add("err", e.err)
	return b.String()
}

// sink is the downstream system the work acts on: it refuses an effect
// whose token is lower than the highest it has seen for the key, as a
// fencing.Checker does.
type sink struct {
	mu      sync.Mutex
	highest map[string]int64
}

func newSink() *sink { return &sink{highest: make(map[string]int64)} }

func (s *sink) apply(key string, step int, token int64, who string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if token < s.highest[key] {
		return false
	}
	s.highest[key] = token
	return true
}

// version is one write of a record, from etcd's history.
type version struct {
	rev     int64
	ekey    string // its etcd key
	dict    uint32 // the dictionary it is compressed against (0: none)
	lease   int64  // its lease
	deleted bool
	rec     *etcdstore.Record
	shard   string // in a shard world, where it was written
	// afterMoved: a Moved record of the key was written since its
	// previous version (whoever wrote it judged that version expired).
	afterMoved bool
}

// history returns every write of records under the schedule's prefix
// since it started, from the world's feed.
func (w *world) history(ctx context.Context) (map[string][]version, error) {
	// A sentinel write marks the end: the feed has everything before it
	// once it has caught up with it.
	end, err := w.admin.Put(ctx, w.prefix+"zz-end", "")
	if err != nil {
		return nil, err
	}
	if err := w.feed.catchUp(end.Header.Revision); err != nil {
		return nil, err
	}
	w.histEnd = end.Header.Revision
	out := make(map[string][]version)
	// In a shard world, a key's history is merged across the shards: the
	// record it has is the one last written on the shard that holds it
	// (Moved records say where it is not, and a delete on a shard that no
	// longer holds it deletes nothing of the key's).
	holder := map[string]string{}
	moved := map[string]bool{} // keys a Moved record was written for since their last version
	w.copies = dictCopies{}
	for _, ev := range w.feed.since(w.start+1, end.Header.Revision) {
		k := string(ev.Kv.Key)
		shardName, _, _ := w.shardOf(k)
		rest, ok := w.storeRest(k)
		if !ok {
			continue
		}
		if d, ok := strings.CutPrefix(rest, "z/"); ok && ev.Type == mvccpb.DELETE && strings.Count(d, "/") == 1 {
			w.ledger.hit("path:dictionary copy deleted with its lease")
		}
		w.copies.note(shardName, rest, ev)
		id, ok := strings.CutPrefix(rest, "k/default/")
		if !ok {
			if id, ok = strings.CutPrefix(rest, "k/"+jobTenant+"/"); !ok {
				continue
			}
			id = jobKey(id)
		}
		v := version{rev: ev.Kv.ModRevision, ekey: k, deleted: ev.Type == mvccpb.DELETE, shard: shardName, lease: ev.Kv.Lease}
		if !v.deleted {
			v.dict, _ = dictOf(ev.Kv.Value)
		}
		if !v.deleted {
			rec, err := w.decodeRecord(ev.Kv)
			if err != nil {
				return nil, fmt.Errorf("key %s at revision %d: %w", id, ev.Kv.ModRevision, err)
			}
			if rec.State == etcdstore.Moved {
				w.ledger.hit("path:key handed over (Moved)")
				moved[id] = true
				if holder[id] == shardName {
					holder[id] = "" // it left this shard: nobody holds a record of it
				}
				continue
			}
			v.rec = rec
			v.afterMoved, moved[id] = moved[id], false
			if len(ev.Kv.Value) > 2 && ev.Kv.Value[0] == 3 && ev.Kv.Value[2] != 0 {
				w.ledger.hit("path:record compressed against a dictionary")
			}
			if h, ok := holder[id]; ok && h != shardName {
				w.ledger.hit("path:key claimed on another shard")
			}
			holder[id] = shardName
		} else if h, ok := holder[id]; w.cfg.shards && (!ok || h != shardName) {
			continue // a Moved record's end, or a record of a shard that no longer holds the key
		}
		out[id] = append(out[id], v)
	}
	return out, nil
}

// tokenRev is the revision part of a token.
func tokenRev(t int64) int64 { return t & (1<<storex.EpochShift - 1) }

// check returns every invariant violation of the schedule.
func (w *world) check(hist map[string][]version, final map[string]*etcdstore.Record) []string {
	bad := slices.Clone(w.broken)
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }

	// Restores: the versions a restore wrote, and the keys it rolled back.
	restored := func(rev int64) bool {
		for _, r := range w.restores {
			if r.done && rev > r.from && rev <= r.to {
				return true
			}
		}
		return false
	}
	if key := os.Getenv("IDEM_EXPLORE_HIST"); key != "" {
		for _, v := range hist[key] {
			at, _ := w.timeOf(v.rev)
			if v.rec == nil {
				fmt.Printf("hist %s rev %d at %s deleted (shard %q)\n", key, v.rev, at.Format("01-02 15:04:05.000"), v.shard)
				continue
			}
			r := v.rec
			fmt.Printf("hist %s rev %d at %s token %d %v owner %q deadline %s expires %s checkpoint %q fence %v shard %q\n", key, v.rev, at.Format("01-02 15:04:05.000"),
				r.Token, r.State, r.Owner, r.Deadline.Format("01-02 15:04:05.000"), r.Expires.Format("01-02 15:04:05.000"), r.Checkpoint, r.Fence, v.shard)
		}
	}
	rolledBack := map[string]bool{}
	for key, vs := range hist {
		for _, v := range vs {
			for _, r := range w.restores {
				if r.done && v.rev > r.rev && v.rev <= r.from {
					rolledBack[key] = true
				}
			}
		}
	}

	// What history says of each claim (by token): how it was made, and the
	// latest deadline any of its writes set.
	type claimWrite struct {
		key      string
		takeover bool
		renewed  bool // the key's retention had passed: a new operation
		owner    string
		deadline time.Time
	}
	// expiredAt reports whether r's retention had passed at revision rev
	// (on a clock up to 3 s ahead: the processes' skew).
	expiredAt := func(r *etcdstore.Record, rev int64) bool {
		at, ok := w.timeOf(rev)
		return ok && !at.Add(3*time.Second).Before(r.Expires)
	}
	// A claim is its key and token: the claims of one batch share a
	// revision, so a token alone names several.
	type claimID struct {
		key   string
		token int64
	}
	claims := map[claimID]*claimWrite{}
	opStarts := map[string][]int64{} // per key, the tokens of claims that began a new operation
	for key, vs := range hist {
		var prev *version    // the key's record before this version; nil: none
		var deleted *version // the record a deletion removed, while the key has none
		high := int64(0)     // the greatest token of the key so far
		for i := range vs {
			v := &vs[i]
			if v.deleted {
				if prev != nil {
					deleted = &version{rev: v.rev, rec: prev.rec}
					// 18. Every delete by its rule.
					if !restored(v.rev) && !rolledBack[key] {
						if why := w.checkDelete(key, v.ekey, v.rev, prev.rec, w.maxSkew()); why != "" {
							fail("%s", why)
						}
					}
				}
				prev = nil
				continue
			}
			r := v.rec
			if restored(v.rev) {
				high = max(high, int64(r.Token))
				prev = v
				continue
			}
			if tokenRev(int64(r.Token)) == v.rev { // a claim or a takeover writes its own revision
				cw := &claimWrite{key: key, owner: r.Owner}
				switch {
				case r.Fence:
					w.ledger.hit("state:fence")
				case prev != nil && prev.rec.Fence:
					// A fence left the key free: this is its operation's
					// first claim.
				case prev != nil && prev.rec.State == etcdstore.InFlight &&
					(!expiredAt(prev.rec, v.rev) || r.Created.Equal(prev.rec.Created) && r.Takeovers == prev.rec.Takeovers+1):
					// A takeover: the record was not expired, or, within
					// the clocks' skew of its expiry, the claimant judged it
					// not expired and carried its checkpoint over (a
					// takeover keeps the operation's creation time and
					// counts itself).
					cw.takeover = true
				case prev != nil:
					cw.renewed = expiredAt(prev.rec, v.rev)
				case deleted != nil:
					// Deleted at its expiry (swept, its lease expired), or
					// released by its claim before.
					cw.renewed = deleted.rec.State == etcdstore.Done || expiredAt(deleted.rec, deleted.rev)
				}
				claims[claimID{key, int64(r.Token)}] = cw
				if !cw.takeover && (cw.renewed || prev == nil && deleted == nil || prev != nil && prev.rec.Fence) {
					opStarts[key] = append(opStarts[key], int64(r.Token))
				}
				// 12. Tokens only grow.
				if int64(r.Token) <= high {
					fail("%s: token went back: claim at revision %d has token %d, after token %d", key, v.rev, r.Token, high)
				}
				w.claimPaths(prev, v)
			} else if !rolledBack[key] && (prev == nil || prev.rec.Token != r.Token || prev.rec.Fence) {
				// 19. A claim's later write (a checkpoint, a renewal, an
				// abandon, a complete) lands only on its own record.
				fail("%s: a write of the claim with token %d landed at revision %d on %s", key, r.Token, v.rev, describeVersion(prev))
			}
			high = max(high, int64(r.Token))
			deleted = nil
			if cw := claims[claimID{key, int64(r.Token)}]; cw != nil && r.Deadline.After(cw.deadline) {
				cw.deadline = r.Deadline
			}
			switch {
			case r.State == etcdstore.Done:
				w.ledger.hit("state:done")
			case r.State == etcdstore.InFlight && r.Owner == "":
				w.ledger.hit("state:abandoned")
			case r.State == etcdstore.InFlight && r.Owner == "~deadline":
				w.ledger.hit("state:in flight without a session")
			}
			prev = v
		}
	}

	// 1. Two live owners.
	ended := map[string]int{} // session owner -> seq it ended at
	for _, e := range w.events {
		if e.kind == evSessionEnd && e.owner != "" {
			if _, ok := ended[e.owner]; !ok {
				ended[e.owner] = e.seq
			}
		}
	}
	type hold struct {
		grant event
		until int // seq of the hold's end; 0 while held
	}
	var holds []*hold
	byActor := map[string]*hold{}
	pendingFinish := map[string]int{} // "key token" -> seq a background final write finished
	for _, e := range w.events {
		// A complete retried in the background: the outcome exists only in
		// its process, which still holds the key. (An abandon or a release
		// retried there gives the key up.)
		if e.kind == evTaskDone && strings.HasPrefix(e.task, "complete ") {
			pendingFinish[strings.TrimPrefix(e.task, "complete ")] = e.seq
		}
	}
	// replaced returns the record version a claim write at rev replaced:
	// the key's last version before it (nil when none, or a deletion).
	replaced := func(key string, rev int64) *etcdstore.Record {
		var prev *version
		for i := range hist[key] {
			if hist[key][i].rev >= rev {
				break
			}
			prev = &hist[key][i]
		}
		if prev == nil || prev.deleted {
			return nil
		}
		return prev.rec
	}
	skewOf := map[string]time.Duration{}
	ahead := time.Duration(0) // the clock most ahead of true time
	for i, sk := range w.cfg.skew {
		skewOf[fmt.Sprintf("p%d", i)] = sk
		ahead = max(ahead, sk)
	}
	// crossShard reports whether the claim write at rev is on another
	// shard than the record it replaced, or replaced a Moved record
	// written over it: the key was handed over, and whether the old
	// record had expired was judged by the process that wrote the Moved
	// record, whichever it was.
	crossShard := func(key string, rev int64) bool {
		var prev, at *version
		for i := range hist[key] {
			v := &hist[key][i]
			if v.rev == rev {
				at = v
				break
			}
			prev = v
		}
		return at != nil && prev != nil && (prev.shard != at.shard || at.afterMoved)
	}
	for _, e := range w.events {
		switch e.kind {
		case evCrash:
			// The process's own actors stopped with it.
			for _, h := range holds {
				if h.until == 0 && h.grant.proc == e.proc && h.grant.via != "api" && h.grant.via != "proxy" && h.grant.via != "grpc" {
					h.until = e.seq
				}
			}
		case evGrant:
			if rolledBack[e.key] {
				break
			}
			// The claim this grant took the key from, if any: the one whose
			// record its claim write replaced. A record deleted before it
			// was released by its own claim (only Release deletes here).
			if cw := claims[claimID{e.key, e.token}]; cw != nil {
				rev := tokenRev(e.token)
				if prev := replaced(e.key, rev); prev != nil && prev.Token != fencingToken(e.token) {
					for _, h := range holds {
						if h.grant.key != e.key || h.grant.token != int64(prev.Token) {
							continue
						}
						held := h.until == 0 || h.until > e.seq
						if done, ok := pendingFinish[fmt.Sprintf("%s %d", storeKey(h.grant.key), h.grant.token)]; ok && done > e.seq {
							held = true
						}
						sessionEnded := false
						if c := claims[claimID{h.grant.key, h.grant.token}]; c != nil {
							if s, ok := ended[c.owner]; ok && s < e.seq {
								sessionEnded = true
							}
						}
						// The claim's deadline as its last write before the
						// takeover set it. When that write is an abandon (which
						// clears it: the store's reaper abandons, on its behalf,
						// a claim of this process whose deadline passed), the one
						// its last write before the abandon set.
						dl := prev.Deadline
						if prev.Owner == "" {
							for _, v := range hist[e.key] {
								if v.rev >= prev.Revision {
									break
								}
								if !v.deleted && v.rec.Token == prev.Token && v.rec.Owner != "" {
									dl = v.rec.Deadline
								}
							}
						}
						takerNow := e.at.Add(skewOf[procSlot(e.proc)])
						judge := takerNow
						if crossShard(e.key, rev) {
							judge = e.at.Add(ahead)
						}
						if prev.State == etcdstore.Done {
							// Its work ended with its outcome saved; a final
							// write of it still pending (its reply was lost)
							// is fenced. Only an expired outcome may be
							// claimed again.
							if judge.Before(prev.Expires) {
								fail("%s claimed again over its saved outcome (token %d) before its expiry %v: token %d (%s) at %d (clock %v)",
									e.key, prev.Token, prev.Expires.Format("15:04:05.000"), e.token, e.actor, e.seq, judge.Format("15:04:05.000"))
							}
							continue
						}
						// A claim's record expiring ends it too (Claim.Err).
						pastDeadline := (!dl.IsZero() && !judge.Before(dl)) || !judge.Before(prev.Expires)
						if held && !sessionEnded && !pastDeadline {
							fail("two live owners of %s: token %d (%s, granted at %d; record owner %q, deadline %v) still held, its session live and its deadline not passed, when token %d (%s) took the key over at %d (clock %v)",
								e.key, h.grant.token, h.grant.actor, h.grant.seq, prev.Owner, prev.Deadline.Format("15:04:05.000"), e.token, e.actor, e.seq, takerNow.Format("15:04:05.000"))
						}
					}
				}
			}
			h := &hold{grant: e}
			holds = append(holds, h)
			byActor[e.actor+"/"+e.key] = h
		case evHoldEnd:
			if h := byActor[e.actor+"/"+e.key]; h != nil && h.until == 0 {
				h.until = e.seq
			}
		}
	}

	// 4. A Complete is told the truth: one answered "not saved" (ended,
	// or completed with another outcome) did not save its outcome.
	for _, e := range w.events {
		if e.kind != evNotSaved || rolledBack[e.key] {
			continue
		}
		vs := hist[e.key]
		for i, v := range vs {
			if !v.deleted && v.rec.State == etcdstore.Done && int64(v.rec.Token) == e.token && v.rec.Outcome.Body != nil &&
				string(v.rec.Outcome.Body) == e.body {
				if i+1 < len(vs) {
					if at, ok := w.timeOf(vs[i+1].rev); ok && !at.After(e.at) {
						break // expired and replaced before the answer: no longer the key's outcome
					}
				}
				if !e.at.Add(skewOf[procSlot(e.proc)]).Before(v.rec.Expires) {
					// Expired by the answering process's clock: the key no
					// longer names the operation, and the answer ("not
					// yours") can only be told from what etcd holds.
					break
				}
				fail("%s: the Complete of token %d was answered %q at %d, but its outcome was saved (revision %d)", e.key, e.token, e.err, e.seq, v.rev)
				break
			}
		}
	}

	// 2. Effects.
	type app struct {
		token int64
		seq   int
	}
	applied := map[string][]app{}
	// opOf is the token of the claim that began the operation token
	// belongs to: the key's retention passed before it.
	opOf := func(key string, token int64) int64 {
		start := int64(0)
		for _, t := range opStarts[key] {
			if t <= token {
				start = max(start, t)
			}
		}
		return start
	}
	for _, e := range w.events {
		if e.kind != evEffect || !e.accepted || rolledBack[e.key] {
			continue
		}
		ks := fmt.Sprintf("%s step %d", e.key, e.step)
		op := opOf(e.key, e.token)
		var prev []app
		for _, a := range applied[ks] {
			if a.token >= op {
				prev = append(prev, a) // the same operation's
			}
		}
		if len(prev) > 0 {
			last := prev[len(prev)-1]
			cw := claims[claimID{e.key, e.token}]
			switch {
			case e.token <= last.token:
				fail("%s applied twice under token %d (at %d and %d)", ks, e.token, last.seq, e.seq)
			case e.via == "proxy":
				// 2b. Under the save policy a proxied request reaches the
				// upstream once per operation: the takeover of a claim
				// whose attempt may have reached it (its process died
				// mid-forward, or lost its session or deadline) answers
				// the unknown outcome, never forwards again (issue 38).
				fail("%s reached the upstream again at %d under token %d (the first, token %d, at %d), its retention not passed: a proxied request forwarded twice under the save policy",
					ks, e.seq, e.token, last.token, last.seq)
			case cw == nil || !cw.takeover && !cw.renewed:
				fail("%s applied again at %d by token %d, which did not take the key over (the first, token %d, at %d), its retention not passed: a re-run after a release or loss", ks, e.seq, e.token, last.token, last.seq)
			}
		}
		applied[ks] = append(applied[ks], app{e.token, e.seq})
	}

	// 3. Outcomes.
	for _, e := range w.events {
		if e.kind != evResult || e.err != "" || e.mismatch || rolledBack[e.key] {
			continue
		}
		if e.via == "proxy" && (e.status == 0 || e.status == 409 || e.status == 429 || e.status == 503 ||
			e.status == 502 && strings.Contains(e.body, "upstream-unavailable")) {
			continue // not an outcome: the client retries
		}
		if e.via == "grpc" && (codes.Code(e.status) == codes.Aborted || codes.Code(e.status) == codes.Unavailable) {
			continue // not an outcome: the client retries (NotExecuted released the key too)
		}
		// An answer may be any outcome the key held while the request
		// was out (one saved before it was sent may have expired, and a
		// new operation saved another, by the time the answer arrived).
		matched := false
		for _, r := range w.outcomesDuring(hist[e.key], e) {
			matched = matched || answers(e, r)
		}
		if matched {
			continue
		}
		rec := w.outcomeAt(hist[e.key], e, final[e.key])
		switch {
		case rec == nil || rec.State != etcdstore.Done:
			fail("%s answered %q at %d, but the key's final record is %v", e.key, e.body, e.seq, describe(rec))
		case e.via == "proxy" && (e.status != rec.Outcome.Status || e.body != string(rec.Outcome.Body)):
			fail("%s answered %d %q at %d (clock %s); saved %d %q (token %d)", e.key, e.status, e.body, e.seq, e.at.Format("01-02 15:04:05.000"), rec.Outcome.Status, rec.Outcome.Body, rec.Token)
		case e.via == "grpc":
			if c, body := grpcAnswer(rec.Outcome); codes.Code(e.status) != c || e.body != body {
				fail("%s answered %v %q at %d; saved %v %q", e.key, codes.Code(e.status), e.body, e.seq, c, body)
			}
		case e.via != "proxy" && e.body != string(rec.Outcome.Body):
			fail("%s answered %q at %d; saved %q", e.key, e.body, e.seq, rec.Outcome.Body)
		}
	}
	for _, e := range w.waits {
		if rolledBack[e.key] {
			continue
		}
		found := false
		for _, v := range hist[e.key] {
			found = found || !v.deleted && v.rec.State == etcdstore.Done && string(v.rec.Outcome.Body) == e.body
		}
		if !found {
			fail("Wait on %s returned done %q, which the key never saved", e.key, e.body)
		}
	}

	// 5. Checkpoints (a job's progress is checked as 9).
	for key, vs := range hist {
		if strings.HasPrefix(key, jobTenant+"/") || rolledBack[key] {
			continue
		}
		high := 0
		var token fencing.Token // of the version before
		for _, v := range vs {
			if v.deleted || slices.Contains(opStarts[key], int64(v.rec.Token)) {
				high = 0 // released, or a new operation: its retention passed
			}
			if !v.deleted && v.rec.Token != token && v.rec.Takeovers == 0 {
				// A claim that took nothing over: a new operation, whoever
				// made it (a reaper's fence over an expired record is one no
				// actor saw granted). A takeover always counts one more.
				high = 0
			}
			if !v.deleted {
				token = v.rec.Token
			}
			if v.deleted || v.rec.State != etcdstore.InFlight {
				continue
			}
			n := lastStep(v.rec.Checkpoint)
			if n < high {
				fail("%s: checkpoint went back from %d to %d at revision %d (token %d)", key, high, n, v.rev, v.rec.Token)
			}
			high = max(high, n)
		}
	}

	// 6. Closes.
	started := map[string]string{} // task -> process, for final writes not finished
	closedAt := map[string]event{} // the session a close began under -> its close
	lost := map[string]bool{}      // sessions their process judged lost: revoking one is its cleanup, not the close's
	for _, e := range w.events {
		switch {
		case e.kind == evSessionLost:
			lost[e.owner] = true
		case e.kind == evTaskStart:
			started[e.task] = e.proc
		case e.kind == evTaskDone:
			delete(started, e.task)
		case e.kind == evClose && e.owner != "":
			closedAt[e.owner] = e
		case e.kind == evSessionEnd && strings.HasPrefix(e.body, "revoked by "):
			proc := strings.TrimPrefix(e.body, "revoked by ")
			c, closing := closedAt[e.owner] // the session Close revokes, not one lost before
			if !closing || lost[e.owner] || c.proc != proc || e.at.Sub(c.at) >= etcdstore.DefaultEndTimeout {
				continue
			}
			at := c.at
			for task, p := range started {
				if c.task != "" && !strings.HasSuffix(task, " on shard "+c.task) {
					continue // another shard's store, closed after this one
				}
				if p == proc {
					fail("%s revoked its session at %d, %v into its close, with a final write still pending: %s", proc, e.seq, e.at.Sub(at), task)
				}
			}
		}
	}

	// 20. A graceful close flushes: a store gives a pending final write up
	// (its outcome lost, its key taken over later) only once it has
	// waited its bound (WithEndTimeout) for it.
	closing := map[string]time.Time{} // process -> when its store began to close
	for _, e := range w.events {
		switch e.kind {
		case evCloseStart:
			if _, ok := closing[e.proc]; !ok {
				closing[e.proc] = e.at
			}
		case evCloseLoses:
			if began, ok := closing[e.proc]; !ok || e.at.Sub(began) < etcdstore.DefaultEndTimeout {
				fail("%s gave a final write up at %d (%s), %v into its close, before its bound %v", e.proc, e.seq, e.body,
					e.at.Sub(began), etcdstore.DefaultEndTimeout)
			}
		}
	}

	// 11. Readable outcomes, kept for their retention.
	for _, e := range w.events {
		if e.kind == evUnreadable {
			fail("a saved outcome cannot be read (at %d): %s", e.seq, e.body)
		}
	}
	for key, vs := range hist {
		for i := 1; i < len(vs); i++ {
			prev, v := vs[i-1], vs[i]
			if !v.deleted || prev.deleted || prev.rec.State != etcdstore.Done || restored(v.rev) {
				continue
			}
			if d, ok := w.deleterAt(v.rev, v.ekey); ok && d.class == "evict" {
				continue // an operator's eviction: the one way to forget early
			}
			if at, ok := w.timeOf(v.rev); ok && at.Add(3*time.Second).Before(prev.rec.Expires) {
				fail("%s: its done record (token %d) was deleted at revision %d, at %v, before its retention ended at %v",
					key, prev.rec.Token, v.rev, at.Format("15:04:05.000"), prev.rec.Expires.Format("15:04:05.000"))
			}
		}
	}

	bad = append(bad, w.checkDicts(hist)...)
	bad = append(bad, w.checkJobs(hist, final, rolledBack, opStarts)...)
	bad = append(bad, w.checkSchedule(hist)...)
	bad = append(bad, w.checkWaits(hist, final)...)
	bad = append(bad, w.checkLimits(hist, w.histEnd)...)
	bad = append(bad, w.checkKnown(hist, func(key string, token int64) (claimInfo, bool) {
		cw := claims[claimID{key, token}]
		if cw == nil {
			return claimInfo{}, false
		}
		return claimInfo{owner: cw.owner, deadline: cw.deadline}, true
	}, rolledBack, func(proc string) time.Duration { return skewOf[procSlot(proc)] })...)
	sort.Strings(bad)
	return bad
}

// procSlot is the slot of a process incarnation's name ("p1.2": "p1").
func procSlot(name string) string {
	if i := strings.IndexByte(name, '.'); i >= 0 {
		return name[:i]
	}
	return name
}

func fencingToken(t int64) fencing.Token { return fencing.Token(t) }

// claimPaths notes in the ledger what a claim write replaced.
func (w *world) claimPaths(prev, v *version) {
	if prev == nil || prev.rec.State != etcdstore.InFlight {
		if prev != nil && prev.rec.State == etcdstore.Done {
			w.ledger.hit("state:expired and claimed again")
		}
		return
	}
	w.ledger.hit("path:takeover")
	p, r := prev.rec, v.rec
	if p.Epoch < r.Epoch {
		w.ledger.hit("path:takeover after an epoch raise")
	}
	at, ok := w.timeOf(v.rev)
	switch {
	case p.Owner == "":
	case !p.Deadline.IsZero() && ok && !at.Before(p.Deadline.Add(-3*time.Second)):
		w.ledger.hit("path:takeover past a deadline")
	case p.Owner != "~deadline":
		w.ledger.hit("path:takeover of a dead session's claim")
	}
}

// outcomeAt returns the key's saved outcome an answer at e must be: the
// latest done record saved before the answer (the key may have been
// claimed again since, after its retention), or the final one. An
// outcome an operator evicted is no longer the key's: an answer after the
// eviction is one saved since (outcomesDuring allows a replay cache its
// bound).
func (w *world) outcomeAt(vs []version, e event, final *etcdstore.Record) *etcdstore.Record {
	var at *etcdstore.Record
	for _, v := range vs {
		t, ok := w.timeOf(v.rev)
		if !ok || t.After(e.at) {
			break
		}
		if !v.deleted && v.rec.State == etcdstore.Done {
			at = v.rec
		}
		if d, ok := w.deleterAt(v.rev, v.ekey); v.deleted && ok && d.class == "evict" {
			at = nil
		}
	}
	if at == nil {
		return final
	}
	return at
}

// outcomesDuring returns the key's saved outcomes that were current at
// some time while e's request was out: from when it was sent (or e itself)
// to e.
func (w *world) outcomesDuring(vs []version, e event) []*etcdstore.Record {
	sent := e.sent
	if sent.IsZero() {
		sent = e.at
	}
	// A process with the replay cache may answer from a record replaced
	// up to its staleness bound before the request (cache.go): that is
	// its contract, bounded staleness. (Strict linearizability of cached
	// replays is issue 37's.)
	sent = sent.Add(-w.staleness(e))
	// But a store forgets at once what it evicted itself (Store.Evict,
	// EvictIf): a request it serves after its own eviction returned never
	// replays the record evicted.
	if t, ok := w.evictedBefore(e); ok && !t.Before(sent) {
		sent = t.Add(time.Nanosecond)
	}
	var out []*etcdstore.Record
	for i, v := range vs {
		t, ok := w.timeOf(v.rev)
		if !ok || t.After(e.at) {
			break
		}
		if v.deleted || v.rec.State != etcdstore.Done {
			continue
		}
		if i+1 < len(vs) {
			if until, ok := w.timeOf(vs[i+1].rev); ok && until.Before(sent) {
				continue // replaced before the request was sent
			}
		}
		out = append(out, v.rec)
	}
	return out
}

// staleness is how far behind etcd the process that answered e may be:
// the cache's bound where it has the cache (where e does not name its
// process, any process's), else none.
func (w *world) staleness(e event) time.Duration {
	for slot, cached := range w.cfg.cache {
		if cached && (e.proc == "" || procSlot(e.proc) == fmt.Sprintf("p%d", slot)) {
			return etcdstore.DefaultCacheStaleness
		}
	}
	return 0
}

// evictedBefore returns when the process that answered e last evicted
// e's key before e's request was sent, if it did.
func (w *world) evictedBefore(e event) (time.Time, bool) {
	if e.proc == "" {
		return time.Time{}, false
	}
	var at time.Time
	found := false
	for _, ev := range w.events {
		if ev.seq >= e.seq || ev.at.After(e.sent) {
			break
		}
		if ev.kind == evEvict && ev.proc == e.proc && ev.key == e.key {
			at, found = ev.at, true
		}
	}
	return at, found
}

// answers reports whether e's answer is rec's outcome.
func answers(e event, rec *etcdstore.Record) bool {
	switch e.via {
	case "proxy":
		return e.status == rec.Outcome.Status && e.body == string(rec.Outcome.Body)
	case "grpc":
		c, body := grpcAnswer(rec.Outcome)
		return codes.Code(e.status) == c && e.body == body
	}
	return e.body == string(rec.Outcome.Body)
}

func describe(r *etcdstore.Record) string {
	if r == nil {
		return "absent"
	}
	if r.State == etcdstore.Done {
		return fmt.Sprintf("done %q (token %d)", r.Outcome.Body, r.Token)
	}
	return fmt.Sprintf("in flight (token %d, owner %q)", r.Token, r.Owner)
}

// describeVersion names the version a write replaced.
func describeVersion(v *version) string {
	if v == nil {
		return "no record"
	}
	return fmt.Sprintf("the record of token %d (%s)", v.rec.Token, describe(v.rec))
}

// maxSkew is the largest clock skew of the world's processes ahead of true
// time (at least the 3 s the schedule worlds allow).
func (w *world) maxSkew() time.Duration {
	m := 3 * time.Second
	for _, sk := range w.cfg.skew {
		m = max(m, sk)
	}
	return m
}

// restoredAt reports whether the write at rev is a restore's (it put back
// what a snapshot held).
func (w *world) restoredAt(rev int64) bool {
	for _, r := range w.restores {
		if r.done && rev > r.from && rev <= r.to {
			return true
		}
	}
	return false
}
