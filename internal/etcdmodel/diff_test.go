package etcdmodel

import (
	"flag"
	"fmt"
	"strings"
	"testing"
	"time"
)

var seedFlag = flag.Int64("seed", 0, "seed of the differential test's random runs (0: from the time)")

// TestDifferential runs random steps on the model and on a real etcd, each
// run on a fresh member, and compares after every step the errors, the
// responses (Succeeded, header revision, every result with every field of
// every key) and, every few steps and after every refused one, the whole
// state: revision, keys, leases and their keys.
func TestDifferential(t *testing.T) {
	seed := *seedFlag
	if seed == 0 {
		seed = time.Now().UnixNano()
	}
	t.Logf("seed %d (replay with -seed=%d)", seed, seed)
	runs, steps := 6, 1000
	if raceOn {
		steps = 500
	}
	if testing.Short() {
		runs = 1
	}
	for i := range runs {
		t.Run(fmt.Sprint("run", i), func(t *testing.T) { run(t, seed, seed+int64(i), steps) })
	}
}

// run runs steps random steps from seed; on a difference it fails with the
// steps that led to it.
func run(t *testing.T, base, seed int64, steps int) {
	const prefix = "/m/"
	p := newPair(t, prefix)
	g := newGen(seed, p.m, prefix)
	var history []string
	seen := map[string]int{}
	defer func() { t.Logf("run seed %d: %v", seed, seen) }()
	for i := range steps {
		s := g.step()
		history = append(history, fmt.Sprintf("%4d %v", i, s))
		rev := p.m.Rev()
		err := p.do(s)
		seen[outcome(p, s, rev)]++
		if err == nil && (i%10 == 9 || i == steps-1) {
			err = p.sameState()
		}
		if err != nil {
			t.Fatalf("seed %d (run seed %d), step %d: %v\nreplay with -seed=%d; the last steps:\n%s",
				base, seed, i, err, base, strings.Join(history[max(0, len(history)-15):], "\n"))
		}
	}
}

// outcome names what a step did, for the run's tally: which checks a run
// reached (refusals by error, branches, no-op Txns).
func outcome(p *pair, s step, rev int64) string {
	name := []string{"txn", "grant", "revoke", "keepalive", "keys"}[s.kind]
	if p.last.err != nil {
		return name + ": " + p.last.err.Error()
	}
	if s.kind != stepTxn {
		return name
	}
	branch := "then"
	if !p.last.resp.Succeeded {
		branch = "else"
	}
	if p.m.Rev() == rev {
		branch += ", no change"
	}
	return name + " " + branch
}
