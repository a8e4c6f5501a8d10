package explore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

// Wait worlds: jobs that sleep and wait for events, run as idem runs them
// in production: every process runs a Worker with a completer for kind
// "wait" (two steps: a durable Run.Sleep, then a Run.Await of event "go"
// whose payload is committed as an etcd effect), and signal actors submit
// the jobs and signal the event, some twice from two processes, some with
// a payload of their own. Faults hit every store call of the completers,
// the steps and the signals. The invariants (checkWaits):
//
//	W1. A sleep is never shorter than asked, on the clocks: a job wakes no
//	    earlier than its sleep was first reached plus its length, less the
//	    largest skew between two processes' clocks.
//	W2. An await decides once: every run of the step, in every attempt of
//	    the job, gets the same payload, or the same timeout.
//	W3. An event is delivered once, as signalled: every signal answered
//	    yes carried the same payload, and the payload an await got is one a
//	    signal sent and was not refused.
//	W4. A timeout is never early: an await times out no earlier than it was
//	    first reached plus its timeout, less the skew (as W1).
//	W5. The effect committed with the payload exists, once and with the
//	    payload, exactly when the job's final state says the await got it.
//	W6. Payloads are JSON, compared as JSON: a second signal carrying the
//	    accepted payload in another spelling (member order, spacing, 2.0
//	    for 2, as another language's client writes it) is never refused
//	    as another payload.
var waitKeys = []string{"w0", "w1"}

// waitsConfig is a wait world's choice of lengths.
type waitsConfig struct {
	on      bool
	sleep   time.Duration
	timeout time.Duration // 0: the await waits as long as the job is kept
}

// pickWaits draws whether the world runs wait jobs: only where every
// process keeps jobs for a minute or more (a job's id then names one job
// for the whole schedule) and no restore rolls events back.
func (w *world) pickWaits() {
	shortest := w.cfg.retention[0]
	for _, r := range w.cfg.retention {
		shortest = min(shortest, r)
	}
	if w.cfg.restores || shortest < time.Minute || w.rng.IntN(3) != 0 {
		return
	}
	w.durable = waitsConfig{on: true, sleep: time.Duration(1+w.rng.IntN(6)) * time.Second}
	if w.rng.IntN(2) == 0 {
		w.durable.timeout = time.Duration(2+w.rng.IntN(8)) * time.Second
	}
	w.ledger.hit("config:durable waits")
	if w.cfg.shards {
		w.ledger.hit("config:durable waits on a shard set")
	}
}

// waitEv is what the wait jobs and signals did, in the schedule's order.
type waitEv struct {
	what    string // "nap", "woke", "await", "got", "timeout", "signal-try", "signal"
	id      string
	created time.Time // the job's record's creation: one job of the id
	at      time.Time // simulated true time
	proc    string
	payload string
	ok      bool // signals: answered yes
	refused bool // signals: refused (ErrSignalMismatch, or any other refusal)
	// mismatch: a signal refused as another payload (ErrSignalMismatch).
	mismatch bool
	seq      int
}

// noteWait notes e, its payload in canonical JSON (sorted members, no
// spacing, numbers as numbers: 2.0 is 2), written apart from the store's
// own: the checks compare payloads as JSON, as idem promises to (issue 38).
func (w *world) noteWait(e waitEv) {
	e.payload = canonicalJSON(e.payload)
	w.mu.Lock()
	defer w.mu.Unlock()
	e.seq = len(w.waitLog)
	w.waitLog = append(w.waitLog, e)
}

// startWaitWorker runs the wait kind's completer in p, as idem runs a
// worker: it stops with the process.
func (w *world) startWaitWorker(p *process) {
	if !w.durable.on {
		return
	}
	q, err := w.jobsQueue(p, w.zoneOf(p), jobs.WithLogger(slog.New(&ledgerLog{w: w, p: p})))
	if err != nil {
		panic(err)
	}
	if _, err := jobs.NewWorker(q, []jobs.Kind{w.waitKind(p)}, jobs.Concurrency(2), jobs.DrainTimeout(5*time.Second), jobs.WorkerName(p.name+"/wait")); err != nil {
		panic(err)
	}
}

