package explore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
)

// Jobs (package jobs) in the schedules: each is a key of tenant "jobs" with
// three steps, run by job actors through any process (a Worker without a
// completer, told to Run), with a fault at every store call as for the
// other actors. Steps 1 and 3 act at the fenced sink; step 2 commits an
// etcd effect with its checkpoint; step 1 has a compensation that commits
// one too. Each world picks how often a step fails and what its failure
// means (retry, fail, compensate).
var jobKeys = []string{"j0", "j1"}

const jobTenant = "jobs"

// jobKey is a job's name in the schedule's events and history.
func jobKey(id string) string { return jobTenant + "/" + id }

// storeKey returns the store key of a key's name in the events.
func storeKey(name string) etcdstore.Key {
	if t, id, ok := strings.Cut(name, "/"); ok {
		return etcdstore.Key{Tenant: t, ID: id}
	}
	return etcdstore.Key{ID: name}
}

// jobsConfig is a world's choice of how its jobs fail.
type jobsConfig struct {
	failRate float64       // share of step runs that fail
	policy   jobs.OnError  // what step 2's failure means
	deadline time.Duration // the kind's attempt deadline, or 0
	maxTries int
	// tight: records are held to 4 KiB (etcdstore.WithMaxRecordSize), and
	// the last step commits an effect too, with an output of a size that
	// may or may not leave room for the job's end.
	tight bool
	size  int // the last step's output, in a tight world
	// retryParked: after healing, a job left parked is retried (as from
	// the console or idem jobs retry) and must then end.
	retryParked bool
	// cancelParked: ... it is cancelled instead.
	cancelParked bool
}

func (w *world) pickJobs() {
	w.jobs = jobsConfig{
		failRate: []float64{0, 0.15, 0.35}[w.rng.IntN(3)],
		policy:   []jobs.OnError{jobs.Retry, jobs.Retry, jobs.Fail, jobs.Compensate}[w.rng.IntN(4)],
		maxTries: 2 + w.rng.IntN(3),
		tight:    w.rng.IntN(4) == 0,
		size:     2200 + w.rng.IntN(1000),
	}
	w.jobs.retryParked = w.rng.IntN(2) == 0
	w.jobs.cancelParked = w.rng.IntN(3) == 0
	if w.rng.IntN(3) == 0 {
		w.jobs.deadline = time.Duration(5+w.rng.IntN(20)) * time.Second
		// A job may wait at most half the store's retention.
		shortest := w.cfg.retention[0]
		for _, r := range w.cfg.retention {
			shortest = min(shortest, r)
		}
		w.jobs.deadline = min(w.jobs.deadline, shortest/2-time.Second)
	}
}

// jobsQueue is a queue on p's store, or, in a shard world, on its shard
// set (jobs.NewOnShards), as idem serve makes one.
func (w *world) jobsQueue(p *process, opts ...jobs.Option) (*jobs.Queue, error) {
	if p.set != nil {
		return jobs.NewOnShards(p.set, opts...)
	}
	return jobs.New(p.store, opts...)
}

// ranOnShard notes in the ledger a step of a job run on a shard set, and
// whether it ran on a shard other than the job's home under the set p
// knows in force: its old one, which keeps it until it ends.
func (w *world) ranOnShard(p *process, r *jobs.Run) {
	if p == nil || p.set == nil {
		return
	}
	w.ledger.hit("path:job step ran on a shard set")
	if p.set.Shard(p.set.Place(r.Key())) != storex.StoreOf(r.Claim()) {
		w.ledger.hit("path:job step ran on its old shard while keys moved")
	}
}

// effectKey is the etcd key of a job step's committed effect.
func (w *world) effectKey(id, what string) string { return w.effectsPrefix() + id + "/" + what }

func (w *world) effectsPrefix() string { return "/explore-effects" + w.prefix }

