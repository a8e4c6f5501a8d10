package explore

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// What varies between two runs of one seed and is no part of its schedule:
// etcd's revisions (the shared etcd serves other schedules meanwhile),
// hence tokens and lease ids, and the random ids of sessions, attempts and
// dictionaries.
var (
	numbers = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[A-Z2-7]{26}|[0-9]+|[0-9a-f]{16}`)
	bodies  = regexp.MustCompile(`body="(?:[^"\\]|\\.)*"?`) // cut at a length that depends on the numbers in it
)

func normalized(trace []string) string {
	var b strings.Builder
	for _, l := range trace {
		b.WriteString(numbers.ReplaceAllString(bodies.ReplaceAllString(l, "body=…"), "#"))
		b.WriteByte('\n')
	}
	return b.String()
}

// A seed replays its schedule exactly: the same actors at the same steps,
// the same faults at the same calls, the same events.
func TestReplayIsExact(t *testing.T) {
	seeds := []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	if one := os.Getenv("IDEM_EXPLORE_REPLAY_SEED"); one != "" {
		k, _ := strconv.ParseUint(one, 10, 64)
		seeds = []uint64{k, k, k, k, k, k}
	} else if n := os.Getenv("IDEM_EXPLORE_REPLAYS"); n != "" {
		k, _ := strconv.Atoi(n)
		seeds = nil
		for i := range k {
			seeds = append(seeds, uint64(1000+i))
		}
	}
	if testing.Short() || raceOn {
		seeds = seeds[:min(len(seeds), 4)]
	}
	// Several at once, as TestExplore runs them: what real time does under
	// load must not change a schedule.
	var wg sync.WaitGroup
	errs := make(chan error, len(seeds))
	sem := make(chan struct{}, parallel)
	for _, seed := range seeds {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := replayTwice(seed); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// replayTwice runs seed's schedule twice and reports where they differ.
func replayTwice(seed uint64) error {
	var traces [2]string
	var wg sync.WaitGroup
	var err error
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w, e := newWorld(seed)
			if e != nil {
				err = e
				return
			}
			func() {
				defer w.close()
				defer func() {
					if v := recover(); v != nil {
						if _, ok := v.(failure); !ok {
							panic(v)
						}
					}
				}()
				fatal := func(format string, args ...any) { panic(failure{}) }
				var st stats
				w.schedule(&st, fatal)
				w.heal(fatal)
			}()
			traces[i] = normalized(w.trace)
		}()
	}
	wg.Wait()
	if err != nil {
		return err
	}
	if traces[0] == traces[1] {
		return nil
	}
	a, b := strings.Split(traces[0], "\n"), strings.Split(traces[1], "\n")
	for i := 0; i < min(len(a), len(b)); i++ {
		if a[i] != b[i] {
			from := max(0, i-3)
			if os.Getenv("IDEM_EXPLORE_REPLAY_SEED") != "" {
				os.WriteFile(fmt.Sprintf("/tmp/replay-%d-a.txt", seed), []byte(traces[0]), 0o644)
				os.WriteFile(fmt.Sprintf("/tmp/replay-%d-b.txt", seed), []byte(traces[1]), 0o644)
			}
			return fmt.Errorf("seed %d replays differently from line %d:\n  first:\n%s\n  second:\n%s", seed, i,
				strings.Join(a[from:min(len(a), i+3)], "\n"), strings.Join(b[from:min(len(b), i+3)], "\n"))
		}
	}
	return fmt.Errorf("seed %d replays differently: %d lines, then %d", seed, len(a), len(b))
}
