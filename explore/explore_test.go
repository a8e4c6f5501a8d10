package explore

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

var (
	seedFlag      = flag.Uint64("seed", 0, "replay the schedule with this seed (go test ./explore -run TestExplore -seed N)")
	schedulesFlag = flag.Int("schedules", 0, "run this many schedules (default: as many as fit in -budget)")
	budgetFlag    = flag.Duration("budget", 0, "time to explore (default 1m; 30m with IDEM_EXPLORE_SOAK=1)")
	verboseFlag   = flag.Bool("trace", false, "print the trace of every schedule, not only of failing ones")
)

// TestExplore runs schedules until its budget is spent, each from its own
// seed, several at a time (each schedule is deterministic on its own; they
// only share the etcd they run on), and fails with the seed (and the
// schedule's trace) of every schedule that breaks an invariant.
func TestExplore(t *testing.T) {
	if *seedFlag != 0 {
		st, err := runSchedule(*seedFlag)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("seed %d: %s", *seedFlag, st)
		return
	}
	budget := *budgetFlag
	if budget == 0 {
		budget = time.Minute
		if os.Getenv("IDEM_EXPLORE_SOAK") == "1" {
			budget = 30 * time.Minute
		}
	}
	if testing.Short() {
		budget = min(budget, 5*time.Second)
	}
	base := uint64(time.Now().UnixNano())
	deadline := time.Now().Add(budget)
	var (
		mu     sync.Mutex
		total  stats
		n      int
		failed bool
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
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seed, ok := next(); ok; seed, ok = next() {
				st, err := runSchedule(seed)
				mu.Lock()
				total.add(st)
				if err != nil && !failed {
					failed = true
					t.Error(err)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	t.Logf("%d schedules (seeds %d..%d): %s", n, base, base+uint64(n)-1, total)
}

// parallel is how many schedules run at once: each waits on etcd most of
// the time.
const parallel = 6

// stats counts what schedules did.
type stats struct {
	steps, actors, faults, grants, takeovers, effects, refused, results, crashes, closes, sessions, clocks int
	jobSteps, jobsEnded, jobsParked                                                                        int
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
}

func (s stats) String() string {
	return fmt.Sprintf("%d steps, %d actors, %d injected faults, %d claims run (%d takeovers), %d effects (%d refused by fencing), %d answers, %d crashes, %d closes, %d sessions ended, %d clock jumps; jobs: %d step runs, %d ended, %d parked",
		s.steps, s.actors, s.faults, s.grants, s.takeovers, s.effects, s.refused, s.results, s.crashes, s.closes, s.sessions, s.clocks, s.jobSteps, s.jobsEnded, s.jobsParked)
}

// runSchedule runs the schedule of seed and checks its invariants.
func runSchedule(seed uint64) (st stats, err error) {
	w, err := newWorld(seed)
	if err != nil {
		return st, err
	}
	defer w.close()
	type failure struct{ error }
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
	maxActors := 4 + w.rng.IntN(5)
	for step := 0; step < 300; step++ {
		w.observeSessions()
		runnable := w.s.runnable()
		switch r := w.s.rng.Float64(); {
		case st.actors < maxActors && (r < 0.25 || len(runnable) == 0):
			w.spawnActor(st.actors)
			st.actors++
			continue
		case r < 0.125:
			if err := w.nemesis(&st); err != nil {
				fatal("nemesis: %v", err)
			}
			continue
		case r < 0.14:
			w.observe(w.procs[w.s.rng.IntN(len(w.procs))])
			continue
		}
		if len(runnable) == 0 {
			break
		}
		a := runnable[w.s.rng.IntN(len(runnable))]
		if err := w.s.resume(a, true); err != nil {
			fatal("%v", err)
		}
		st.steps++
	}

	// Heal: no more faults; every actor and background write runs to its
	// end.
	w.healed = true
	for i := 0; ; i++ {
		runnable := w.s.runnable()
		if len(runnable) == 0 {
			break
		}
		if i > 20000 {
			var names []string
			for _, a := range runnable {
				names = append(names, a.name)
			}
			fatal("actors still running after healing: %s", strings.Join(names, ", "))
		}
		if err := w.s.resume(runnable[i%len(runnable)], true); err != nil {
			fatal("%v", err)
		}
	}
	w.observeSessions()
	w.observers.Wait()
	stuck := w.drainJobs()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hist, err := w.history(ctx)
	if err != nil {
		fatal("reading the history: %v", err)
	}
	final := map[string]*etcdstore.Record{}
	names := append(append(append([]string{}, storeKeys...), httpKeys...), grpcKeys...)
	for _, id := range jobKeys {
		names = append(names, jobKey(id))
	}
	for _, key := range names {
		if rec, err := w.procs[0].store.Admin.Get(ctx, storeKey(key)); err == nil {
			final[key] = rec
		}
	}
	if bad := append(w.check(hist, final), stuck...); len(bad) > 0 {
		fatal("%d invariants broken:\n  %s", len(bad), strings.Join(bad, "\n  "))
	}
	if *verboseFlag {
		fmt.Printf("seed %d trace:\n%s\n", seed, strings.Join(w.trace, "\n"))
	}
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
	st.faults = w.faults
	return st, nil
}

// nemesis applies one fault to the world.
func (w *world) nemesis(st *stats) error {
	p := w.procs[w.s.rng.IntN(len(w.procs))]
	switch w.s.rng.IntN(6) {
	case 5:
		p.outage = 4 + w.s.rng.IntN(12)
		w.log(event{kind: evClock, proc: p.name, body: fmt.Sprintf("outage of %d calls", p.outage)})
	case 0, 1:
		d := time.Duration(w.s.rng.IntN(15000)) * time.Millisecond
		w.log(event{kind: evClock, body: d.String()})
		w.s.advance(d)
		st.clocks++
	case 2:
		st.sessions++
		return w.endSession(p)
	case 3:
		st.crashes++
		return w.crash(p)
	default:
		st.closes++
		return w.shutdown(p)
	}
	return nil
}
