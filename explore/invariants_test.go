package explore

import (
	"google.golang.org/grpc/codes"

	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// The invariants checked after every schedule:
//
//  1. No key's work has two live owners at once: whenever a claim is
//     granted, every other claim of the key still held by its worker has
//     provably lost its right to run: its session ended, or its deadline
//     passed. (A claim recognised again by its attempt id is the same
//     claim.)
//  2. An effect is applied at most once per key and step, unless a
//     takeover with a greater token happened: every later application of
//     a step comes from a claim that took the key over (by the record's
//     history in etcd), with a greater token than the one before, and the
//     earlier owner was provably fenced (1).
//  3. A saved outcome is replayed byte for byte: every answer a caller
//     took as the operation's outcome is the key's one saved outcome.
//  4. No key stays in flight owned by a live process that no longer runs
//     it: once every actor is done and every background write settled,
//     no in-flight record belongs to a live session.
//  5. Checkpoints never go backwards: along a key's history in etcd, from
//     one claim to the next, the recovery point never decreases.
//  6. A graceful close loses no outcome: every Complete a process was
//     retrying in the background has landed (or been refused) before the
//     close revokes its session.

type evKind int

const (
	evGrant      evKind = iota // a claim is held by a worker (or a proxied request)
	evHoldEnd                  // the worker no longer holds it
	evEffect                   // an effect reached the sink
	evResult                   // what a caller got
	evSessionEnd               // a process's session ended
	evCrash                    // a process crashed
	evClose                    // a process was closed
	evTaskStart                // a background write started
	evTaskDone                 // a background write finished
	evClock                    // the simulated clock moved
)

var kindNames = map[evKind]string{evGrant: "grant", evHoldEnd: "hold-end", evEffect: "effect", evResult: "result",
	evSessionEnd: "session-end", evCrash: "crash", evClose: "close", evTaskStart: "task", evTaskDone: "task-done", evClock: "clock"}

type event struct {
	seq  int
	at   time.Time
	kind evKind

	key, attempt, proc, actor, owner, via, task string
	token                                       int64
	step                                        int // effects: the step; grants: the inherited checkpoint
	accepted, tookOver, replayed, mismatch      bool
	status                                      int
	body, err                                   string
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
	deleted bool
	rec     *etcdstore.Record
}

// watchHistory starts collecting every write under the schedule's prefix.
// A watch opened at the current revision is delivered at once (one that
// starts in the past is caught up by etcd only every 100 ms).
func (w *world) watchHistory() {
	ctx, cancel := context.WithCancel(context.Background())
	w.stopHist = cancel
	w.hist = make(chan clientv3.WatchResponse, 1024)
	wch := w.admin.Watch(ctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(w.start+1))
	go func() {
		defer close(w.hist)
		for wr := range wch {
			w.hist <- wr
		}
	}()
}

// history returns every write under the schedule's prefix since it started.
func (w *world) history(ctx context.Context) (map[string][]version, error) {
	defer w.stopHist()
	// A sentinel write marks the end: the watch has delivered everything
	// before it once it delivers the sentinel.
	end := w.prefix + "zz-end"
	if _, err := w.admin.Put(ctx, end, ""); err != nil {
		return nil, err
	}
	out := make(map[string][]version)
	records := w.prefix + "k/default/"
	jobRecords := w.prefix + "k/" + jobTenant + "/"
	for {
		var wr clientv3.WatchResponse
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case r, ok := <-w.hist:
			if !ok {
				return nil, fmt.Errorf("history watch ended")
			}
			wr = r
		}
		if err := wr.Err(); err != nil {
			return nil, err
		}
		for _, ev := range wr.Events {
			k := string(ev.Kv.Key)
			if k == end {
				return out, nil
			}
			id, ok := strings.CutPrefix(k, records)
			if !ok {
				if id, ok = strings.CutPrefix(k, jobRecords); !ok {
					continue
				}
				id = jobKey(id)
			}
			v := version{rev: ev.Kv.ModRevision, deleted: ev.Type == mvccpb.DELETE}
			if !v.deleted {
				rec, err := w.decoder.DecodeRecord(ev.Kv)
				if err != nil {
					return nil, fmt.Errorf("key %s at revision %d: %w", id, ev.Kv.ModRevision, err)
				}
				v.rec = rec
			}
			out[id] = append(out[id], v)
		}
	}
}

