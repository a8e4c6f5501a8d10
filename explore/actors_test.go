package explore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/idemgrpc"
	"github.com/idem-dev/idem/idemhttp"
)

// The keys of a schedule: few, so actors contend for them. Store actors
// share one set (their fingerprints agree), the proxy's clients another.
var (
	storeKeys = []string{"k0", "k1", "k2"}
	httpKeys  = []string{"h0", "h1"}
	grpcKeys  = []string{"g0", "g1"}
)

func params(key string, odd bool) []byte {
	if odd {
		return []byte(fmt.Sprintf(`{"key":%q,"odd":true}`, key)) // a reused key: mismatch
	}
	return []byte(fmt.Sprintf(`{"key":%q}`, key))
}

func fingerprint(key string, odd bool) etcdstore.Fingerprint {
	fp, err := etcdstore.FingerprintOf(params(key, odd))
	if err != nil {
		panic(err)
	}
	return fp
}

// body is the outcome a claim saves: it names the claim, so a replay of
// another claim's outcome shows, and it looks like a payment API's answer
// (a few hundred bytes of JSON with the same field names every time), so
// that records are compressed against the shared dictionaries as in
// production.
func body(key string, token int64) []byte {
	return []byte(fmt.Sprintf(`{"id":"ch_%s_%d","object":"charge","amount":%d,"amount_captured":%d,"currency":"usd",`+
		`"captured":true,"status":"succeeded","livemode":false,"paid":true,"refunded":false,"description":"order %s",`+
		`"metadata":{"order_id":"%s","token":"%d"},"payment_method_details":{"type":"card","card":{"brand":"visa",`+
		`"country":"US","exp_month":12,"exp_year":2030,"funding":"credit","last4":"4242"}},"by":"%s by %d"}`,
		key, token, 100+token%900, 100+token%900, key, key, token, key, token))
}

// ownerOf returns the claim named in a body: its key and token, or false.
func ownerOf(b string) (string, int64, bool) {
	i := strings.LastIndex(b, `"by":"`)
	if i < 0 {
		return "", 0, false
	}
	var k string
	var t int64
	if _, err := fmt.Sscanf(strings.TrimSuffix(b[i+6:], `"}`), "%s by %d", &k, &t); err != nil {
		return "", 0, false
	}
	return k, t, true
}

// steps is how many effects a key's work has.
const steps = 3

func lastStep(cp []byte) int {
	n, _ := strconv.Atoi(string(cp))
	return n
}

// spawnActor adds an actor of a random kind.
func (w *world) spawnActor(n int) {
	name := fmt.Sprintf("a%d", n)
	p := w.procs[w.rng.IntN(len(w.procs))]
	if w.sched != nil && w.rng.IntN(8) == 0 {
		w.s.spawn(name+"/pause", p, false, func(a *actor) { w.pauser(a, p) })
		return
	}
	if w.limits.on && w.rng.IntN(4) == 0 {
		w.s.spawn(name+"/limit", p, false, func(a *actor) { w.limitSubmitter(a, p) })
		return
	}
	if w.durable.on && w.rng.IntN(4) == 0 {
		w.s.spawn(name+"/signal", p, false, func(a *actor) { w.signaller(a, p) })
		return
	}
	if cached := w.cachedProcs(); len(cached) > 0 && w.rng.IntN(12) == 0 {
		p := cached[w.rng.IntN(len(cached))]
		w.s.spawn(name+"/evict", p, false, func(a *actor) { w.evictor(a, p) })
		return
	}
	switch w.rng.IntN(8) {
	case 7:
		w.s.spawn(name+"/bulk", p, false, func(a *actor) { w.bulkWorker(a, p) })
		if w.rng.IntN(2) == 0 {
			// A busy service behind a balancer: two processes save outcomes
			// at once, and may race to publish a dictionary.
			q := w.procs[(p.slot+1+w.rng.IntN(len(w.procs)-1))%len(w.procs)]
			w.s.spawn(name+"b/bulk", q, false, func(a *actor) { w.bulkWorker(a, q) })
		}
	case 6:
		w.s.spawn(name+"/grpc", nil, false, func(a *actor) { w.grpcClient(a) })
	case 5:
		if w.cfg.shards && w.cfg.restores {
			// A shard restored alone rolls its jobs back, and not their
			// effects, which the explorer keeps apart from the shards.
			w.s.spawn(name+"/do", p, false, func(a *actor) { w.doWorker(a, p) })
			break
		}
		if w.rng.IntN(3) == 0 {
			// Someone on call retries a parked job, or cancels one.
			w.s.spawn(name+"/operator", p, false, func(a *actor) { w.operator(a, p) })
			break
		}
		w.s.spawn(name+"/job", p, false, func(a *actor) { w.jobWorker(a, p) })
	case 0, 4:
		w.s.spawn(name+"/do", p, false, func(a *actor) { w.doWorker(a, p) })
	case 1:
		w.s.spawn(name+"/steps", p, false, func(a *actor) { w.stepWorker(a, p) })
	case 2:
		w.s.spawn(name+"/api", nil, false, func(a *actor) { w.apiWorker(a) })
	default:
		w.s.spawn(name+"/http", nil, false, func(a *actor) { w.httpClient(a) })
	}
}