// jobKind is the world's job kind as actor a runs it (a nil a: the driver,
// after healing, which neither yields nor fails).
func (w *world) jobKind(a *actor) jobs.Kind {
	name := "driver"
	if a != nil {
		name = a.name
	}
	// effect applies a step's effect; it reports whether the sink accepted
	// it, or, for an effect committed with the checkpoint, nothing: etcd
	// applies it or not with the checkpoint (checked as invariant 8).
	step := func(n int, effect func(r *jobs.Run) (accepted, committed bool)) func(ctx context.Context, r *jobs.Run) ([]byte, error) {
		return func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			key := jobKey(r.Key().ID)
			deaf := false
			if a != nil {
				w.s.step(a)
				deaf = w.rng.IntN(3) == 0 // a slow worker: it does not notice a lost claim
				if w.rng.Float64() < w.jobs.failRate {
					w.note("%s: job %s step %d fails (attempt %d)", name, key, n, r.Attempt())
					return nil, fmt.Errorf("step %d failed on attempt %d", n, r.Attempt())
				}
			}
			if ctx.Err() != nil && !deaf {
				return nil, ctx.Err()
			}
			if a != nil {
				w.ranOnShard(a.proc, r)
			}
			accepted, committed := effect(r)
			via := "job"
			if committed {
				via = "job-commit"
			}
			proc := ""
			if a != nil && a.proc != nil {
				proc = a.proc.name
			}
			w.log(event{kind: evEffect, key: key, step: n, token: int64(r.Token()), accepted: accepted, actor: name, via: via, proc: proc, heeds: !deaf && proc != ""})
			out := []byte(fmt.Sprintf("%s step %d by %d", key, n, r.Token()))
			if n == 3 && w.jobs.tight {
				out = append(out, bytes.Repeat([]byte{'.'}, w.jobs.size)...)
			}
			return out, nil
		}
	}
	atSink := func(n int) func(r *jobs.Run) (bool, bool) {
		return func(r *jobs.Run) (bool, bool) {
			return w.sink.apply(jobKey(r.Key().ID), n, int64(r.Token()), name), false
		}
	}
	// The last step acts at the sink; in a tight world it also commits an
	// effect, and its output fills most of the record (see jobsConfig).
	last := atSink(3)
	if w.jobs.tight {
		last = func(r *jobs.Run) (bool, bool) {
			r.Commit(clientv3.OpPut(w.effectKey(r.Key().ID, "s3"), fmt.Sprint(r.Token())))
			return w.sink.apply(jobKey(r.Key().ID), 3, int64(r.Token()), name), true
		}
	}
	committed := func(r *jobs.Run) (bool, bool) {
		r.Commit(clientv3.OpPut(w.effectKey(r.Key().ID, "s2"), fmt.Sprint(r.Token())))
		return false, true
	}
	return jobs.Kind{
		Name:        "explore",
		MaxAttempts: w.jobs.maxTries,
		Backoff:     time.Second,
		MaxBackoff:  4 * time.Second,
		Deadline:    w.jobs.deadline,
		Steps: []jobs.Step{
			{Name: "s1", Run: step(1, atSink(1)), Compensate: func(ctx context.Context, r *jobs.Run) error {
				if a != nil {
					w.s.step(a)
				}
				r.Commit(clientv3.OpPut(w.effectKey(r.Key().ID, "undo-s1"), fmt.Sprint(r.Token())))
				return nil
			}},
			{Name: "s2", Run: step(2, committed), OnError: w.jobs.policy},
			{Name: "s3", Run: step(3, last)},
		},
	}
}

// jobWorker submits a job through p and runs it there, retrying each call
// a few times, as a worker told to run it would.
func (w *world) jobWorker(a *actor, p *process) {
	id := jobKeys[w.rng.IntN(len(jobKeys))]
	q, err := w.jobsQueue(p)
	if err != nil {
		panic(err)
	}
	wk, err := jobs.NewWorker(q, []jobs.Kind{w.jobKind(a)}, jobs.Concurrency(0))
	if err != nil {
		panic(err)
	}
	defer wk.Close()
	for try := 0; try < 3; try++ {
		w.s.step(a)
		if _, err := q.Submit(a.ctx, id, "explore", []byte(`{"job":true}`)); err == nil || !retryable(err) {
			break
		}
	}
	for try := 0; try < 3; try++ {
		w.s.step(a)
		j, err := wk.Run(a.ctx, id)
		if err == nil {
			w.note("%s: job %s is %s after %d attempts", a.name, id, j.State, j.Attempts)
			if j.State.Final() || j.State == jobs.Parked {
				return
			}
		} else if errors.Is(err, etcdstore.ErrNotFound) || !retryable(err) {
			return
		}
	}
}

