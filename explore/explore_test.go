package explore

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
)

var (
	seedFlag      = flag.Uint64("seed", 0, "replay the schedule with this seed (go test ./explore -run TestExplore -seed N)")
	schedulesFlag = flag.Int("schedules", 0, "run this many schedules (default: as many as fit in -budget)")
	budgetFlag    = flag.Duration("budget", 0, "time to explore (default 1m, 20s under -short or -race; 30m with IDEM_EXPLORE_SOAK=1)")
	verboseFlag   = flag.Bool("trace", false, "print the trace of every schedule, not only of failing ones")
	ledgerFlag    = flag.Bool("ledger", true, "fail when a path the ledger expects was never reached (only for runs of 4000 schedules or more)")
)

// TestExplore runs schedules until its budget is spent, each from its own
// seed, several at a time (each schedule is deterministic on its own; they
// only share the etcd they run on), and fails with the seed (and the
// schedule's trace) of every schedule that breaks an invariant. It prints
// the coverage ledger: which fault sites fired, which paths of the store
// were reached; and fails when a path it expects was not reached.
func TestExplore(t *testing.T) {
	if *seedFlag != 0 {
		st, led, err := runSchedule(*seedFlag)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("seed %d: %s\n%s", *seedFlag, st, led.summary())
		return
	}
	budget := *budgetFlag
	if budget == 0 {
		budget = time.Minute
		if testing.Short() || raceOn {
			budget = 20 * time.Second
		}
		if os.Getenv("IDEM_EXPLORE_SOAK") == "1" {
			budget = 30 * time.Minute
		}
	}
	base := uint64(time.Now().UnixNano())
	began := time.Now()
	deadline := began.Add(budget)
	var (
		mu     sync.Mutex
		total  stats
		led    = newLedger()
		n      int
		failed bool
		first  string // the first line of the failing schedule's error
		wg     sync.WaitGroup
	)
	next := func() (uint64, bool) {
		mu.Lock()
		defer mu.Unlock()
		if failed || (*schedulesFlag == 0 && !time.Now().Before(deadline)) || (*schedulesFlag > 0 && n >= *schedulesFlag) {
			return 0, false
		}
		n++
		return base + uint64(n-1), true
	}
	stopCompact := compactBehind()
	defer stopCompact()
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seed, ok := next(); ok; seed, ok = next() {
				t0 := time.Now()
				st, l, err := runSchedule(seed)
				if d := time.Since(t0); d > 10*time.Second {
					t.Logf("seed %d took %v", seed, d.Round(time.Millisecond))
				}
				mu.Lock()
				total.add(st)
				if l != nil {
					led.merge(l)
				}
				if err != nil && !failed {
					failed = true
					first, _, _ = strings.Cut(err.Error(), "\n")
					t.Error(err)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	t.Logf("%d schedules in %v (seeds %d..%d): %s", n, time.Since(began).Round(time.Second), base, base+uint64(n)-1, total)
	t.Logf("ledger: %s", led.summary())
	t.Logf("fault sites fired:\n  %s", led.sites())
	if failed {
		// Again, last: CI keeps the tail of a long output, and the trace
		// above may be far from it.
		t.Errorf("a schedule broke an invariant (its trace is above): %s", first)
	}
	if !failed && *ledgerFlag && *schedulesFlag == 0 && n >= ledgerMin {
		var missing []string
		for _, p := range expected {
			if led.get(p) == 0 {
				missing = append(missing, p)
			}
		}
		if len(missing) > 0 {
			t.Errorf("the ledger expects these paths, never reached in %d schedules:\n  %s", n, strings.Join(missing, "\n  "))
		}
	}
}

// ledgerMin is how many schedules a run needs before the ledger holds it
// to the paths it expects: the rarest (an operator cancelling a job, two
// processes racing to publish a dictionary) are reached about once in
// 250-500 schedules, so 4,000 meet each about ten times. (CI's 11 minutes
// run about 4,600 on a 2-core machine.)
const ledgerMin = 4000

// expected lists the paths every run of ledgerMin schedules must reach: a
// part of the store the explorer does not reach is a part it proves
// nothing of.
var expected = []string{
	"path:batch of 2+ writes",
	"path:batch refused and split",
	"path:batch reply lost",
	"path:caller left before its write was sent",
	"path:caller left while its write flew",
	"path:sweep deleted records",
	"path:sweep revoked a lease",
	"path:dictionary published",
	"path:dictionary publish raced",
	"path:dictionary copy deleted with its lease",
	"path:record compressed against a dictionary",
	"path:cache hit",
	"path:cache stale",
	"path:watch broken",
	"path:watch progress answered",
	"path:watch stalled",
	"path:operator evicted a done key",
	"path:lease expired",
	"path:session lost with a final write pending",
	"path:conflict while this process holds the outcome",
	"path:graceful close with a final write pending",
	"path:reaper fenced a claim",
	"path:reaper abandoned its own claim",
	"path:takeover",
	"path:takeover of a dead session's claim",
	"path:takeover past a deadline",
	"path:deadline longer than the retention",
	"path:work ended just before its deadline",
	"path:epoch raised",
	"path:takeover after an epoch raise",
	"path:snapshot",
	"path:restore",
	"path:clock skew",
	"state:abandoned",
	"state:in flight without a session",
	"state:done",
	"state:expired and claimed again",
	"config:shards",
	"path:shard added",
	"path:shard retired",
	"path:shard change taken back",
	"path:shard file rolled back on a process",
	"path:shard cut off",
	"path:one shard snapshotted",
	"path:key handed over (Moved)",
	"path:key claimed on another shard",
	"log:shard set installed",
	"log:shard drained",
	"path:drain deleted an expired record",
	"log:shard hand-over settled",
	"log:the shard set asked for is not in force",
	"path:liveness probe claimed a free key",
	"config:claim deadline on the edges",
	"path:a gRPC handler's context ended before its claim",
	"config:small batches (--batch-max-writes)",
	"path:batch sent beside another once the hold passed",
	"path:full batch sent beside another",
	"config:durable waits",
	"config:per-key limits",
	"path:every slot of a key held at once",
	"path:job held back by a limit",
	"path:job taken in its preferred worker's place",
	"path:limited step committed under its slot",
	"path:rate spaced a key's attempts",
	"path:slot of an earlier attempt retaken",
	"path:occurrence skipped: another ran (skip)",
	"path:occurrence skipped: another ran (buffer-one)",
	"path:buffered occurrence submitted when the previous ended",
	"path:schedule deleted a forgotten job's record before the next occurrence",
	"path:occurrences skipped while paused",
	"path:occurrences that must not overlap checked (skip)",
	"path:occurrences that must not overlap checked (buffer-one)",
	"path:job slept and woke",
	"path:sleep resumed by another process",
	"path:job woken by an event",
	"path:event there before the job waited",
	"path:await timed out",
	"path:event signalled twice",
	"path:event's effect committed with the await's checkpoint",
	"path:signal refused: another payload",
	"path:operator retried a parked job",
	"path:operator cancelled a job",
	"path:operator cancelled a parked job",
	"path:job step ran on a shard set",
	"path:job step ran on its old shard while keys moved",
	"config:durable waits on a shard set",
	"path:event delivered on a shard set",
	"path:schedule ran on a shard set",
	"path:schedule across daylight saving",
	"path:schedule's clocks inside a daylight-saving change",
	// Issue 38: where idem meets what it does not control.
	"path:a proxied takeover after its process died answered the unknown outcome",
	"path:schedule's CatchUp decided the past after an outage",
	"path:a callback panicked: its job failed alone",
	"path:signal in another JSON spelling taken as the same",
	"path:write applied, its reply after the request's timeout",
	"path:placed value (a schedule's cursor) handed over to its new shard",
}

// compactBehind compacts the shared etcd every few seconds, up to the
// oldest revision a running schedule still reads (its history starts
// there): without it, etcd's index grows with every revision of every
// schedule, and every read slows down.
func compactBehind() (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		cli, err := cluster.Client()
		if err != nil {
			return
		}
		defer cli.Close()
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if rev := oldestStart(); rev > 0 {
				cli.Compact(ctx, rev)
			}
		}
	}()
	return func() { cancel(); <-done }
}

