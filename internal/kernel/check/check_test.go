package check

import (
	"flag"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var (
	maxStates = flag.Int("states", 20_000_000, "explore at most this many states per scope")
	scopeOnly = flag.String("scope", "", "explore only the scopes whose name contains this")
	timeLimit = flag.Duration("budget", 3*time.Minute, "stop after this long, over every scope")
	mustEnd   = flag.Bool("exhaustive", false, "fail unless every scope is explored to its end (CI: scripts/test)")
)

// TestModelCheck explores every scope (Scopes), as many at once as there
// are CPUs, and fails with the path to the first invariant broken. It logs
// each scope's distinct states and whether it was explored exhaustively;
// under the race detector the bound is a tenth.
func TestModelCheck(t *testing.T) {
	deadline := time.Now().Add(*timeLimit)
	states := *maxStates
	if raceOn {
		states /= 10
	}
	var run []Scope
	for _, sc := range Scopes {
		if *scopeOnly == "" || strings.Contains(sc.Name, *scopeOnly) {
			run = append(run, sc)
		}
	}
	results := make([]Result, len(run))
	var stop atomic.Bool // the first violation stops every exploration
	next := make(chan int)
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for i := range next {
				results[i] = ExploreUntil(run[i], states, deadline, &stop)
			}
		})
	}
	for i := range run {
		next <- i
	}
	close(next)
	wg.Wait()
	total, exhaustive := 0, true
	for _, r := range results {
		t.Log(r)
		total += r.States
		exhaustive = exhaustive && r.Complete
	}
	for _, r := range results {
		if r.Violation != nil {
			t.Fatalf("%s: %v", r.Scope, r.Violation)
		}
	}
	t.Logf("%d distinct states in all; every scope exhaustive: %v", total, exhaustive)
	if *mustEnd && !exhaustive {
		t.Fatalf("a scope stopped at its bound (-states %d, -budget %v): the check is not exhaustive", states, *timeLimit)
	}
}