// operator does what a person on call does from the console (idem serve
// --console) or idem jobs: it waits for a job to park and retries it, or
// cancels a job, through the calls both make (Queue.Retry, Queue.Cancel),
// under the schedule's faults at every store call. A call whose outcome is
// unknown is repeated, as a person who saw "may have happened" and looked
// again would: the second finds the job moved on and is refused.
func (w *world) operator(a *actor, p *process) {
	id := jobKeys[w.rng.IntN(len(jobKeys))]
	q, err := w.jobsQueue(p)
	if err != nil {
		panic(err)
	}
	cancel := w.rng.IntN(2) == 0
	for look := 0; look < 40; look++ { // a job parks only after its attempts ran out
		w.s.step(a)
		j, err := q.Get(a.ctx, id)
		if err != nil || cancel && j.State == jobs.Running || !cancel && j.State != jobs.Parked {
			continue // not there yet, or not in a state the action takes: look again later
		}
		for try := 0; try < 3; try++ {
			w.s.step(a)
			var done *jobs.Job
			if cancel {
				done, err = q.Cancel(a.ctx, id, "explore: cancelled by "+a.name)
			} else {
				done, err = q.Retry(a.ctx, id)
			}
			switch {
			case err == nil && cancel:
				w.ledger.hit("path:operator cancelled a job")
				w.note("%s: cancelled job %s (token %d)", a.name, id, done.Token)
				return
			case err == nil:
				w.ledger.hit("path:operator retried a parked job under faults")
				w.note("%s: retried job %s (token %d), now %s", a.name, id, done.Token, done.State)
				return
			case errors.Is(err, jobs.ErrNotParked), errors.Is(err, jobs.ErrRunning), errors.Is(err, jobs.ErrFinal):
				if try > 0 {
					w.ledger.hit("path:operator's repeated action refused after an unknown outcome")
				}
				w.note("%s: %s of job %s refused: %v", a.name, map[bool]string{true: "cancel", false: "retry"}[cancel], id, err)
				return
			case !retryable(err):
				w.note("%s: %s of job %s: %v", a.name, map[bool]string{true: "cancel", false: "retry"}[cancel], id, err)
				return
			}
		}
		return
	}
}