var (
	startsMu sync.Mutex
	starts   = map[*world]int64{} // the running schedules' first revisions
)

// oldestStart returns the oldest revision a running schedule reads, or
// etcd's current one when none runs... (0: unknown).
func oldestStart() int64 {
	startsMu.Lock()
	defer startsMu.Unlock()
	oldest := int64(0)
	for _, r := range starts {
		if oldest == 0 || r < oldest {
			oldest = r
		}
	}
	return oldest
}

// parallel is how many schedules run at once: each waits on etcd most of
// the time.
const parallel = 6

// stats counts what schedules did.
type stats struct {
	steps, actors, faults, grants, takeovers, effects, refused, results, crashes, closes, sessions, clocks int
	jobSteps, jobsEnded, jobsParked, restores                                                              int
	simTime                                                                                                time.Duration
}

func (s *stats) add(o stats) {
	s.steps += o.steps
	s.actors += o.actors
	s.faults += o.faults
	s.grants += o.grants
	s.takeovers += o.takeovers
	s.effects += o.effects
	s.refused += o.refused
	s.results += o.results
	s.crashes += o.crashes
	s.closes += o.closes
	s.sessions += o.sessions
	s.clocks += o.clocks
	s.jobSteps += o.jobSteps
	s.jobsEnded += o.jobsEnded
	s.jobsParked += o.jobsParked
	s.restores += o.restores
	s.simTime += o.simTime
}

