package explore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

// Limit worlds: jobs of kind "lim" under a per-merchant limit (package
// jobs' Kind.Limits), run as idem runs them in production: every process
// runs a Worker with a completer, and limit actors submit the jobs through
// any process. Each job's merchant is in its parameters; the limit is one
// or two jobs of a merchant at once, with, in some worlds, a rate. Faults
// hit every store call: the slots' reads and compare-and-sets, the steps'
// checkpoints, the completers' watches. The invariants (checkLimits):
//
//	L1. No step of a limited job commits without a slot: every write that
//	    finishes a step, at its revision, finds one of its merchant's
//	    slots holding the job and the token of the claim that wrote it.
//	L2. A slot is never taken from a live claim: a slot holding a job and
//	    token is taken by another only at a revision where that job's
//	    record is no longer held by the claim of that token (taken over,
//	    given back, ended).
//	L3. No more slots than the limit: a slot's index is below it.
//	L4. The rate holds: a merchant's attempts start no closer together
//	    than its period allows, less the largest skew between clocks.
//	L5. User code never takes a process down: in some worlds the limit's
//	    Key function panics on one job's parameters (poisonJob); that job
//	    fails, its error naming the function and the panic, and the
//	    processes run on.
//
// Together, L1-L3 say that no more jobs of a merchant than its limit
// commit work in the same span of revisions: the limit is never exceeded,
// takeovers and lost replies included.
var limitKeys = []string{"l0", "l1", "l2", "l3", "l4"}

// merchantOfLimitJob is the merchant of a limit job: l0-l2 are m0's.
func merchantOfLimitJob(id string) string {
	if id < "l3" {
		return "m0"
	}
	return "m1"
}

type limitsConfig struct {
	on    bool
	conc  int
	rate  float64 // 0: none
	burst int     // with a rate: how many attempts may start at once
	// poison: the limit's Key function panics on a job whose parameters
	// say "poison", and submitters sometimes submit one (poisonJob).
	poison bool
}

// poisonJob is a limited job whose parameters make the limit's Key
// function panic (user code idem does not control): it fails alone, with
// an error naming the function and the panic (L5), and every process runs
// on (a panic that escaped would end the explorer's own process).
const poisonJob = "lp"

// pickLimits draws whether the world runs limited jobs: where every process
// keeps jobs for a minute or more (an id names one job) and no restore
// rolls slots back.
func (w *world) pickLimits() {
	shortest := w.cfg.retention[0]
	for _, r := range w.cfg.retention {
		shortest = min(shortest, r)
	}
	if w.cfg.shards || w.cfg.restores || shortest < time.Minute || w.rng.IntN(3) != 0 {
		return
	}
	w.limits = limitsConfig{on: true, conc: 1 + w.rng.IntN(2)}
	if w.rng.IntN(2) == 0 {
		w.limits.rate, w.limits.burst = 0.5, 1+w.rng.IntN(2)
	}
	w.limits.poison = w.rng.IntN(2) == 0
	w.ledger.hit("config:per-key limits")
}

// limitEv is one attempt of a limited job reaching a step.
type limitEv struct {
	id    string
	token int64
	at    time.Time // simulated true time
}

func (w *world) noteLimit(e limitEv) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.limitLog = append(w.limitLog, e)
}

// startLimitWorker runs the lim kind's completer in p.
func (w *world) startLimitWorker(p *process) {
	if !w.limits.on || p.store == nil {
		return
	}
	q, err := jobs.New(p.store, w.zoneOf(p), jobs.WithLogger(slog.New(&ledgerLog{w: w, p: p})))
	if err != nil {
		panic(err)
	}
	if _, err := jobs.NewWorker(q, []jobs.Kind{w.limitKind()}, jobs.Concurrency(2), jobs.DrainTimeout(5*time.Second), jobs.WorkerName(p.name+"/lim")); err != nil {
		panic(err)
	}
}

// limitKind is the limited kind: two steps, the second commits an effect.
func (w *world) limitKind() jobs.Kind {
	yield := func(ctx context.Context) {
		if a := w.s.currentCtx(ctx); a != nil {
			w.s.step(a)
		}
	}
	step := func(name string, commit bool) jobs.Step {
		return jobs.Step{Name: name, Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			w.noteLimit(limitEv{id: r.Key().ID, token: int64(r.Token()), at: w.s.Now()})
			yield(ctx)
			if commit {
				r.Commit(clientv3.OpPut(w.effectKey(r.Key().ID, "limited"), strconv.FormatInt(int64(r.Token()), 10)))
			}
			return []byte(name), nil
		}}
	}
	key := jobs.ParamKey("m")
	if w.limits.poison {
		key = func(params []byte) (string, error) {
			if strings.Contains(string(params), "poison") {
				panic("poisoned parameters " + string(params))
			}
			return jobs.ParamKey("m")(params)
		}
	}
	l := jobs.Limit{Name: "merchant", Key: key, Concurrency: w.limits.conc}
	if w.limits.rate > 0 {
		l.Rate, l.Burst = w.limits.rate, w.limits.burst
	}
	return jobs.Kind{Name: "lim", MaxAttempts: 8, Backoff: time.Second, MaxBackoff: 4 * time.Second,
		Limits: []jobs.Limit{l}, Steps: []jobs.Step{step("a", false), step("b", true)}}
}