// cachedProcs returns the processes with a replay cache.
func (w *world) cachedProcs() []*process {
	var out []*process
	for _, p := range w.procs {
		if w.cfg.cache[p.slot] {
			out = append(out, p)
		}
	}
	return out
}

// evictor is an operator evicting a done key (idem evict), and the
// clients that come back for it through a process with a replay cache:
// what the process replays after the eviction is invariant 3's (the cache
// answers only while it can prove it lags etcd by less than its bound,
// and forgets at once what its own store evicted). Half the time the
// eviction goes through another process while p's watches stall, as
// behind a lagging member: p's cache must stop answering. It stops once
// the faults do (it would outlast the liveness bound, which allows for one
// operation in flight).
func (w *world) evictor(a *actor, p *process) {
	key := storeKeys[w.rng.IntN(len(storeKeys))]
	for round := 0; round < 2 && !w.healed; round++ {
		clock.Sleep(p.clock, a.ctx, time.Duration(1+w.rng.IntN(20))*time.Second)
		// Done through p, and replayed until p's cache answers (its watch
		// brought the record, and it has proved itself current).
		for try := 0; try < 4 && !w.healed; try++ {
			hits := p.keys.Metrics().Cache.Hits
			w.doOps(a, p, 1, key)
			if p.keys.Metrics().Cache.Hits > hits {
				w.ledger.hit("path:replayed from the cache before an eviction")
				break
			}
			clock.Sleep(p.clock, a.ctx, time.Duration(300+w.rng.IntN(1200))*time.Millisecond)
		}
		w.s.step(a)
		ctx, cancel := w.callerCtx(a, p)
		rec, err := p.keys.Get(ctx, etcdstore.Key{ID: key})
		cancel()
		if err != nil || rec.State != etcdstore.Done {
			continue
		}
		q := p
		if w.rng.IntN(2) == 0 {
			q = w.procs[(p.slot+1+w.rng.IntN(len(w.procs)-1))%len(w.procs)]
			p.stalled = w.s.Now().Add(time.Duration(3+w.rng.IntN(30)) * time.Second)
			w.ledger.hit("path:watch stalled")
		}
		w.s.step(a)
		ctx, cancel = w.callerCtx(a, q)
		gone, err := q.keys.EvictIf(ctx, etcdstore.Key{ID: key}, rec.Revision)
		cancel()
		if err != nil || !gone {
			continue
		}
		w.log(event{kind: evEvict, key: key, proc: q.name, actor: a.name})
		w.ledger.hit("path:operator evicted a done key")
		for i := 0; i < 1+w.rng.IntN(3) && (i == 0 || !w.healed); i++ {
			if i > 0 {
				clock.Sleep(p.clock, a.ctx, time.Duration(500+w.rng.IntN(3000))*time.Millisecond)
			}
			w.doOps(a, p, 1, key)
		}
	}
}

// deadline is a session-held claim's deadline: mostly 5-25 s, and a
// quarter of the time longer than retention, the retention of the process
// that claims (its record must live until the deadline, and a retention
// past it).
func (w *world) deadline(retention time.Duration) time.Duration {
	if w.rng.IntN(4) == 0 {
		w.ledger.hit("path:deadline longer than the retention")
		return retention + time.Duration(1+w.rng.IntN(20))*time.Second
	}
	return time.Duration(5+w.rng.IntN(20)) * time.Second
}