// waitKind is the wait jobs' kind as process p runs it.
func (w *world) waitKind(p *process) jobs.Kind {
	yield := func(ctx context.Context) {
		if a := w.s.currentCtx(ctx); a != nil {
			w.s.step(a)
		}
	}
	return jobs.Kind{Name: "wait", MaxAttempts: 8, Backoff: time.Second, MaxBackoff: 4 * time.Second, Steps: []jobs.Step{
		{Name: "nap", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			yield(ctx)
			w.ranOnShard(p, r)
			id, created := r.Key().ID, r.Claim().Created()
			w.noteWait(waitEv{what: "nap", id: id, created: created, at: w.s.Now(), proc: p.name})
			if err := r.Sleep(w.durable.sleep); err != nil {
				return nil, err
			}
			w.noteWait(waitEv{what: "woke", id: id, created: created, at: w.s.Now(), proc: p.name})
			return []byte("rested"), nil
		}},
		{Name: "approval", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			yield(ctx)
			w.ranOnShard(p, r)
			id, created := r.Key().ID, r.Claim().Created()
			w.noteWait(waitEv{what: "await", id: id, created: created, at: w.s.Now(), proc: p.name})
			payload, err := r.Await("go", w.durable.timeout)
			switch {
			case errors.Is(err, jobs.ErrTimeout):
				w.noteWait(waitEv{what: "timeout", id: id, created: created, at: w.s.Now(), proc: p.name})
				return []byte("timeout"), nil
			case err != nil:
				return nil, err
			}
			if p.set != nil {
				w.ledger.hit("path:event delivered on a shard set")
			}
			w.noteWait(waitEv{what: "got", id: id, created: created, at: w.s.Now(), proc: p.name, payload: string(payload)})
			r.Commit(clientv3.OpPut(w.effectKey(id, "event"), string(payload)))
			return payload, nil
		}},
	}}
}

// waitPayload is the payload a wait job's signallers agree on.
func waitPayload(id string) string { return `{"job":"` + id + `","n":2}` }

// canonicalJSON is s as canonical JSON, or s itself if it is not JSON.
func canonicalJSON(s string) string {
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		return s
	}
	b, err := json.Marshal(v)
	if err != nil {
		return s
	}
	return string(b)
}

// signaller submits a wait job and signals its event, not at all, once or
// twice (the second time through another process, as a retried signal from
// another data centre), mostly with the job's payload, sometimes with its
// own.
func (w *world) signaller(a *actor, p *process) {
	id := waitKeys[w.rng.IntN(len(waitKeys))]
	q, err := w.jobsQueue(p, w.zoneOf(p))
	if err != nil {
		panic(err)
	}
	for try := 0; try < 3; try++ {
		w.s.step(a)
		if _, err := q.Submit(a.ctx, id, "wait", nil); err == nil || !retryable(err) {
			break
		}
	}
	payload, respelled := waitPayload(id), `{ "n": 2.0, "job": "`+id+`" }`
	if w.rng.IntN(4) == 0 {
		payload, respelled = `{"job":"rogue-`+a.name+`"}`, "{\n  \"job\" : \"rogue-"+a.name+"\"\n}"
	}
	sends := w.rng.IntN(3) // none: a job whose await may time out
	for i := 0; i < sends; i++ {
		target := p
		if i == 1 {
			target = w.procs[(p.slot+1+w.rng.IntN(len(w.procs)-1))%len(w.procs)]
			if w.rng.IntN(2) == 0 {
				// The same payload in another JSON spelling (another
				// language's client): the same signal.
				payload = respelled
			}
		}
		tq, err := w.jobsQueue(target)
		if err != nil {
			panic(err)
		}
		w.s.step(a)
		// Noted before it is sent: a signal whose call never returns (its
		// process died under it) may have landed.
		w.noteWait(waitEv{what: "signal-try", id: id, at: w.s.Now(), proc: target.name, payload: payload})
		err = tq.Signal(a.ctx, id, "go", []byte(payload))
		w.note("%s: signal %s go %q through %s: %v", a.name, id, payload, target.name, err)
		w.noteWait(waitEv{what: "signal", id: id, at: w.s.Now(), proc: target.name, payload: payload, ok: err == nil,
			refused: err != nil && !retryable(err), mismatch: errors.Is(err, jobs.ErrSignalMismatch)})
		if i == 1 && payload == respelled && err == nil {
			w.ledger.hit("path:signal in another JSON spelling taken as the same")
		}
		if errors.Is(err, jobs.ErrSignalMismatch) {
			w.ledger.hit("path:signal refused: another payload")
		}
	}
}