// limitSubmitter submits limited jobs through p.
func (w *world) limitSubmitter(a *actor, p *process) {
	q, err := jobs.New(p.store, w.zoneOf(p))
	if err != nil {
		panic(err)
	}
	for n := 1 + w.rng.IntN(3); n > 0; n-- {
		id := limitKeys[w.rng.IntN(len(limitKeys))]
		params := `{"m":"` + merchantOfLimitJob(id) + `"}`
		if w.limits.poison && w.rng.IntN(4) == 0 {
			id, params = poisonJob, `{"m":"m0","poison":true}`
		}
		for try := 0; try < 3; try++ {
			w.s.step(a)
			_, err := q.Submit(a.ctx, id, "lim", []byte(params))
			w.note("%s: submit %s: %v", a.name, id, err)
			if err == nil || !retryable(err) {
				break
			}
		}
	}
}

// drainLimits runs every limited job to its end after healing.
func (w *world) drainLimits(a *actor) []string {
	if !w.limits.on {
		return nil
	}
	p := w.procs[0]
	q, err := jobs.New(p.store, w.zoneOf(p))
	if err != nil {
		return []string{err.Error()}
	}
	wk, err := jobs.NewWorker(q, []jobs.Kind{w.limitKind()}, jobs.Concurrency(0))
	if err != nil {
		return []string{err.Error()}
	}
	defer wk.Close()
	var bad []string
	ids := limitKeys
	if w.limits.poison {
		ids = append(slices.Clip(ids), poisonJob)
	}
	for _, id := range ids {
		var j *jobs.Job
		for round := 0; round < 40; round++ {
			j, err = wk.Run(a.ctx, id)
			if errors.Is(err, etcdstore.ErrNotFound) {
				break
			}
			if err != nil && retryable(err) && round < 39 {
				clock.Sleep(p.clock, a.ctx, time.Second)
				continue
			}
			if err != nil {
				bad = append(bad, fmt.Sprintf("limited job %s: running it after healing: %v", id, err))
				break
			}
			if j.State.Final() || j.State == jobs.Parked {
				break
			}
			if j.State == jobs.Scheduled && j.NotBefore.After(p.clock.Now()) {
				clock.Sleep(p.clock, a.ctx, j.NotBefore.Sub(p.clock.Now())+time.Millisecond)
				continue
			}
			clock.Sleep(p.clock, a.ctx, time.Second)
		}
		if j != nil && !j.State.Final() && j.State != jobs.Parked {
			bad = append(bad, fmt.Sprintf("limited job %s still %s (limited %q, attempts %d, owner %q) after healing and 40 rounds of running it",
				id, j.State, j.Limited, j.Attempts, j.Owner))
		}
		if id == poisonJob && j != nil && j.State.Final() {
			// L5: user code that panics fails its job alone, naming itself.
			if j.State != jobs.Failed || !strings.Contains(j.Err, "Key function panicked") || !strings.Contains(j.Err, "poisoned parameters") {
				bad = append(bad, fmt.Sprintf("L5: the job whose parameters make the limit's Key function panic ended %s %q; want failed, the panic named", j.State, j.Err))
			} else {
				w.ledger.hit("path:a callback panicked: its job failed alone")
			}
		}
	}
	return bad
}

// slotWrite is one write of a limit's slot, from etcd's history.
type slotWrite struct {
	rev     int64
	name    string // the slot's value name
	deleted bool
	job     string
	token   int64
}