// endedEarly notes invariant 17 broken if the work's context ended at the
// claim's deadline (ErrDeadline) before that deadline came, by its
// process's clock: a claim is held until its deadline (its record lives
// that long, and a retention more).
func (w *world) endedEarly(p *process, c *etcdstore.Claim, ctx context.Context, key string) {
	d := c.Deadline()
	if now := p.clock.Now(); !d.IsZero() && errors.Is(context.Cause(ctx), etcdstore.ErrDeadline) && now.Before(d) {
		w.broken = append(w.broken, fmt.Sprintf("%s: the claim of token %d ended (%v) at %s on %s's clock, %v before its deadline %s",
			key, c.Token(), context.Cause(ctx), now.Format("15:04:05.000"), p.name, d.Sub(now), d.Format("15:04:05.000")))
	}
}

// lateWork is the longest a doWorker's work sleeps to end just before its
// deadline: a deadline past a 20 s or 1 min retention is within reach.
const lateWork = 90 * time.Second

// callerCtx is a caller's context: mostly without a deadline, sometimes
// with one on p's clock, so that callers leave while their writes wait for
// a batch or fly.
func (w *world) callerCtx(a *actor, p *process) (context.Context, context.CancelFunc) {
	if w.rng.IntN(4) != 0 {
		return a.ctx, func() {}
	}
	return p.clock.WithTimeout(a.ctx, time.Duration(1+w.rng.IntN(3000))*time.Millisecond)
}

// doWorker runs Do a few times, retrying each operation with the same key.
func (w *world) doWorker(a *actor, p *process) { w.doOps(a, p, 2, "") }

// doOps runs ops operations through p, each on a random key, or on key if
// it is set (its results then name p).
func (w *world) doOps(a *actor, p *process, ops int, fixed string) {
	for op := 0; op < ops; op++ {
		key := fixed
		if key == "" {
			key = storeKeys[w.rng.IntN(len(storeKeys))]
		}
		odd := w.rng.IntN(10) == 0
		policy := []etcdstore.End{etcdstore.EndSave, etcdstore.EndRelease, etcdstore.EndAbandon}[w.rng.IntN(3)]
		fail := w.rng.IntN(6) == 0 // the work fails, after its effects
		checkpoint := w.rng.IntN(2) == 0
		// EndRelease promises that a failed work had no effect (it
		// lets a retry run the work again): this work then fails before
		// its first effect, and saves no checkpoint whose failure could
		// fail it after one.
		early := policy == etcdstore.EndRelease
		checkpoint = checkpoint && !early
		// A slow worker does not notice that its claim was lost: its late
		// effects must be refused by the fenced sink.
		deaf := w.rng.IntN(3) == 0
		late := w.rng.IntN(3) == 0
		opts := []etcdstore.RunOption{etcdstore.OnError(policy)}
		if w.rng.IntN(3) == 0 {
			opts = append(opts, etcdstore.WithDeadline(w.deadline(p.retention)))
		}
		for try := 0; try < 4; try++ {
			w.s.step(a)
			ctx, cancel := w.callerCtx(a, p)
			var token int64
			attempt := w.nextAttempt()
			from := w.latest()
			sent := w.s.Now()
			res, err := p.keys.Do(ctx, etcdstore.Key{ID: key}, params(key, odd), func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
				token = int64(c.Token())
				start := lastStep(c.LastCheckpoint())
				w.log(event{kind: evGrant, key: key, token: token, attempt: c.Attempt(), proc: p.name, actor: a.name, tookOver: c.TookOver(), step: start, via: "do"})
				// The hold ends when the work returns: it acts no more, and
				// Do only writes how the claim ends (saved, released, or
				// abandoned; a release of a claim that took the key over
				// is an abandon, which frees the key at once). An outcome
				// whose save is still pending keeps the key held: the
				// check follows the background write for that.
				defer w.log(event{kind: evHoldEnd, key: key, token: token, actor: a.name})
				if fail && early {
					return nil, errors.New("the work failed before its first effect")
				}
				for st := start + 1; st <= steps; st++ {
					w.s.step(a)
					if ctx.Err() != nil && !deaf {
						w.endedEarly(p, c, ctx, key)
						return nil, ctx.Err()
					}
					w.effect(key, st, token, a, !deaf)
					if checkpoint && st < steps {
						w.s.step(a)
						if err := c.Checkpoint(ctx, []byte(strconv.Itoa(st))); err != nil {
							return nil, err
						}
					}
				}
				if fail {
					return nil, errors.New("the work failed after its effects")
				}
				if late && !c.Deadline().IsZero() {
					// The work ends just before its deadline: its outcome
					// is saved across it.
					// (Up to lateWork: the liveness bound allows for it.)
					// A work that heeds its context stops sleeping when
					// the claim is lost, and returns its outcome all the
					// same: its effects are made.
					if d := c.Deadline().Sub(p.clock.Now()) - time.Duration(10+w.rng.IntN(2000))*time.Millisecond; d > 0 && d <= lateWork {
						w.ledger.hit("path:work ended just before its deadline")
						sctx := ctx
						if deaf {
							sctx = a.ctx
						}
						clock.Sleep(p.clock, sctx, d)
						if !deaf && ctx.Err() != nil {
							w.endedEarly(p, c, ctx, key)
						}
					}
				}
				return body(key, token), nil
			}, append(opts, etcdstore.WithAttempt(attempt))...)
			cancel()
			if token == 0 { // never granted: the error is the claim's
				w.notSent(key, attempt, true, from, err)
			}
			w.resultIn(a, p, fixed != "", key, sent, res.Body, res.Replayed, err)
			w.notePending(p, key, err)
			if err == nil || errors.Is(err, etcdstore.ErrMismatch) || !retryable(err) {
				break
			}
		}
	}
}