func (s stats) String() string {
	return fmt.Sprintf("%d steps, %d actors, %d injected faults, %d claims run (%d takeovers), %d effects (%d refused by fencing), %d answers, %d crashes, %d closes, %d sessions ended, %d clock jumps, %d restores, %v of simulated time; jobs: %d step runs, %d ended, %d parked",
		s.steps, s.actors, s.faults, s.grants, s.takeovers, s.effects, s.refused, s.results, s.crashes, s.closes, s.sessions, s.clocks, s.restores, s.simTime.Round(time.Second), s.jobSteps, s.jobsEnded, s.jobsParked)
}

type failure struct{ error }

// runSchedule runs the schedule of seed and checks its invariants.
func runSchedule(seed uint64) (st stats, led *ledger, err error) {
	tw := time.Now()
	w, err := newWorld(seed)
	if err != nil {
		return st, nil, err
	}
	if slowFlag {
		w.ledger.add("time:new world ms", int(time.Since(tw).Milliseconds()))
	}
	defer func() {
		tc := time.Now()
		w.close()
		if slowFlag && led != nil {
			led.add("time:close ms", int(time.Since(tc).Milliseconds()))
		}
	}()
	defer func() {
		if v := recover(); v != nil {
			f, ok := v.(failure)
			if !ok {
				panic(v)
			}
			err = f.error
		}
	}()
	fatal := func(format string, args ...any) {
		panic(failure{fmt.Errorf("seed %d: %s\nreplay: go test ./explore -run TestExplore -seed %d -v\ntrace:\n%s",
			seed, fmt.Sprintf(format, args...), seed, strings.Join(w.trace, "\n"))})
	}
	began := w.s.Now()
	t0 := time.Now()
	w.schedule(&st, fatal)
	t1 := time.Now()
	w.heal(fatal)
	t2 := time.Now()
	if slowFlag {
		defer func() {
			w.ledger.add("time:schedule ms", int(t1.Sub(t0).Milliseconds()))
			w.ledger.add("time:heal ms", int(t2.Sub(t1).Milliseconds()))
			w.ledger.add("time:check ms", int(time.Since(t2).Milliseconds()))
		}()
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hist, err := w.history(ctx)
	if err != nil {
		fatal("reading the history: %v", err)
	}
	final := map[string]*etcdstore.Record{}
	for _, key := range w.keys() {
		if rec, err := w.liveRecord(ctx, storeKey(key)); err == nil {
			final[key] = rec
		}
	}
	if bad := w.check(hist, final); len(bad) > 0 {
		fatal("%d invariants broken:\n  %s", len(bad), strings.Join(bad, "\n  "))
	}
	if *verboseFlag {
		fmt.Printf("seed %d trace:\n%s\n", seed, strings.Join(w.trace, "\n"))
	}
	w.account(&st, final)
	st.simTime = w.s.Now().Sub(began)
	return st, w.ledger, nil
}

// schedule is the schedule proper: actors, faults and the nemesis.
func (w *world) schedule(st *stats, fatal func(string, ...any)) {
	maxActors := 4 + w.rng.IntN(5)
	steps := 300
	for step := 0; step < steps; step++ {
		w.observeSessions()
		runnable := w.s.runnable()
		switch r := w.s.rng.Float64(); {
		case st.actors < maxActors && (r < 0.2 || len(runnable) == 0 && w.clientsDone()):
			w.spawnActor(st.actors)
			st.actors++
			continue
		case r < 0.3:
			if err := w.nemesis(st); err != nil {
				fatal("nemesis: %v", err)
			}
			continue
		case r < 0.36:
			if err := w.pump(false); err != nil {
				fatal("pump: %v", err)
			}
			continue
		case r < 0.37:
			w.observe(w.procs[w.s.rng.IntN(len(w.procs))])
			continue
		}
		if len(runnable) == 0 {
			if !w.idle() {
				break
			}
			continue
		}
		if traceCalls {
			var names []string
			for _, r := range runnable {
				why := "run"
				switch {
				case !r.started:
					why = "new"
				case r.waiting && r.wctx.Err() != nil:
					why = "ctx"
				case r.waiting:
					why = "ready"
				case r.inProc != nil:
					why = "held"
				}
				names = append(names, r.name+"("+why+")")
			}
			w.note("runnable: %s", strings.Join(names, " "))
		}
		a := runnable[w.s.rng.IntN(len(runnable))]
		if err := w.s.resume(a, true); err != nil {
			fatal("%v", err)
		}
		w.afterTurn(a)
		st.steps++
	}
}

// passTime lets time pass as it does while the processes run: up to d,
// but no further than the next timer, which fires; the actors it wakes
// run in the steps that follow, before time moves on.
func (w *world) passTime(d time.Duration) {
	until := w.s.Now().Add(d)
	if at, ok := w.s.next(); ok && at.Before(until) {
		until = at
	}
	w.log(event{kind: evClock, body: until.Sub(w.s.Now()).String()})
	w.s.advanceTo(until)
}

// idle moves the simulated time to the next timer, as time passes when
// nothing runs. It reports false when there is none.
func (w *world) idle() bool {
	at, ok := w.s.next()
	if ok && w.progressWanted() && w.s.rng.IntN(4) != 0 {
		// etcd answers a progress request before time passes (most of
		// the time: the rest, a slow answer): a replay cache proves
		// itself current. (The answer says what etcd had when it was
		// asked: time may pass while the reader takes it.)
		if err := w.pump(false); err != nil {
			panic(failure{fmt.Errorf("seed %d: pump: %w", w.seed, err)})
		}
		w.ledger.hit("path:progress answered before time passed")
	}
	if !ok {
		return false
	}
	w.s.advanceTo(at)
	return true
}

// afterTurn retires a process whose graceful close has finished.
func (w *world) afterTurn(a *actor) {
	if !a.finished || !strings.HasSuffix(a.name, "/close") || a.proc == nil || a.proc.dead {
		return
	}
	p := a.proc
	p.dead = true
	if err := w.retire(p); err != nil {
		panic(failure{fmt.Errorf("seed %d: retiring %s: %w", w.seed, p.name, err)})
	}
}

// clientsDone reports whether every actor but the processes' background
// work has finished.
func (w *world) clientsDone() bool {
	return len(w.s.live(func(a *actor) bool { return !a.bg })) == 0
}

// livenessBound is how long after the faults stop every key must be done
// or free and every job ended or parked, in simulated time: a dead
// session's lease expires (its TTL), a claim's deadline passes (the
// actors' longest is 25 s) or a work sleeping towards its deadline ends
// (lateWork), a final write retried in the background lands
// (its longest backoff, then the end timeout), a claim of unknown outcome
// is reaped (its backoff), each with a request timeout on top.
func (w *world) livenessBound() time.Duration {
	backoff := 100 * time.Millisecond << 6
	return etcdstore.DefaultSessionTTL + max(25*time.Second, lateWork) + etcdstore.DefaultEndTimeout + 2*backoff + 2*etcdstore.DefaultRequestTimeout
}

// healSteps bounds the steps of heal: an actor that keeps running without
// ever waiting for time is a livelock, reported rather than looped on.
const healSteps = 200_000

// heal stops the faults, lets every actor and background write run to its
// end, and checks liveness: within the bound, in simulated time, every key
// is done (and its outcome readable) or free to claim, and every job ended
// or parked.
func (w *world) heal(fatal func(string, ...any)) {
	w.healed = true
	for _, p := range w.procs {
		p.outage = 0
	}
	healedAt := w.s.Now()
	bound := w.livenessBound()
	var drained []string
	drainer, drainerDone := false, false
	lastCheck := time.Time{}
	for i := 0; ; i++ {
		if i%32 == 0 {
			if err := w.pump(false); err != nil {
				fatal("pump: %v", err)
			}
		}
		if !drainer && w.clientsDone() {
			drainer = true
			p := w.procs[0]
			w.s.spawn("drain/jobs", p, false, func(a *actor) {
				drained = append(append(w.drainJobs(a), w.drainWaits(a)...), w.drainLimits(a)...)
				drainerDone = true
			})
		}
		now := w.s.Now()
		if drainerDone && w.clientsDone() && (now.Sub(lastCheck) >= time.Second || !now.Before(healedAt.Add(bound))) {
			// Settled as soon as no key is held by a live session that
			// nobody runs (and the jobs are over): at the latest by the
			// bound.
			lastCheck = now
			if err := w.pump(false); err != nil {
				fatal("pump: %v", err)
			}
			if len(w.stuck()) == 0 && len(w.pendingWrites()) == 0 || !now.Before(healedAt.Add(bound)) {
				break
			}
		}
		if !now.Before(healedAt.Add(bound)) && !w.clientsDone() {
			var names []string
			for _, a := range w.s.live(func(a *actor) bool { return !a.bg }) {
				names = append(names, a.name)
			}
			fatal("liveness: actors still running %v after the faults stopped (bound %v): %s", now.Sub(healedAt), bound, strings.Join(names, ", "))
		}
		runnable := w.s.runnable()
		if i > healSteps {
			var names []string
			for _, a := range runnable {
				names = append(names, a.name)
			}
			fatal("liveness: %d steps after the faults stopped and still runnable, simulated time %v past healing (a loop that never waits): %s (drainer %v, done %v, clients done %v)",
				i, now.Sub(healedAt), strings.Join(names, ", "), drainer, drainerDone, w.clientsDone())
		}
		if len(runnable) == 0 {
			if w.progressWanted() {
				if err := w.pump(false); err != nil {
					fatal("pump: %v", err)
				}
				continue
			}
			at, ok := w.s.next()
			if !ok || at.After(healedAt.Add(bound)) {
				at = healedAt.Add(bound)
			}
			w.s.advanceTo(at)
			continue
		}
		a := runnable[i%len(runnable)]
		if err := w.s.resume(a, true); err != nil {
			fatal("%v", err)
		}
		w.afterTurn(a)
	}
	if err := w.pump(false); err != nil {
		fatal("pump: %v", err)
	}
	w.observers.Wait()
	if bad := append(append(drained, w.stuck()...), w.pendingWrites()...); len(bad) > 0 {
		fatal("liveness: %d keys or jobs not settled %v after the faults stopped (bound %v):\n  %s", len(bad), w.s.Now().Sub(healedAt), bound, strings.Join(bad, "\n  "))
	}
	// What the rules call free can be claimed: tried, by an actor of a
	// live process (invariant 13's last word, checked with the others).
	for _, p := range w.procs {
		if p.dead {
			continue
		}
		probed := false
		w.s.spawn("liveness/probe", p, false, func(a *actor) { w.probe(a, p); probed = true })
		for i := 0; !probed; i++ {
			if i > healSteps {
				fatal("liveness: the probe did not end")
			}
			runnable := w.s.runnable()
			if len(runnable) == 0 {
				at, ok := w.s.next()
				if !ok {
					fatal("liveness: the probe waits for nothing")
				}
				w.s.advanceTo(at)
				continue
			}
			a := runnable[i%len(runnable)]
			if err := w.s.resume(a, true); err != nil {
				fatal("%v", err)
			}
			w.afterTurn(a)
		}
		break
	}
}

// stuck lists the keys that are neither done (with a readable outcome) nor
// free: in flight under a session that is still alive, with nobody running
// them (every actor has finished).
func (w *world) stuck() []string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	live := map[string]string{}
	w.mu.Lock()
	for _, ls := range w.leases {
		if ls.owner != "" {
			live[ls.owner] = fmt.Sprintf("lease %x", int64(ls.id))
		}
	}
	w.mu.Unlock()
	var bad []string
	now := w.s.Now()
	for _, key := range w.keys() {
		rec, err := w.liveRecord(ctx, storeKey(key))
		switch {
		case errors.Is(err, etcdstore.ErrNotFound):
		case err != nil:
			bad = append(bad, fmt.Sprintf("%s: its record cannot be read: %v", key, err))
		case rec.State == etcdstore.InFlight && rec.Owner != "" && !rec.Deadline.IsZero() && !now.Before(rec.Deadline):
		case rec.State == etcdstore.InFlight && live[rec.Owner] != "":
			bad = append(bad, fmt.Sprintf("%s is in flight under the live session %s (%s, token %d) with nobody running it", key, rec.Owner, live[rec.Owner], rec.Token))
		case rec.State == etcdstore.InFlight && rec.Owner == "~deadline":
			bad = append(bad, fmt.Sprintf("%s is in flight without a session, its deadline %v not passed", key, rec.Deadline))
		}
	}
	return bad
}