// checkLimits checks L1-L4 (see limitKeys).
func (w *world) checkLimits(hist map[string][]version, end int64) []string {
	if !w.limits.on {
		return nil
	}
	var bad []string
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	// The slots' writes, by merchant.
	prefix := "j/l/" + jobTenant + "/merchant/"
	writes := map[string][]slotWrite{}
	for _, ev := range w.feed.since(w.start+1, end) {
		rest, ok := w.storeRest(string(ev.Kv.Key))
		if !ok {
			continue
		}
		rest, ok = strings.CutPrefix(rest, prefix)
		if !ok {
			continue
		}
		merchant, slot, ok := strings.Cut(rest, "/c/")
		if !ok {
			continue // a rate slot
		}
		if i, err := strconv.Atoi(slot); err != nil || i >= w.limits.conc || i < 0 {
			fail("L3: merchant %s: a slot %q written at revision %d; the limit is %d", merchant, slot, ev.Kv.ModRevision, w.limits.conc)
			continue
		}
		sw := slotWrite{rev: ev.Kv.ModRevision, name: rest, deleted: ev.Type == mvccpb.DELETE}
		if !sw.deleted {
			var h struct {
				Job   string `json:"job"`
				Token int64  `json:"token"`
			}
			if err := json.Unmarshal(ev.Kv.Value, &h); err != nil {
				fail("L3: slot %s at revision %d holds %q", rest, sw.rev, ev.Kv.Value)
				continue
			}
			sw.job, sw.token = h.Job, h.Token
		}
		writes[merchant] = append(writes[merchant], sw)
	}
	// heldAt: who holds each of merchant's slots after every write up to rev.
	heldAt := func(merchant string, rev int64) map[string]slotWrite {
		out := map[string]slotWrite{}
		for _, sw := range writes[merchant] {
			if sw.rev > rev {
				break
			}
			if sw.deleted {
				delete(out, sw.name)
			} else {
				out[sw.name] = sw
			}
		}
		return out
	}
	// claimAt: the job's record as it stood at rev.
	claimAt := func(id string, rev int64) *etcdstore.Record {
		var rec *etcdstore.Record
		for _, v := range hist[jobKey(id)] {
			if v.rev > rev {
				break
			}
			rec = v.rec
			if v.deleted {
				rec = nil
			}
		}
		return rec
	}
	// L1: every write that finishes a step holds a slot.
	for _, id := range limitKeys {
		merchant := merchantOfLimitJob(id)
		finished := map[string]bool{}
		for _, v := range hist[jobKey(id)] {
			if v.deleted || v.rec == nil {
				finished = map[string]bool{}
				continue
			}
			j, err := jobs.FromRecord(v.rec, w.s.Now())
			if err != nil {
				continue
			}
			for _, s := range j.Steps {
				if !s.Finished || finished[s.Name] {
					continue
				}
				finished[s.Name] = true
				if int64(s.Token) != int64(v.rec.Token) {
					continue // finished by an earlier claim (this is a later version)
				}
				ok := false
				for _, sw := range heldAt(merchant, v.rev) {
					ok = ok || sw.job == id && sw.token == int64(s.Token)
				}
				if !ok {
					fail("L1: job %s finished step %s at revision %d under token %d without a slot of merchant %s (slots then: %v)",
						id, s.Name, v.rev, s.Token, merchant, heldAt(merchant, v.rev))
				}
				w.ledger.hit("path:limited step committed under its slot")
			}
		}
	}
	// L2: a slot changes hands only from a claim that is over; and the
	// high-water mark of slots held at once.
	for merchant, ws := range writes {
		held := map[string]slotWrite{}
		for _, sw := range ws {
			prev, had := held[sw.name]
			if had && !sw.deleted && (prev.job != sw.job || prev.token != sw.token) {
				if rec := claimAt(prev.job, sw.rev); rec != nil && rec.State == etcdstore.InFlight && rec.Owner != "" && int64(rec.Token) == prev.token {
					fail("L2: slot %s taken by %s/%d at revision %d from %s/%d, whose claim was live (owner %q)",
						sw.name, sw.job, sw.token, sw.rev, prev.job, prev.token, rec.Owner)
				}
				if prev.job == sw.job {
					w.ledger.hit("path:slot of an earlier attempt retaken")
				} else {
					w.ledger.hit("path:slot of a claim that was over taken")
				}
			}
			if sw.deleted {
				delete(held, sw.name)
			} else {
				held[sw.name] = sw
			}
			if len(held) == w.limits.conc {
				w.ledger.hit("path:every slot of a key held at once")
			}
		}
		_ = merchant
	}
	// L4: attempts of a merchant start a period apart, less the skew.
	if w.limits.rate > 0 {
		var spread time.Duration
		for _, a := range w.cfg.skew {
			for _, b := range w.cfg.skew {
				spread = max(spread, a-b)
			}
		}
		// Burst attempts in any window of Burst/Rate: the i-th start and the
		// (i+Burst)-th are at least that far apart.
		b := w.limits.burst
		period := time.Duration(float64(b) * float64(time.Second) / w.limits.rate)
		starts := map[string][]limitEv{}
		seen := map[string]bool{}
		for _, e := range w.limitLog {
			k := e.id + "/" + strconv.FormatInt(e.token, 10)
			if seen[k] {
				continue
			}
			seen[k] = true
			m := merchantOfLimitJob(e.id)
			starts[m] = append(starts[m], e)
		}
		for m, es := range starts {
			slices.SortFunc(es, func(a, b limitEv) int { return a.at.Compare(b.at) })
			for i := b; i < len(es); i++ {
				if d := es[i].at.Sub(es[i-b].at); d < period-spread-time.Millisecond {
					fail("L4: merchant %s: attempts %s/%d and %s/%d started %v apart, %d starts; the rate allows %d per %v (skew spread %v)",
						m, es[i-b].id, es[i-b].token, es[i].id, es[i].token, d, b+1, b, period, spread)
				}
			}
			if len(es) > 1 {
				w.ledger.hit("path:rate spaced a key's attempts")
			}
		}
	}
	return bad
}

// zoneOf is the jobs option of process p: in a zoned world, each process
// is a data centre of its own, so its jobs prefer its workers.
func (w *world) zoneOf(p *process) jobs.Option {
	if !w.zoned {
		return func(*jobs.Queue) error { return nil }
	}
	return jobs.WithZone(fmt.Sprintf("dc%d", p.slot))
}