// notSent logs a claim that failed with ErrNotSent (it never left the
// process: no record of attempt may be written after from, the world's
// latest write when the call began: invariant 16), and returns the
// attempt id to retry with: a fresh one then, as a client that was told
// its request was not sent may use.
func (w *world) notSent(key, attempt string, first bool, from int64, err error) string {
	if !errors.Is(err, etcdstore.ErrNotSent) {
		return attempt
	}
	if first {
		// An earlier call with the attempt id may still land; a first one
		// is the only writer of its attempt.
		w.log(event{kind: evNotSent, key: key, attempt: attempt, token: from, err: err.Error()})
	}
	return w.nextAttempt()
}

// latest returns the world's latest write: a call that starts now writes
// after it.
func (w *world) latest() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastWrite
}

func retryable(err error) bool {
	return errors.Is(err, etcdstore.ErrConflict) || errors.Is(err, etcdstore.ErrUnavailable) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// effect applies a step's effect at the fenced sink. heeds says the actor
// checked, with no turn in between, that its claim was still held (its
// context, or Claim.Err): the claim must then not have ended by what its
// process knew (invariant 13).
func (w *world) effect(key string, step int, token int64, a *actor, heeds bool) {
	accepted := w.sink.apply(key, step, token, a.name)
	proc := ""
	if a.proc != nil {
		proc = a.proc.name
	}
	w.log(event{kind: evEffect, key: key, step: step, token: token, accepted: accepted, actor: a.name, proc: proc, heeds: heeds})
}

// result logs what a caller got for key.
//
// sent is when the call that answered was made: an outcome saved after
// it may have expired, and the key been claimed again, by the time the
// answer arrives (a reply held in the network), and the answer is still
// true.
func (w *world) result(a *actor, key string, sent time.Time, out []byte, replayed bool, err error) {
	w.resultIn(a, nil, false, key, sent, out, replayed, err)
}

// resultIn is result, naming the process that answered when named is set.
func (w *world) resultIn(a *actor, p *process, named bool, key string, sent time.Time, out []byte, replayed bool, err error) {
	e := event{kind: evResult, key: key, actor: a.name, body: string(out), replayed: replayed, sent: sent}
	if named {
		e.proc = p.name
	}
	if err != nil {
		e.err = err.Error()
		if errors.Is(err, etcdstore.ErrMismatch) {
			e.mismatch = true
		}
	}
	w.log(e)
}

// stepWorker claims, runs the steps left after the last checkpoint, and
// completes, retrying its writes with the same claim; it always ends the
// claim it holds.
func (w *world) stepWorker(a *actor, p *process) {
	key := storeKeys[w.rng.IntN(len(storeKeys))]
	fp := fingerprint(key, false)
	attempt, first := w.nextAttempt(), true
	var opts []etcdstore.ClaimOption
	if w.rng.IntN(2) == 0 {
		opts = append(opts, etcdstore.WithDeadline(w.deadline(p.retention)))
	}
	// A client behind a load balancer retries its claim, with the same
	// attempt id, through another process.
	migrate := w.rng.IntN(3) == 0
	var c *etcdstore.Claim
	for try := 0; try < 4 && c == nil; try++ {
		w.s.step(a)
		if migrate && try > 0 {
			// The worker now runs in that process: it dies with it.
			p = w.procs[w.rng.IntN(len(w.procs))]
			a.proc = p
		}
		var done *etcdstore.Record
		var err error
		ctx, cancel := w.callerCtx(a, p)
		from, sent := w.latest(), w.s.Now()
		c, done, err = p.keys.Claim(ctx, etcdstore.Key{ID: key}, fp, append(opts, etcdstore.WithAttempt(attempt))...)
		cancel()
		if next := w.notSent(key, attempt, first, from, err); next != attempt {
			attempt, first = next, true
		} else {
			first = false
		}
		switch {
		case done != nil:
			w.result(a, key, sent, done.Outcome.Body, true, nil)
			return
		case err != nil && !retryable(err):
			w.result(a, key, sent, nil, false, err)
			return
		}
	}
	if c == nil {
		return
	}
	w.run(a, p, key, c, "steps")
}

// run does a claim's steps and ends it; each write goes through p, or, for
// a worker-API claim, through the process pick chooses per call (Attach).
func (w *world) run(a *actor, p *process, key string, c *etcdstore.Claim, via string) {
	token := int64(c.Token())
	start := lastStep(c.LastCheckpoint())
	w.log(event{kind: evGrant, key: key, token: token, attempt: c.Attempt(), proc: p.name, actor: a.name, tookOver: c.TookOver(), step: start, via: via})
	defer w.log(event{kind: evHoldEnd, key: key, token: token, actor: a.name})
	// write retries op; a try told ErrNotSent is held to it (invariant
	// 16), unless an earlier try of this claim's writes may have landed
	// (and could land in its window).
	maybe := false
	write := func(what string, step int, op func(*etcdstore.Claim, context.Context) error) error {
		var err error
		for try := 0; try < 4; try++ {
			w.s.step(a)
			h := c
			if via == "api" {
				if h, _, err = w.attach(a, c); err != nil {
					if errors.Is(err, etcdstore.ErrFenced) || !retryable(err) {
						return err
					}
					continue
				}
			}
			from := w.latest()
			err = op(h, a.ctx)
			switch {
			case errors.Is(err, etcdstore.ErrNotSent) && !maybe:
				w.log(event{kind: evWriteNotSent, key: key, token: token, step: step, body: what, err: err.Error(), from: from, to: w.latest()})
			case err != nil && !errors.Is(err, etcdstore.ErrNotSent):
				maybe = true
			}
			if err == nil || !retryable(err) {
				return err
			}
		}
		return err
	}
	deaf := w.rng.IntN(3) == 0 // a slow worker, which does not notice a lost claim
	for st := start + 1; st <= steps; st++ {
		w.s.step(a)
		if c.Err() != nil && via != "api" && !deaf {
			break // lost: its session ended or its deadline passed
		}
		w.effect(key, st, token, a, via != "api" && !deaf)
		if st == steps {
			break
		}
		if err := write("checkpoint", st, func(h *etcdstore.Claim, ctx context.Context) error {
			if via == "api" && w.rng.IntN(3) == 0 {
				if err := h.Renew(ctx, 20*time.Second); err != nil {
					return err
				}
			}
			return h.Checkpoint(ctx, []byte(strconv.Itoa(st)))
		}); err != nil {
			if !retryable(err) {
				return // fenced: another owner has it
			}
			break
		}
	}
	out := body(key, token)
	giveUp := c.Err() != nil && via != "api"
	if giveUp {
		w.log(event{kind: evHoldEnd, key: key, token: token, actor: a.name})
	}
	outcome := etcdstore.Outcome{Body: out}
	if w.rng.IntN(2) == 0 {
		// A header of values, and a name without any (which a record
		// does not keep).
		outcome.Header = map[string][]string{"X-Steps": {strconv.Itoa(steps)}, "X-None": {}}
	}
	what := "complete"
	if giveUp {
		what = "abandon"
	}
	sent := w.s.Now()
	err := write(what, 0, func(h *etcdstore.Claim, ctx context.Context) error {
		if giveUp {
			return h.Abandon(ctx)
		}
		return h.Complete(ctx, outcome)
	})
	if err != nil && !giveUp && via == "api" && errors.Is(err, etcdstore.ErrFenced) {
		// As the worker API answers a Complete retried after a lost reply:
		// the handle no longer attaches, but the record may show this very
		// claim's outcome saved.
		ctx, cancel := w.callerCtx(a, p)
		rec, gerr := p.keys.Get(ctx, etcdstore.Key{ID: key})
		cancel()
		switch {
		case gerr != nil && !errors.Is(gerr, etcdstore.ErrNotFound):
			return // unknown, as the worker API would answer (503)
		case gerr == nil && int64(rec.Token) == token && rec.State == etcdstore.Done && string(rec.Outcome.Body) == string(out):
			err = nil
		}
	}
	if err == nil && !giveUp {
		w.result(a, key, sent, out, false, nil) // the Complete landed
		return
	}
	if !giveUp && (errors.Is(err, etcdstore.ErrClaimEnded) || errors.Is(err, etcdstore.ErrFenced)) {
		w.log(event{kind: evNotSaved, key: key, token: token, proc: p.name, actor: a.name, via: via, body: string(out), err: err.Error()})
	}
	if retryable(err) {
		// Could not end it: give it up for the next claimant.
		w.log(event{kind: evHoldEnd, key: key, token: token, actor: a.name})
		w.write(a, p, c, via, func(h *etcdstore.Claim, ctx context.Context) error { return h.Abandon(ctx) })
	}
}

// write makes one best-effort write for run's last resort.
func (w *world) write(a *actor, p *process, c *etcdstore.Claim, via string, op func(*etcdstore.Claim, context.Context) error) {
	for try := 0; try < 8; try++ {
		w.s.step(a)
		h := c
		if via == "api" {
			var err error
			if h, _, err = w.attach(a, c); err != nil {
				if !retryable(err) {
					return
				}
				continue
			}
		}
		if err := op(h, a.ctx); err == nil || !retryable(err) {
			return
		}
	}
}

// attach finds c's claim through a process the worker picks, as the worker
// API does for every call after the claim.
func (w *world) attach(a *actor, c *etcdstore.Claim) (*etcdstore.Claim, *process, error) {
	q := w.procs[w.rng.IntN(len(w.procs))]
	h, err := q.keys.Attach(a.ctx, c.Handle())
	return h, q, err
}

// apiWorker is a remote worker of the worker API: it claims without a
// session, with its own attempt id, through any process, retries the claim
// with the same attempt through another when it gets an error, and carries
// the claim between processes by its handle.
func (w *world) apiWorker(a *actor) {
	key := storeKeys[w.rng.IntN(len(storeKeys))]
	fp := fingerprint(key, false)
	// Without a session, only the deadline frees the key of a worker that
	// died: short ones (the liveness bound allows for 25 s).
	opts := []etcdstore.ClaimOption{etcdstore.WithoutSession(), etcdstore.WithDeadline(time.Duration(5+w.rng.IntN(20)) * time.Second)}
	attempt, first := w.nextAttempt(), true
	var c *etcdstore.Claim
	var p *process
	for try := 0; try < 4 && c == nil; try++ {
		w.s.step(a)
		p = w.procs[w.rng.IntN(len(w.procs))]
		var done *etcdstore.Record
		var err error
		from, sent := w.latest(), w.s.Now()
		c, done, err = p.keys.Claim(a.ctx, etcdstore.Key{ID: key}, fp, append(opts, etcdstore.WithAttempt(attempt))...)
		if next := w.notSent(key, attempt, first, from, err); next != attempt {
			attempt, first = next, true
		} else {
			first = false
		}
		switch {
		case done != nil:
			w.result(a, key, sent, done.Outcome.Body, true, nil)
			return
		case err != nil && !retryable(err):
			w.result(a, key, sent, nil, false, err)
			return
		}
	}
	if c == nil {
		return
	}
	w.run(a, p, key, c, "api")
}

// httpClient sends requests through a process's proxy, retrying with the
// same key while it gets no answer, a 409 or a 503.
func (w *world) httpClient(a *actor) {
	for op := 0; op < 2; op++ {
		key := httpKeys[w.rng.IntN(len(httpKeys))]
		behaviour := []string{"ok", "ok", "ok", "ok", "cut", "drop", "timeout", "refuse", "fail", "busy"}[w.rng.IntN(10)]
		for try := 0; try < 4; try++ {
			w.s.step(a)
			p := w.procs[w.rng.IntN(len(w.procs))]
			sent := w.s.Now()
			status, out, replayed := w.send(a, p, key, behaviour)
			w.log(event{kind: evResult, key: key, actor: a.name, status: status, body: out, replayed: replayed, via: "proxy", sent: sent, proc: p.name})
			if status == http.StatusBadGateway && strings.Contains(out, "was cut short") && !replayed {
				// Issue 38: a process died mid-forward; the takeover
				// answered the unknown outcome instead of forwarding again.
				w.ledger.hit("path:a proxied takeover after its process died answered the unknown outcome")
			}
			if status == http.StatusConflict {
				w.notePending(p, key, etcdstore.ErrConflict)
			}
			if status != 0 && status != http.StatusConflict && status != http.StatusServiceUnavailable && status != http.StatusTooManyRequests &&
				!(status == http.StatusBadGateway && strings.Contains(out, idemhttp.KindUpstreamUnavailable)) {
				break
			}
		}
	}
}

// send runs one request through p's proxy, in the actor's own goroutine.
// It returns status 0 when the connection was broken off.
func (w *world) send(a *actor, p *process, key, behaviour string) (status int, out string, replayed bool) {
	ctx := context.WithValue(a.ctx, http.ServerContextKey, &http.Server{}) // as a real server's request
	req := httptest.NewRequestWithContext(ctx, "POST", "http://idem/charge", strings.NewReader(string(params(key, false))))
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(hdrBehaviour, behaviour)
	rec := httptest.NewRecorder()
	aborted := func() (aborted bool) {
		defer func() {
			if v := recover(); v != nil {
				if v != http.ErrAbortHandler { //nolint:errorlint // a sentinel panic value
					panic(v)
				}
				aborted = true
			}
		}()
		p.proxy.ServeHTTP(rec, req)
		return false
	}()
	if aborted {
		return 0, "", false
	}
	b, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(b), rec.Header().Get(idemhttp.HeaderReplayed) == "true"
}

// observe starts a read-only Wait on a key, for a few seconds: its answer
// is checked at the end.
func (w *world) observe(p *process) {
	key := storeKeys[w.rng.IntN(len(storeKeys))]
	w.s.spawn(fmt.Sprintf("o%d/wait", w.seq), p, false, func(a *actor) {
		ctx, cancel := p.clock.WithTimeout(a.ctx, time.Duration(1+w.rng.IntN(10))*time.Second)
		defer cancel()
		rec, err := p.keys.Wait(ctx, etcdstore.Key{ID: key})
		if err != nil || rec.State != etcdstore.Done {
			return
		}
		w.mu.Lock()
		w.waits = append(w.waits, event{kind: evResult, key: key, actor: a.name, body: string(rec.Outcome.Body), replayed: true, via: "wait"})
		w.mu.Unlock()
	})
}

// grpcClient calls a process's idemgrpc interceptor (in-process, as grpc-go
// would), retrying with the same key while the answer says to: ABORTED
// (in flight), UNAVAILABLE, or the handler's NOT_EXECUTED. The handler has
// an effect per run, then answers, fails after its effect, or says it did
// nothing before any.
func (w *world) grpcClient(a *actor) {
	slept := false // a slow handler of this actor has slept
	for op := 0; op < 2; op++ {
		key := grpcKeys[w.rng.IntN(len(grpcKeys))]
		behaviour := []string{"ok", "ok", "ok", "fail", "notexec", "slow"}[w.rng.IntN(6)]
		for try := 0; try < 4; try++ {
			w.s.step(a)
			p := w.procs[w.rng.IntN(len(w.procs))]
			ctx := metadata.NewIncomingContext(a.ctx, metadata.Pairs(idemgrpc.MetadataKey, key))
			var ran bool
			handler := func(ctx context.Context, req any) (any, error) {
				tok, _ := fencing.FromContext(ctx)
				ran = true
				w.log(event{kind: evGrant, key: key, token: int64(tok), proc: p.name, actor: a.name, via: "grpc"})
				defer w.log(event{kind: evHoldEnd, key: key, token: int64(tok), actor: a.name, via: "grpc"})
				if behaviour == "notexec" {
					return nil, idemgrpc.NotExecuted(codes.Unavailable, "busy", 0)
				}
				heeds := false
				if behaviour == "slow" {
					// A slow handler that heeds its context: it acts only
					// before its claim's deadline (invariant 13; idemgrpc
					// ends the context before it). A lost session does not
					// end the context: the handler runs to its end.
					// (Once per actor, up to lateWork: the liveness bound
					// allows for it.)
					w.s.step(a)
					if !slept {
						slept = true
						clock.Sleep(p.clock, ctx, time.Duration(w.rng.IntN(int(lateWork/time.Second)))*time.Second)
					}
					w.s.step(a)
					if err := ctx.Err(); err != nil {
						// (The context is not the caller's: only the
						// claim's end, or HandlerTimeout, ends it.)
						w.ledger.hit("path:a gRPC handler's context ended before its claim")
						return nil, idemgrpc.NotExecuted(codes.Unavailable, "gave up before acting: "+err.Error(), 0)
					}
					heeds = true
				}
				accepted := w.sink.apply(key, 1, int64(tok), "grpc")
				w.log(event{kind: evEffect, key: key, step: 1, token: int64(tok), accepted: accepted, via: "grpc", actor: a.name, proc: procOf(heeds, p), heeds: heeds, deadlineOnly: heeds})
				if behaviour == "fail" {
					return nil, status.Error(codes.Internal, fmt.Sprintf("%s failed after its effect under %d", key, tok))
				}
				return wrapperspb.String(string(body(key, int64(tok)))), nil
			}
			sent := w.s.Now()
			resp, err := p.unary(ctx, wrapperspb.String(string(params(key, false))), &grpc.UnaryServerInfo{FullMethod: "/explore.Payments/Charge"}, handler)
			st := status.Convert(err)
			out := st.Message()
			if err == nil {
				out = resp.(*wrapperspb.StringValue).GetValue()
			}
			w.log(event{kind: evResult, key: key, actor: a.name, status: int(st.Code()), body: out, replayed: err == nil && !ran, via: "grpc", sent: sent, proc: p.name})
			if c := st.Code(); c != codes.Aborted && c != codes.Unavailable {
				break
			}
		}
	}
}

// grpcAnswer is what a saved gRPC outcome answers: the status code and the
// response's value, or the status message.
func grpcAnswer(o *etcdstore.Outcome) (codes.Code, string) {
	var st spb.Status
	if o.Status < 1000 || proto.Unmarshal(o.Body, &st) != nil {
		return codes.Unknown, fmt.Sprintf("not a gRPC outcome: %d %q", o.Status, o.Body)
	}
	if codes.Code(st.Code) != codes.OK || len(st.Details) != 1 {
		return codes.Code(st.Code), st.Message
	}
	var v wrapperspb.StringValue
	if err := st.Details[0].UnmarshalTo(&v); err != nil {
		return codes.Unknown, err.Error()
	}
	return codes.OK, v.GetValue()
}

// bulkWorker saves outcomes of many keys of its own through one process,
// one after another, as a busy service does: enough for its process to
// publish a compression dictionary (and for two processes to race at it),
// and for group commit to have writes to batch.
func (w *world) bulkWorker(a *actor, p *process) {
	n := 16 + w.rng.IntN(16)
	for i := range n {
		key := fmt.Sprintf("b%d-%d", w.rng.IntN(1<<20), i)
		w.s.step(a)
		ctx, cancel := w.callerCtx(a, p)
		var token int64
		sent := w.s.Now()
		res, err := p.keys.Do(ctx, etcdstore.Key{ID: key}, params(key, false), func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
			token = int64(c.Token())
			w.log(event{kind: evGrant, key: key, token: token, attempt: c.Attempt(), proc: p.name, actor: a.name, tookOver: c.TookOver(), via: "bulk"})
			defer w.log(event{kind: evHoldEnd, key: key, token: token, actor: a.name})
			w.effect(key, 1, token, a, false)
			return body(key, token), nil
		})
		cancel()
		w.result(a, key, sent, res.Body, res.Replayed, err)
	}
}

// notePending notes in the ledger a conflict that p answered for key while
// it held the key's outcome, its final write pending.
func (w *world) notePending(p *process, key string, err error) {
	if !errors.Is(err, etcdstore.ErrConflict) {
		return
	}
	task := "complete " + storeKey(key).String() + " "
	if len(w.s.live(func(a *actor) bool {
		return a.proc == p && a.bg && strings.HasPrefix(a.name[strings.IndexByte(a.name, '/')+1:], task)
	})) > 0 {
		w.ledger.hit("path:conflict while this process holds the outcome")
	}
}

// procOf is the process an effect is judged against (invariant 13), for an
// actor that heeds its claim; "" for one that does not.
func procOf(heeds bool, p *process) string {
	if heeds {
		return p.name
	}
	return ""
}