// drainWaits runs every wait job to its end after healing, signalling its
// event first: once faults stop, a job that waits ends.
func (w *world) drainWaits(a *actor) []string {
	if !w.durable.on {
		return nil
	}
	var bad []string
	p := w.procs[0]
	q, err := w.jobsQueue(p, w.zoneOf(p))
	if err != nil {
		return []string{err.Error()}
	}
	wk, err := jobs.NewWorker(q, []jobs.Kind{w.waitKind(p)}, jobs.Concurrency(0))
	if err != nil {
		return []string{err.Error()}
	}
	defer wk.Close()
	ctx := a.ctx
	for _, id := range waitKeys {
		var j *jobs.Job
		signalled := false
		for round := 0; round < 30; round++ {
			if !signalled {
				w.noteWait(waitEv{what: "signal-try", id: id, at: w.s.Now(), proc: p.name, payload: waitPayload(id)})
				err := q.Signal(ctx, id, "go", []byte(waitPayload(id)))
				w.noteWait(waitEv{what: "signal", id: id, at: w.s.Now(), proc: p.name, payload: waitPayload(id), ok: err == nil,
					refused: err != nil && !retryable(err), mismatch: errors.Is(err, jobs.ErrSignalMismatch)})
				signalled = err == nil || !retryable(err)
			}
			j, err = wk.Run(ctx, id)
			if errors.Is(err, etcdstore.ErrNotFound) {
				break
			}
			if err != nil && retryable(err) && round < 29 {
				clock.Sleep(p.clock, ctx, time.Second)
				continue
			}
			if err != nil {
				bad = append(bad, fmt.Sprintf("wait job %s: running it after healing: %v", id, err))
				break
			}
			if j.State.Final() || j.State == jobs.Parked {
				break
			}
			if j.State == jobs.Waiting {
				// An event is kept for the store's retention from its
				// signal: one sent long before the job reached its await
				// (faults held the job back) may be gone. Send it again.
				signalled = false
			}
			switch j.State {
			case jobs.Scheduled:
				clock.Sleep(p.clock, ctx, j.NotBefore.Sub(p.clock.Now())+time.Millisecond)
			default:
				clock.Sleep(p.clock, ctx, time.Second)
			}
		}
		if j != nil && !j.State.Final() && j.State != jobs.Parked {
			bad = append(bad, fmt.Sprintf("wait job %s still %s (attempts %d, owner %q) after healing and 30 rounds of running it", id, j.State, j.Attempts, j.Owner))
		}
	}
	return bad
}