// drainJobs runs every job to its end (or to parked) after healing, as an
// actor of the first process: once faults stop, a job always ends. It
// reports what did not.
func (w *world) drainJobs(a *actor) []string {
	var bad []string
	p := w.procs[0]
	q, err := w.jobsQueue(p)
	if err != nil {
		return []string{err.Error()}
	}
	wk, err := jobs.NewWorker(q, []jobs.Kind{w.jobKind(nil)}, jobs.Concurrency(0))
	if err != nil {
		return []string{err.Error()}
	}
	defer wk.Close()
	ctx := a.ctx
	for _, id := range jobKeys {
		var j *jobs.Job
		retried := false
		for round := 0; round < 20; round++ {
			if j != nil && j.State == jobs.Parked && w.jobs.retryParked && !retried {
				// Someone on call retries it (the console, idem jobs retry):
				// with faults healed, it then ends. Or, in some worlds,
				// cancels it: it then stays cancelled (invariant 10).
				if w.jobs.cancelParked {
					cj, err := q.Cancel(ctx, id, "explore: cancelled after healing")
					if err != nil && retryable(err) && round < 19 {
						clock.Sleep(p.clock, ctx, time.Second)
						continue
					}
					if err != nil || cj.State != jobs.Cancelled {
						bad = append(bad, fmt.Sprintf("job %s: cancelling it, parked, after healing: %v, %+v", id, err, cj))
					}
					w.ledger.hit("path:operator cancelled a parked job")
					j = cj
					break
				}
				rj, err := q.Retry(ctx, id)
				if err != nil && retryable(err) && round < 19 {
					clock.Sleep(p.clock, ctx, time.Second)
					continue
				}
				if err != nil {
					bad = append(bad, fmt.Sprintf("job %s: retrying it, parked, after healing: %v", id, err))
					break
				}
				retried = true
				w.ledger.hit("path:operator retried a parked job")
				w.note("driver: retried parked job %s: %s, token %d", id, rj.State, rj.Token)
			}
			j, err = wk.Run(ctx, id)
			if errors.Is(err, etcdstore.ErrNotFound) {
				break
			}
			if err != nil && retryable(err) && round < 19 {
				clock.Sleep(p.clock, ctx, time.Second) // a session being replaced, say
				continue
			}
			if err != nil {
				bad = append(bad, fmt.Sprintf("job %s: running it after healing: %v", id, err))
				break
			}
			if j.State.Final() || j.State == jobs.Parked && (retried || !w.jobs.retryParked) {
				break
			}
			switch j.State {
			case jobs.Scheduled:
				clock.Sleep(p.clock, ctx, j.NotBefore.Sub(p.clock.Now())+time.Millisecond)
			case jobs.Running:
				// Its claim's owner is a dead session (taken over next
				// round) or the claim's deadline is to pass.
				clock.Sleep(p.clock, ctx, time.Second)
			}
		}
		if j != nil && !j.State.Final() && j.State != jobs.Parked {
			bad = append(bad, fmt.Sprintf("job %s still %s (attempts %d, owner %q) after healing and 20 rounds of running it", id, j.State, j.Attempts, j.Owner))
		}
		// (A job whose end cannot fit its record, in a tight world, parks
		// again: nothing an operator does makes it fit.)
		if retried && j != nil && j.State == jobs.Parked && !strings.Contains(j.Err, "too large") {
			bad = append(bad, fmt.Sprintf("job %s parked again after an operator retried it with faults healed (attempts %d): %s", id, j.Attempts, j.Err))
		}
	}
	return bad
}