// check returns every invariant violation of the schedule.
func (w *world) check(hist map[string][]version, final map[string]*etcdstore.Record) []string {
	var bad []string
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }

	// What history says of each claim (by token): how it was made, and the
	// latest deadline any of its writes set.
	type claimWrite struct {
		key      string
		takeover bool
		owner    string
		deadline time.Time
	}
	claims := map[int64]*claimWrite{}
	for key, vs := range hist {
		live := false // the key has a record before this version
		for _, v := range vs {
			if v.deleted {
				live = false
				continue
			}
			r := v.rec
			if int64(r.Token) == v.rev { // a claim or a takeover writes its own revision
				claims[int64(r.Token)] = &claimWrite{key: key, takeover: live, owner: r.Owner}
			}
			if cw := claims[int64(r.Token)]; cw != nil && r.Deadline.After(cw.deadline) {
				cw.deadline = r.Deadline
			}
			live = true
		}
	}

	// 1. Two live owners.
	ended := map[string]int{} // session owner -> seq it ended at
	for _, e := range w.events {
		if (e.kind == evSessionEnd || e.kind == evCrash || e.kind == evClose) && e.owner != "" {
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
	for _, e := range w.events {
		switch e.kind {
		case evGrant:
			// The claim this grant took the key from, if any: the one whose
			// record its claim write replaced. A record deleted before it
			// was released by its own claim (only Release deletes here).
			if cw := claims[e.token]; cw != nil {
				if prev := replaced(e.key, e.token); prev != nil && int64(prev.Token) != e.token {
					for _, h := range holds {
						if h.grant.key != e.key || h.grant.token != int64(prev.Token) {
							continue
						}
						held := h.until == 0 || h.until > e.seq
						if done, ok := pendingFinish[fmt.Sprintf("%s %d", storeKey(h.grant.key), h.grant.token)]; ok && done > e.seq {
							held = true
						}
						sessionEnded := false
						if s, ok := ended[claims[h.grant.token].owner]; ok && s < e.seq {
							sessionEnded = true
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
						pastDeadline := !dl.IsZero() && !e.at.Before(dl)
						if held && !sessionEnded && !pastDeadline {
							fail("two live owners of %s: token %d (%s, granted at %d; record owner %q, deadline %v) still held, its session live and its deadline not passed, when token %d (%s) took the key over at %d (clock %v)",
								e.key, h.grant.token, h.grant.actor, h.grant.seq, prev.Owner, prev.Deadline.Format("15:04:05.000"), e.token, e.actor, e.seq, e.at.Format("15:04:05.000"))
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

	// 2. Effects.
	type app struct {
		token int64
		seq   int
	}
	applied := map[string][]app{}
	for _, e := range w.events {
		if e.kind != evEffect || !e.accepted {
			continue
		}
		ks := fmt.Sprintf("%s step %d", e.key, e.step)
		if prev := applied[ks]; len(prev) > 0 {
			last := prev[len(prev)-1]
			cw := claims[e.token]
			switch {
			case e.token <= last.token:
				fail("%s applied twice under token %d (at %d and %d)", ks, e.token, last.seq, e.seq)
			case cw == nil || !cw.takeover:
				fail("%s applied again at %d by token %d, which did not take the key over (the first, token %d, at %d): a re-run after a release or loss", ks, e.seq, e.token, last.token, last.seq)
			}
		}
		applied[ks] = append(applied[ks], app{e.token, e.seq})
	}

	// 3. Outcomes.
	for _, e := range w.events {
		if e.kind != evResult || e.err != "" || e.mismatch {
			continue
		}
		if e.via == "proxy" && (e.status == 0 || e.status == 409 || e.status == 429 || e.status == 503 ||
			e.status == 502 && strings.Contains(e.body, "upstream-unavailable")) {
			continue // not an outcome: the client retries
		}
		if e.via == "grpc" && (codes.Code(e.status) == codes.Aborted || codes.Code(e.status) == codes.Unavailable) {
			continue // not an outcome: the client retries (NotExecuted released the key too)
		}
		rec := final[e.key]
		switch {
		case rec == nil || rec.State != etcdstore.Done:
			fail("%s answered %q at %d, but the key's final record is %v", e.key, e.body, e.seq, describe(rec))
		case e.via == "proxy" && (e.status != rec.Outcome.Status || e.body != string(rec.Outcome.Body)):
			fail("%s answered %d %q at %d; saved %d %q", e.key, e.status, e.body, e.seq, rec.Outcome.Status, rec.Outcome.Body)
		case e.via == "grpc":
			if c, body := grpcAnswer(rec.Outcome); codes.Code(e.status) != c || e.body != body {
				fail("%s answered %v %q at %d; saved %v %q", e.key, codes.Code(e.status), e.body, e.seq, c, body)
			}
		case e.via != "proxy" && e.body != string(rec.Outcome.Body):
			fail("%s answered %q at %d; saved %q", e.key, e.body, e.seq, rec.Outcome.Body)
		}
	}
	for _, e := range w.waits {
		if rec := final[e.key]; rec == nil || rec.State != etcdstore.Done || e.body != string(rec.Outcome.Body) {
			fail("Wait on %s returned done %q; the key's final record is %v", e.key, e.body, describe(rec))
		}
	}

	// 4. Held by nobody.
	live := map[string]string{}
	for _, p := range w.procs {
		if !p.dead {
			live[p.store.Owner()] = p.name
		}
	}
	for key, rec := range final {
		if rec.State == etcdstore.InFlight && live[rec.Owner] != "" {
			fail("%s is in flight under the live session of %s (token %d) with nobody running it", key, live[rec.Owner], rec.Token)
		}
	}

	// 5. Checkpoints (a job's progress is checked as 9).
	for key, vs := range hist {
		if strings.HasPrefix(key, jobTenant+"/") {
			continue
		}
		high := 0
		for _, v := range vs {
			if v.deleted {
				high = 0
				continue
			}
			if v.rec.State != etcdstore.InFlight {
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
	started := map[string]string{} // task -> process, for complete tasks not finished
	for _, e := range w.events {
		switch {
		case e.kind == evTaskStart && strings.HasPrefix(e.task, "complete "):
			started[e.task] = e.proc
		case e.kind == evTaskDone:
			delete(started, e.task)
		case e.kind == evSessionEnd && e.body == "closed":
			for task, proc := range started {
				if proc == e.proc {
					fail("%s closed (at %d) with a final write still pending: %s", proc, e.seq, task)
				}
			}
		}
	}
	bad = append(bad, w.checkJobs(hist, final)...)
	sort.Strings(bad)
	return bad
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