// checkWaits checks W1-W5 (see waitKeys).
func (w *world) checkWaits(hist map[string][]version, final map[string]*etcdstore.Record) []string {
	if !w.durable.on {
		return nil
	}
	var bad []string
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	var spread time.Duration
	for _, a := range w.cfg.skew {
		for _, b := range w.cfg.skew {
			spread = max(spread, a-b)
		}
	}
	type job struct {
		id      string
		created time.Time
	}
	firstNap, firstAwait := map[job]time.Time{}, map[job]time.Time{}
	decided := map[job]string{}
	incarnations := map[string]map[time.Time]bool{}
	accepted := map[string]string{}      // id -> the payload signals were answered yes with
	acceptedAt := map[string]time.Time{} // id -> when the first of them was
	shortest := w.cfg.retention[0]
	for _, r := range w.cfg.retention {
		shortest = min(shortest, r)
	}
	sent := map[string]map[string]bool{} // id -> payloads sent and not refused
	wokeBy := map[job]string{}           // the process that reached the nap first
	sleptBefore := map[job]bool{}        // the await suspended once
	incarnationsOf := func(id string) map[time.Time]bool {
		// Every job the id named, whether or not it ran: from the
		// history, and from what the steps saw.
		out := map[time.Time]bool{}
		for _, v := range hist[jobKey(id)] {
			if !v.deleted && v.rec != nil {
				out[v.rec.Created] = true
			}
		}
		for _, e := range w.waitLog {
			if e.id == id && e.what != "signal" && e.what != "signal-try" {
				out[e.created] = true
			}
		}
		return out
	}
	// A signal tried and never answered (its caller died with the
	// process it called) may have landed: its payload counts as sent.
	unanswered := map[string]map[string]int{} // id -> payload -> tries - answers
	for _, e := range w.waitLog {
		if e.what != "signal-try" && e.what != "signal" {
			continue
		}
		if unanswered[e.id] == nil {
			unanswered[e.id] = map[string]int{}
		}
		if e.what == "signal-try" {
			unanswered[e.id][e.payload]++
		} else {
			unanswered[e.id][e.payload]--
		}
	}
	for id, m := range unanswered {
		for payload, n := range m {
			if n > 0 {
				if sent[id] == nil {
					sent[id] = map[string]bool{}
				}
				sent[id][payload] = true
			}
		}
	}
	for _, e := range w.waitLog {
		j := job{e.id, e.created}
		switch e.what {
		case "signal-try":
			continue
		case "signal":
			if sent[e.id] == nil {
				sent[e.id] = map[string]bool{}
			}
			if !e.refused {
				sent[e.id][e.payload] = true
			}
			if e.ok {
				if at, ok := acceptedAt[e.id]; ok && e.at.Sub(at) >= shortest {
					// The event may have passed its retention since: a
					// new one may be signalled.
					delete(accepted, e.id)
				}
				if _, ok := accepted[e.id]; !ok {
					acceptedAt[e.id] = e.at
				}
				if prev, ok := accepted[e.id]; ok && prev != e.payload && len(incarnationsOf(e.id)) <= 1 {
					// (Each job of an id has events of its own: only one job
					// of the id is checked so.)
					fail("W3: %s: signals answered yes with payloads %q and %q", e.id, prev, e.payload)
				} else if ok {
					w.ledger.hit("path:event signalled twice")
				}
				accepted[e.id] = e.payload
			}
			if prev, ok := accepted[e.id]; ok && e.mismatch && prev == e.payload {
				// W6: payloads are compared as JSON.
				fail("W6: %s: a signal refused as another payload, though it is the accepted %s in another spelling", e.id, prev)
			}
			continue
		}
		if incarnations[e.id] == nil {
			incarnations[e.id] = map[time.Time]bool{}
		}
		incarnations[e.id][e.created] = true
		switch e.what {
		case "nap":
			if _, ok := firstNap[j]; !ok {
				firstNap[j], wokeBy[j] = e.at, e.proc
			}
		case "woke":
			w.ledger.hit("path:job slept and woke")
			if e.proc != wokeBy[j] {
				w.ledger.hit("path:sleep resumed by another process")
			}
			if want := firstNap[j].Add(w.durable.sleep - spread); e.at.Before(want) {
				fail("W1: %s woke at %v, %v after its sleep of %v was first reached (skew spread %v)", e.id,
					e.at.Format("15:04:05.000"), e.at.Sub(firstNap[j]), w.durable.sleep, spread)
			}
		case "await":
			if _, ok := firstAwait[j]; !ok {
				firstAwait[j] = e.at
			} else if decided[j] == "" {
				sleptBefore[j] = true
			}
		case "got", "timeout":
			d := "timeout"
			if e.what == "got" {
				d = "payload " + e.payload
				if sleptBefore[j] {
					w.ledger.hit("path:job woken by an event")
				} else {
					w.ledger.hit("path:event there before the job waited")
				}
				if !sent[e.id][e.payload] {
					fail("W3: %s got payload %q, which no signal sent (or every one was refused)", e.id, e.payload)
				}
			} else {
				w.ledger.hit("path:await timed out")
				if want := firstAwait[j].Add(w.durable.timeout - spread); w.durable.timeout > 0 && e.at.Before(want) {
					fail("W4: %s timed out at %v, %v after its await of %v was first reached (skew spread %v)", e.id,
						e.at.Format("15:04:05.000"), e.at.Sub(firstAwait[j]), w.durable.timeout, spread)
				}
			}
			if prev := decided[j]; prev != "" && prev != d {
				fail("W2: %s's await decided %s, then %s", e.id, prev, d)
			}
			decided[j] = d
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range waitKeys {
		if len(incarnations[id]) > 1 {
			continue // its retention passed, and its id named a new job: effects of both
		}
		resp, err := w.admin.Get(ctx, w.effectKey(id, "event"))
		if err != nil {
			fail("W5: %s: reading its effect: %v", id, err)
			continue
		}
		rec := final[jobKey(id)]
		if rec == nil {
			continue // never submitted, or forgotten (its retention passed); its effect is not
		}
		j, err := jobs.FromRecord(rec, w.s.Now())
		if err != nil {
			fail("W5: %s final record: %v", id, err)
			continue
		}
		step := stepOf(j, "approval")
		got := step.Finished && string(step.Output) != "timeout"
		switch {
		case len(resp.Kvs) == 1 && resp.Kvs[0].Version != 1:
			fail("W5: %s: its effect was written %d times", id, resp.Kvs[0].Version)
		case got != (len(resp.Kvs) == 1):
			fail("W5: %s: effect exists %v, but the job's final state says the await got the event %v (%s)", id, len(resp.Kvs) == 1, got, j.State)
		case got && string(resp.Kvs[0].Value) != string(step.Output):
			fail("W5: %s: effect %q, but the await's output is %q", id, resp.Kvs[0].Value, step.Output)
		case got:
			w.ledger.hit("path:event's effect committed with the await's checkpoint")
		}
	}
	return bad
}
