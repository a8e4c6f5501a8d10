package check

import (
	"flag"
	"strings"
	"testing"
	"time"
)

var (
	maxStates = flag.Int("states", 2_000_000, "explore at most this many states per scope")
	scopeOnly = flag.String("scope", "", "explore only the scopes whose name contains this")
	timeLimit = flag.Duration("budget", 3*time.Minute, "stop after this long, over every scope")
)

func TestModelCheck(t *testing.T) {
	deadline := time.Now().Add(*timeLimit)
	total := 0
	for _, sc := range Scopes {
		if *scopeOnly != "" && !strings.Contains(sc.Name, *scopeOnly) {
			continue
		}
		r := Explore(sc, *maxStates, deadline)
		t.Log(r)
		total += r.States
		if r.Violation != nil {
			t.Fatalf("%s: %v", sc.Name, r.Violation)
		}
	}
	t.Logf("%d distinct states in all", total)
}