// checkJobs checks what jobs promise beyond the claims' invariants:
//
//  7. A finished step is never run again: no run of a step by a claim
//     whose token is greater than the one that finished it.
//  8. A step's etcd effect is applied exactly when its step finished:
//     the effect key exists, written once, if and only if the job's final
//     state says the step finished (likewise a compensation's).
//  9. Progress never goes back: along a job's history, the steps
//     finished (and compensated) only grow; and (9b) an ended job stays
//     as it ended: once a version of it is succeeded, failed or
//     cancelled, no later version of the same job is in another state
//     (an operator's cancel or retry, or a worker that lost the race
//     with it, never brings it back).
func (w *world) checkJobs(hist map[string][]version, final map[string]*etcdstore.Record, rolledBack map[string]bool, opStarts map[string][]int64) []string {
	var bad []string
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range jobKeys {
		key := jobKey(id)
		if rolledBack[key] {
			continue // a restore rolled the job back: it runs again from there
		}
		finishedBy := map[int]int64{} // step -> token that finished it
		high := 0
		var ended jobs.State
		endedAt := int64(0)
		for _, v := range hist[key] {
			if v.deleted || slices.Contains(opStarts[key], int64(v.rec.Token)) {
				// Gone, or submitted again after its retention passed: a
				// new job of the same id.
				finishedBy, high, ended = map[int]int64{}, 0, ""
			}
			if v.deleted || v.rec.Fence {
				continue
			}
			j, err := jobs.FromRecord(v.rec, v.rec.Created)
			if err != nil {
				fail("%s at revision %d: %v", key, v.rev, err)
				continue
			}
			progress := 0
			for n, s := range j.Steps {
				if s.Finished {
					progress++
					if _, ok := finishedBy[n+1]; !ok {
						finishedBy[n+1] = int64(s.Token)
					}
				}
				if s.Compensated {
					progress++
				}
			}
			if progress < high {
				fail("%s: progress went back from %d to %d at revision %d (token %d)", key, high, progress, v.rev, v.rec.Token)
			}
			switch {
			case ended != "" && j.State != ended:
				fail("%s: %s at revision %d, then %s at revision %d (token %d): an ended job changed", key, ended, endedAt, j.State, v.rev, v.rec.Token)
			case ended == "" && j.State.Final():
				ended, endedAt = j.State, v.rev
			}
			high = max(high, progress)
		}
		for _, e := range w.events {
			if e.kind == evEffect && (e.via == "job" || e.via == "job-commit") && e.key == key {
				if by, ok := finishedBy[e.step]; ok && e.token > by {
					fail("%s step %d ran again at %d by token %d after token %d finished it", key, e.step, e.seq, e.token, by)
				}
			}
		}
		rec := final[key]
		if rec == nil {
			if vs := hist[key]; len(vs) > 0 {
				if last := vs[len(vs)-1]; last.deleted || last.rec.Expires.Before(w.s.Now()) {
					continue // its retention passed: the job is forgotten, its effects are not
				}
			}
		}
		var j *jobs.Job
		if rec != nil {
			var err error
			if j, err = jobs.FromRecord(rec, w.s.Now()); err != nil {
				fail("%s final record: %v", key, err)
				continue
			}
		}
		for _, c := range []struct {
			what string
			done func(*jobs.Job) bool
		}{
			{"s2", func(j *jobs.Job) bool { return stepOf(j, "s2").Finished }},
			{"s3", func(j *jobs.Job) bool { return w.jobs.tight && stepOf(j, "s3").Finished }},
			{"undo-s1", func(j *jobs.Job) bool { return stepOf(j, "s1").Compensated }},
		} {
			resp, err := w.admin.Get(ctx, w.effectKey(id, c.what))
			if err != nil {
				fail("%s: reading its effect %s: %v", key, c.what, err)
				continue
			}
			exists := len(resp.Kvs) == 1
			writes := int64(0)
			if exists {
				writes = resp.Kvs[0].Version
			}
			if exists && rec != nil && writes == 2 {
				// Written once by an earlier job of the same id (before its
				// retention passed), and once by this one?
				first, err := w.admin.Get(ctx, w.effectKey(id, c.what), clientv3.WithRev(resp.Kvs[0].CreateRevision))
				op := int64(0)
				for _, t := range opStarts[key] {
					if t <= int64(rec.Token) {
						op = max(op, t)
					}
				}
				if err == nil && len(first.Kvs) == 1 {
					if by, err := strconv.ParseInt(string(first.Kvs[0].Value), 10, 64); err == nil && by < op {
						writes = 1
					}
				}
			}
			if exists && rec != nil {
				// Written by an earlier job of the same id (before its
				// retention passed), this one's never was.
				op := int64(0)
				for _, t := range opStarts[key] {
					if t <= int64(rec.Token) {
						op = max(op, t)
					}
				}
				if by, err := strconv.ParseInt(string(resp.Kvs[0].Value), 10, 64); err == nil && by < op {
					exists = false
				}
			}
			switch {
			case exists && writes != 1:
				fail("%s: effect %s written %d times", key, c.what, resp.Kvs[0].Version)
			case j == nil && exists:
				fail("%s: effect %s exists but the job does not", key, c.what)
			case j != nil && exists != c.done(j):
				fail("%s: effect %s exists %v, but the job's final state says done %v (%s)", key, c.what, exists, c.done(j), j.State)
			}
		}
	}
	return bad
}

func stepOf(j *jobs.Job, name string) jobs.StepInfo {
	for _, s := range j.Steps {
		if s.Name == name {
			return s
		}
	}
	return jobs.StepInfo{}
}