// keys returns every key the schedule used, as its events name them.
func (w *world) keys() []string {
	seen := map[string]bool{}
	for _, k := range append(append(append([]string{}, storeKeys...), httpKeys...), grpcKeys...) {
		seen[k] = true
	}
	for _, id := range jobKeys {
		seen[jobKey(id)] = true
	}
	if w.durable.on {
		for _, id := range waitKeys {
			seen[jobKey(id)] = true
		}
	}
	if w.limits.on {
		for _, id := range limitKeys {
			seen[jobKey(id)] = true
		}
	}
	w.mu.Lock()
	for _, e := range w.events {
		if e.key != "" {
			seen[e.key] = true
		}
	}
	w.mu.Unlock()
	var out []string
	for k := range seen {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// account adds the schedule's counts to st and the ledger.
func (w *world) account(st *stats, final map[string]*etcdstore.Record) {
	for _, e := range w.events {
		switch e.kind {
		case evGrant:
			st.grants++
			if e.tookOver {
				st.takeovers++
			}
		case evEffect:
			st.effects++
			if strings.HasPrefix(e.via, "job") {
				st.jobSteps++
			}
			if !e.accepted && e.via != "job-commit" {
				st.refused++
			}
		case evResult:
			st.results++
		}
	}
	for _, id := range jobKeys {
		if rec := final[jobKey(id)]; rec != nil {
			if j, err := jobs.FromRecord(rec, w.s.Now()); err == nil && j.State.Final() {
				st.jobsEnded++
			} else if err == nil && j.State == jobs.Parked {
				st.jobsParked++
			}
		}
	}
	st.faults = w.faultCount
	var m etcdstore.Metrics
	for _, x := range w.metrics {
		m = m.Add(x)
	}
	for _, p := range w.procs {
		m = m.Add(p.keys.Metrics())
	}
	l := w.ledger
	l.add("path:batch refused and split", int(m.Batch.Split))
	l.add("path:caller left before its write was sent", int(m.Batch.Left))
	l.add("path:caller left while its write flew", int(m.Batch.Waited))
	l.add("path:batch sent beside another once the hold passed", int(m.Batch.Beside-m.Batch.Full))
	l.add("path:full batch sent beside another", int(m.Batch.Full))
	l.add("path:sweep deleted records", int(m.Sweep.Records))
	l.add("path:sweep revoked a lease", int(m.Sweep.Leases))
	l.add("path:dictionary published", int(m.Dictionaries.Published))
	l.add("path:dictionary publish raced", int(m.Dictionaries.Raced))
	l.add("path:dictionary copy written", int(m.Dictionaries.Copies))
	l.add("path:cache hit", int(m.Cache.Hits))
	l.add("path:cache stale", int(m.Cache.Stale))
	l.add("path:reaped", int(m.Reaped))
	if l.get("log:fenced a claim whose write had an unknown outcome") > 0 {
		l.hit("path:reaper fenced a claim")
	}
	if l.get("log:abandoned a claim whose write had an unknown outcome") > 0 {
		l.hit("path:reaper abandoned its own claim")
	}
	for _, s := range w.cfg.skew {
		if s != 0 {
			l.hit("path:clock skew")
			break
		}
	}
}

// nemesis applies one fault to the world.
func (w *world) nemesis(st *stats) error {
	p := w.procs[w.s.rng.IntN(len(w.procs))]
	switch w.s.rng.IntN(16) {
	case 0, 1, 12, 13:
		// Time passes: timers fire in order, the actors they wake run.
		w.passTime(time.Duration(w.s.rng.IntN(5000)) * time.Millisecond)
		st.clocks++
	case 14:
		// Everything pauses (a stop-the-world pause, a frozen VM): time
		// jumps while no actor runs, past session TTLs and deadlines.
		d := time.Duration(w.s.rng.IntN(15000)) * time.Millisecond
		w.log(event{kind: evClock, body: "pause " + d.String()})
		w.s.advance(d)
		st.clocks++
	case 2:
		// A long pause: buckets end, records expire, and, once the
		// processes run again, their sweeps run; rarely a day, after which
		// dictionaries are refreshed. Sessions do not survive it.
		if w.s.rng.IntN(2) == 0 {
			w.passTime(time.Duration(w.s.rng.IntN(5000)) * time.Millisecond)
			break
		}
		d := time.Duration(20+w.s.rng.IntN(100)) * time.Second
		if w.s.rng.IntN(8) == 0 && (w.sched == nil || !w.sched.inside) {
			d = 24*time.Hour + time.Duration(w.s.rng.IntN(3600))*time.Second
		}
		w.log(event{kind: evClock, body: "pause " + d.String()})
		w.s.advance(d)
		st.clocks++
	case 3:
		st.sessions++
		return w.endSession(p)
	case 4:
		if p.closing || p.dead || w.s.rng.IntN(2) == 0 {
			return nil
		}
		st.crashes++
		return w.crash(p)
	case 5:
		if p.closing || p.dead || w.s.rng.IntN(2) == 0 {
			return nil
		}
		st.closes++
		w.shutdown(p)
	case 6:
		p.outage = 4 + w.s.rng.IntN(12)
		w.log(event{kind: evClock, proc: p.name, body: fmt.Sprintf("outage of %d calls", p.outage)})
	case 7:
		w.ledger.hit("path:watch broken")
		w.note("nemesis: every watch breaks")
		return w.pump(true)
	case 8, 9:
		if w.cfg.shards && !p.dead && !p.closing {
			if w.s.rng.IntN(2) == 0 {
				return w.shardChange()
			}
			w.cutShard(p)
			return nil
		}
		if w.cfg.epochs || w.cfg.shards {
			return w.raiseEpoch(p)
		}
		return w.audit()
	case 10, 11, 15:
		if w.cfg.restores {
			if err := w.snapshotOrRestore(); err != nil {
				return err
			}
			if len(w.restores) > 0 && w.restores[len(w.restores)-1].done {
				st.restores++
			}
			return nil
		}
		return w.audit()
	}
	return nil
}

// endSession revokes p's session lease, as its expiry would after the
// process was cut off: the process learns it at its next renewal.
func (w *world) endSession(p *process) error {
	owners := w.ownersOf(p)
	if len(owners) == 0 || p.dead {
		return nil
	}
	o := owners[w.s.rng.IntN(len(owners))]
	if o == "" {
		return nil
	}
	w.mu.Lock()
	var id int64
	for lid, ls := range w.leases {
		if ls.owner == o {
			id = int64(lid)
		}
	}
	w.mu.Unlock()
	if id == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w.note("nemesis: %s's session %s expires", p.name, o)
	if _, err := w.admin.Revoke(ctx, leaseID(id)); err != nil {
		return err
	}
	w.syncLast()
	w.leaseGone(leaseID(id), "expired (nemesis)")
	return nil
}

// crash stops p as kill -9 would: its actors stop at once, its pending
// writes are lost, and its session lease expires a TTL after its last
// renewal. A new incarnation takes its place.
func (w *world) crash(p *process) error {
	for _, o := range w.ownersOf(p) {
		w.log(event{kind: evCrash, proc: p.name, owner: o})
	}
	p.dead = true
	return w.retire(p)
}

// shutdown closes p as SIGTERM would: an actor of p calls Store.Close,
// which flushes the pending final writes and then revokes the session;
// other actors run meanwhile. Once it has returned, the process is gone.
func (w *world) shutdown(p *process) {
	p.closing = true
	for _, o := range w.ownersOf(p) {
		w.log(event{kind: evClose, proc: p.name, owner: o, task: w.shardOfOwner(p, o)})
	}
	if len(w.s.live(func(a *actor) bool { return a.proc == p && a.bg && isFinalWrite(a.name) })) > 0 {
		w.ledger.hit("path:graceful close with a final write pending")
	}
	w.s.spawn(p.name+"/close", p, false, func(*actor) {
		if err := p.keys.Close(); err != nil {
			w.note("%s: close: %v", p.name, err)
		}
	})
}

// isFinalWrite reports whether a background actor's name is a final write
// retried in the background ("complete <key> <token>", ...).
func isFinalWrite(name string) bool {
	name = name[strings.IndexByte(name, '/')+1:]
	for _, op := range []string{"complete ", "release ", "abandon "} {
		if strings.HasPrefix(name, op) {
			return true
		}
	}
	return false
}

// raiseEpoch raises the shard epoch, as a key moving in from another shard
// of a greater epoch does.
func (w *world) raiseEpoch(p *process) error {
	if p.dead {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	adm := w.decoder
	if w.cfg.shards {
		adm = w.admins()[shardNames[w.s.rng.IntN(len(shardNames))]]
	}
	e, err := storex.BumpEpoch(adm, ctx, 1)
	if err != nil {
		return err
	}
	w.syncLast()
	w.ledger.hit("path:epoch raised")
	w.log(event{kind: evEpoch, body: fmt.Sprint(e)})
	return nil
}

// audit reads every record of the world with an Admin that has met no
// dictionary: a done record whose outcome cannot be read (its dictionary
// gone) breaks "a saved outcome stays readable for its whole retention".
func (w *world) audit() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w.ledger.hit("path:audit")
	prefixes := []string{w.prefix}
	if w.cfg.shards {
		prefixes = nil
		for _, n := range shardNames {
			prefixes = append(prefixes, w.shardPrefix(n))
		}
	}
	for _, prefix := range prefixes {
		adm, err := etcdstore.NewAdmin(w.admin, etcdstore.WithPrefix(prefix))
		if err != nil {
			return err
		}
		_, err = adm.List(ctx, "", etcdstore.ListOptions{Limit: etcdstore.MaxListLimit})
		if errors.Is(err, etcdstore.ErrCorrupt) {
			w.log(event{kind: evUnreadable, body: err.Error()})
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}
