package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/google/pprof/profile"
)

const benchUsage = `usage: idem-bench [flags]

Measures idem against what it is built on and against the peers a user would
pick instead, each comparison in one run (sides interleaved, so drift hits
both), and reports the ratios. Without --endpoints it starts embedded etcd
clusters (fsync on) in a temporary directory.

Suites (--suite, comma-separated):
  do      idem Do against the raw claim + fenced complete Txn pair (1 and 3 members)
  replay  replay of done keys against a raw linearizable Get; with the cache
  mix     50% retries and fresh claims, against PostgreSQL (--pg) when given
  mutex   idem Do against the lock-then-check approach with concurrency.Mutex
  http    the HTTP proxy against the library call and the upstream called directly
  scale   throughput and size with 10k, 100k and 1M retained keys; bucket expiry
  wan     3 members 50 ms apart: claim latency against one raft round
  shards  Do on one store against shard.Store over 3 one-member clusters
  expiry  keys written at a steady rate expire under a claim load: p99 and the longest stall

Flags:
`

// benchConfig is what idem-bench is told.
type benchConfig struct {
	etcd                         etcdFlags
	suites                       listFlag
	redis                        listFlag
	members                      listFlag
	concurrency                  int
	duration                     time.Duration
	ops                          int
	rounds                       int
	keys                         int
	payload                      int
	body                         string
	recordFormat                 int
	retries                      float64
	duplicates                   float64
	target                       string
	pg                           string
	scaleKeys                    listFlag
	jsonOut                      bool
	histogram                    bool
	fsync                        bool
	clientCPU                    bool
	batching                     bool
	sweep                        bool
	expiryKeys                   int
	expiryRate                   int
	expiryRetention, expiryWidth time.Duration
}

func bench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c benchConfig
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, benchUsage); fs.PrintDefaults() }
	c.etcd.register(fs)
	c.suites = list("do", "replay")
	fs.Var(&c.suites, "suite", "suites to run, comma-separated: do, replay, mix, mutex, http, scale, wan, shards, expiry")
	c.members = list("1", "3")
	fs.Var(&c.members, "members", "embedded cluster sizes for the do, replay and mix suites")
	fs.IntVar(&c.concurrency, "concurrency", 64, "concurrent clients")
	fs.DurationVar(&c.duration, "duration", 5*time.Second, "time per side of a comparison, split over --rounds")
	fs.IntVar(&c.ops, "ops", 0, "operations per side instead of --duration")
	fs.IntVar(&c.rounds, "rounds", 2, "interleaved rounds per comparison")
	fs.IntVar(&c.keys, "keys", 10000, "key space of the replay and mix suites")
	fs.IntVar(&c.payload, "payload", 256, "bytes of each saved response")
	fs.IntVar(&c.recordFormat, "record-format", 3, "record format of the stores measured (the scale suite measures 2 and 3 side by side)")
	fs.StringVar(&c.body, "body", "json", "saved responses of the scale suite: json (a 1 KiB payment object with random ids, and headers, each distinct) or fill (--payload bytes of a repeated pattern)")
	fs.Float64Var(&c.retries, "retries", 0.5, "fraction of requests that retry a done key (mix)")
	fs.Float64Var(&c.duplicates, "duplicates", 0, "fraction of requests sent twice at once (mix)")
	fs.StringVar(&c.target, "target", "library", "what the mix suite drives: library, http or both")
	fs.StringVar(&c.pg, "pg", "", "PostgreSQL DSN for the peer comparison (bench/bench-pg.sh starts one)")
	fs.Var(&c.redis, "redis", "Redis addresses (host:port, comma-separated) for the mix suite's peer comparison, a side each (bench/bench-redis.sh starts one with appendfsync always, one with everysec, and a primary with two replicas whose writes WAIT for one)")
	c.scaleKeys = list("10000", "100000", "1000000")
	fs.Var(&c.scaleKeys, "scale-keys", "retained key counts of the scale suite")
	fs.BoolVar(&c.jsonOut, "json", false, "print results as JSON")
	fs.BoolVar(&c.histogram, "histogram", false, "print a latency histogram for each measurement")
	fs.BoolVar(&c.sweep, "sweep", true, "the expiry sweeper in the idem stores measured (etcdstore.WithExpirySweep); false: etcd's lease expiry alone")
	fs.IntVar(&c.expiryKeys, "expiry-keys", 1000000, "keys the expiry suite writes and lets expire")
	fs.IntVar(&c.expiryRate, "expiry-rate", 4000, "keys per second the expiry suite writes")
	fs.DurationVar(&c.expiryRetention, "expiry-retention", time.Minute, "retention of the expiry suite's keys (whole seconds)")
	fs.DurationVar(&c.expiryWidth, "expiry-width", 10*time.Second, "bucket width of the expiry suite's stores")
	fs.BoolVar(&c.batching, "batching", true, "group commit in the idem stores measured (etcdstore.WithBatching)")
	fs.BoolVar(&c.fsync, "fsync", true, "embedded etcd fsyncs (as in production); false only to look at CPU costs")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of the run to this file (each side's calling goroutines carry the label side=NAME)")
	fs.BoolVar(&c.clientCPU, "client-cpu", false, "profile each comparison to report every side's CPU per operation on its calling goroutines: the client's share (idem's own work and its etcd client's, or the raw pair's), not etcd's; not with --cpuprofile")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected arguments: %q", fs.Args())}
	}
	switch {
	case c.clientCPU && *cpuprofile != "":
		return usageError{errors.New("--client-cpu and --cpuprofile both need the one CPU profiler: pick one")}
	case c.concurrency < 1:
		return usageError{errors.New("--concurrency must be at least 1")}
	case c.rounds < 1:
		return usageError{errors.New("--rounds must be at least 1")}
	case c.retries < 0 || c.retries > 1 || c.duplicates < 0 || c.duplicates > 1:
		return usageError{errors.New("--retries and --duplicates are fractions between 0 and 1")}
	case c.target != "library" && c.target != "http" && c.target != "both":
		return usageError{fmt.Errorf("--target %q: must be library, http or both", c.target)}
	case c.recordFormat < 1 || c.recordFormat > 3:
		return usageError{fmt.Errorf("--record-format %d: must be 1, 2 or 3", c.recordFormat)}
	case c.body != "json" && c.body != "fill":
		return usageError{fmt.Errorf("--body %q: must be json or fill", c.body)}
	case c.keys < 1 || c.payload < 0:
		return usageError{errors.New("--keys must be positive and --payload not negative")}
	case c.expiryKeys < 1 || c.expiryRate < 1:
		return usageError{errors.New("--expiry-keys and --expiry-rate must be positive")}
	case c.expiryRetention < time.Second || c.expiryRetention%time.Second != 0 || c.expiryWidth < time.Second || c.expiryWidth%time.Second != 0 || c.expiryWidth > c.expiryRetention:
		return usageError{errors.New("--expiry-retention and --expiry-width must be whole seconds, the width at most the retention")}
	}
	for _, s := range c.suites.vals {
		if _, ok := suites[s]; !ok {
			return usageError{fmt.Errorf("--suite %q: unknown (do, replay, mix, mutex, http, scale, wan, shards, expiry)", s)}
		}
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	b := &bencher{cfg: c, out: stdout, progress: progressTo(stderr)}
	dir, err := os.MkdirTemp("", "idem-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b.dir = dir
	report := benchReport{Machine: machine(), Started: time.Now().UTC().Format(time.RFC3339), Config: c.describe()}
	for _, name := range c.suites.vals {
		rep, err := suites[name](ctx, b)
		if err != nil {
			return fmt.Errorf("suite %s: %w", name, err)
		}
		report.Suites = append(report.Suites, rep...)
		if !c.jsonOut {
			for _, s := range rep {
				b.print(s)
			}
		}
	}
	if c.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(report)
	}
	return nil
}

func (c benchConfig) describe() map[string]any {
	return map[string]any{"concurrency": c.concurrency, "duration": c.duration.String(), "ops": c.ops, "rounds": c.rounds,
		"keys": c.keys, "payload": c.payload, "retries": c.retries, "duplicates": c.duplicates, "fsync": c.fsync, "batching": c.batching}
}

// bencher runs measurements.
type bencher struct {
	cfg      benchConfig
	out      io.Writer
	dir      string
	progress io.Writer // nil when stderr is not a terminal
}

// op is one operation of worker w; it returns an outcome label.
type op func(ctx context.Context, w int) (string, error)

// side is one side of a comparison.
type side struct {
	name string
	run  op
}

// result is one measured side.
type result struct {
	Name     string           `json:"name"`
	Ops      int64            `json:"ops"`
	Errors   int64            `json:"errors"`
	Seconds  float64          `json:"seconds"`
	OpsPerS  float64          `json:"ops_per_second"`
	P50      float64          `json:"p50_ms"`
	P90      float64          `json:"p90_ms"`
	P99      float64          `json:"p99_ms"`
	Max      float64          `json:"max_ms"`
	Outcomes map[string]int64 `json:"outcomes"`
	// ClientCPU is the CPU its calling goroutines spent per operation
	// (--client-cpu), in microseconds.
	ClientCPU float64      `json:"client_cpu_us_per_op,omitempty"`
	Hist      []histBucket `json:"histogram,omitempty"`
	FirstErr  string       `json:"first_error,omitempty"`
	lat       []time.Duration
}

type histBucket struct {
	UpToMs float64 `json:"up_to_ms"`
	Count  int64   `json:"count"`
}

// ratio compares two results of one suite.
type ratio struct {
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Goal  float64 `json:"goal,omitempty"`
	Met   *bool   `json:"met,omitempty"`
	// AtMost: the goal is a ceiling (a latency), not a floor.
	AtMost bool `json:"at_most,omitempty"`
}

// suiteReport is one comparison.
type suiteReport struct {
	Suite   string            `json:"suite"`
	Title   string            `json:"title"`
	Notes   []string          `json:"notes,omitempty"`
	Results []*result         `json:"results"`
	Ratios  []ratio           `json:"ratios"`
	Extra   map[string]string `json:"extra,omitempty"`
}

type benchReport struct {
	Machine map[string]string `json:"machine"`
	Started string            `json:"started"`
	Config  map[string]any    `json:"config"`
	Suites  []suiteReport     `json:"suites"`
}

// compare measures the sides in interleaved rounds and returns one merged
// result per side.
func (b *bencher) compare(ctx context.Context, sides ...side) []*result {
	out := make([]*result, len(sides))
	for i, s := range sides {
		out[i] = &result{Name: s.name, Outcomes: map[string]int64{}}
	}
	per := b.cfg.duration / time.Duration(b.cfg.rounds)
	opsPer := 0
	if b.cfg.ops > 0 {
		opsPer = max(1, b.cfg.ops/b.cfg.rounds)
	}
	var prof bytes.Buffer
	profiling := b.cfg.clientCPU && pprof.StartCPUProfile(&prof) == nil
	for r := 0; r < b.cfg.rounds; r++ {
		for i, s := range sides {
			b.measure(ctx, s, per, opsPer, out[i])
		}
	}
	for _, r := range out {
		r.finish(b.cfg.histogram)
	}
	if profiling {
		pprof.StopCPUProfile()
		if err := clientCPU(&prof, out); err != nil {
			fmt.Fprintf(b.progress, "idem-bench: --client-cpu: %v\n", err)
		}
	}
	return out
}

// clientCPU sets each result's ClientCPU from a CPU profile of its
// comparison: the samples labelled with its side, over its operations.
func clientCPU(data io.Reader, out []*result) error {
	p, err := profile.Parse(data)
	if err != nil {
		return err
	}
	cpu := -1
	for i, st := range p.SampleType {
		if st.Type == "cpu" && st.Unit == "nanoseconds" {
			cpu = i
		}
	}
	if cpu < 0 {
		return errors.New("the profile has no cpu nanoseconds")
	}
	ns := map[string]int64{}
	for _, smp := range p.Sample {
		for _, side := range smp.Label["side"] {
			ns[side] += smp.Value[cpu]
		}
	}
	for _, r := range out {
		if r.Ops > 0 {
			r.ClientCPU = math.Round(float64(ns[r.Name])/float64(r.Ops)/100) / 10
		}
	}
	return nil
}

// measure runs s on the configured number of workers for d (or n ops),
// adding to r.
func (b *bencher) measure(ctx context.Context, s side, d time.Duration, n int, r *result) {
	var count, errs atomic.Int64
	var mu sync.Mutex
	deadline := time.Now().Add(d)
	start := time.Now()
	var wg sync.WaitGroup
	stopProgress := b.showProgress(s.name, &count, d, n)
	for w := 0; w < b.cfg.concurrency; w++ {
		wg.Add(1)
		go pprof.Do(ctx, pprof.Labels("side", s.name), func(ctx context.Context) {
			defer wg.Done()
			lat := make([]time.Duration, 0, 1024)
			outs := map[string]int64{}
			var firstErr error
			for ctx.Err() == nil {
				if n > 0 {
					if count.Add(1) > int64(n) {
						break
					}
				} else if time.Now().After(deadline) {
					break
				}
				t0 := time.Now()
				outcome, err := s.run(ctx, w)
				lat = append(lat, time.Since(t0))
				if n == 0 {
					count.Add(1)
				}
				if err != nil {
					errs.Add(1)
					outcome = "error"
					if firstErr == nil {
						firstErr = err
					}
				}
				outs[outcome]++
			}
			mu.Lock()
			r.lat = append(r.lat, lat...)
			for k, v := range outs {
				r.Outcomes[k] += v
			}
			if firstErr != nil && r.FirstErr == "" {
				r.FirstErr = firstErr.Error()
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	stopProgress()
	r.Seconds += time.Since(start).Seconds()
	r.Errors += errs.Load()
}

func (r *result) finish(hist bool) {
	r.Ops = int64(len(r.lat))
	if r.Seconds > 0 {
		r.OpsPerS = float64(r.Ops) / r.Seconds
	}
	if len(r.lat) == 0 {
		return
	}
	sort.Slice(r.lat, func(i, j int) bool { return r.lat[i] < r.lat[j] })
	pct := func(p float64) float64 { return ms(r.lat[min(len(r.lat)-1, int(p*float64(len(r.lat))))]) }
	r.P50, r.P90, r.P99, r.Max = pct(0.50), pct(0.90), pct(0.99), ms(r.lat[len(r.lat)-1])
	if hist {
		// Buckets doubling from 0.25 ms.
		up := 250 * time.Microsecond
		i := 0
		for i < len(r.lat) {
			var n int64
			for i < len(r.lat) && r.lat[i] <= up {
				n++
				i++
			}
			r.Hist = append(r.Hist, histBucket{UpToMs: ms(up), Count: n})
			up *= 2
		}
	}
	r.lat = nil
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/1e4) / 100 }

// ratioOf returns a/b's throughput ratio, checked against goal when goal > 0.
func ratioOf(name string, a, b *result, goal float64) ratio {
	r := ratio{Name: name}
	if b.OpsPerS > 0 {
		r.Value = math.Round(a.OpsPerS/b.OpsPerS*1000) / 1000
	}
	if goal > 0 {
		met := r.Value >= goal
		r.Goal, r.Met = goal, &met
	}
	return r
}

// latencyRatio returns a/b of two latencies, checked against a goal it must
// not exceed.
func latencyRatio(name string, a, b, atMost float64) ratio {
	r := ratio{Name: name, AtMost: true}
	if b > 0 {
		r.Value = math.Round(a/b*1000) / 1000
	}
	if atMost > 0 {
		met := r.Value <= atMost
		r.Goal, r.Met = atMost, &met
	}
	return r
}

// print writes a suite as text tables.
func (b *bencher) print(s suiteReport) {
	fmt.Fprintf(b.out, "\n== %s: %s\n", s.Suite, s.Title)
	for _, n := range s.Notes {
		fmt.Fprintf(b.out, "   %s\n", n)
	}
	tw := tabwriter.NewWriter(b.out, 0, 4, 2, ' ', tabwriter.AlignRight)
	cpu := false
	for _, r := range s.Results {
		cpu = cpu || r.ClientCPU > 0
	}
	head := "\tops\tops/s\tp50 ms\tp90 ms\tp99 ms\tmax ms\terrors\toutcomes\t"
	if cpu {
		head += "client CPU µs/op\t"
	}
	fmt.Fprintln(tw, head)
	for _, r := range s.Results {
		line := fmt.Sprintf("%s\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t%s\t", r.Name, r.Ops, r.OpsPerS, r.P50, r.P90, r.P99, r.Max, r.Errors, outcomes(r.Outcomes))
		if cpu {
			line += fmt.Sprintf("%.1f\t", r.ClientCPU)
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	for _, r := range s.Results {
		if r.FirstErr != "" {
			fmt.Fprintf(b.out, "   %s: first error: %s\n", r.Name, r.FirstErr)
		}
	}
	for _, r := range s.Ratios {
		line := fmt.Sprintf("   ratio %s: %.3f", r.Name, r.Value)
		if r.Met != nil {
			verdict := "met"
			if !*r.Met {
				verdict = "NOT met"
			}
			cmp := ">="
			if r.AtMost {
				cmp = "<="
			}
			line += fmt.Sprintf("   (goal %s %.2g: %s)", cmp, r.Goal, verdict)
		}
		fmt.Fprintln(b.out, line)
	}
	keys := make([]string, 0, len(s.Extra))
	for k := range s.Extra {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(b.out, "   %s: %s\n", k, s.Extra[k])
	}
	if b.cfg.histogram {
		for _, r := range s.Results {
			fmt.Fprintf(b.out, "   %s latency histogram:\n", r.Name)
			var peak int64
			for _, h := range r.Hist {
				peak = max(peak, h.Count)
			}
			for _, h := range r.Hist {
				if h.Count == 0 {
					continue
				}
				bar := strings.Repeat("#", int(math.Ceil(40*float64(h.Count)/float64(peak))))
				fmt.Fprintf(b.out, "     <= %8.2f ms %8d %s\n", h.UpToMs, h.Count, bar)
			}
		}
	}
}

func outcomes(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

// progressTo returns w when it is a terminal, nil otherwise: a progress bar
// is for people, not for logs.
func progressTo(w io.Writer) io.Writer {
	f, ok := w.(*os.File)
	if !ok {
		return nil
	}
	st, err := f.Stat()
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	return w
}

func (b *bencher) showProgress(name string, count *atomic.Int64, d time.Duration, n int) func() {
	if b.progress == nil {
		return func() {}
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			frac := time.Since(start).Seconds() / d.Seconds()
			if n > 0 {
				frac = float64(count.Load()) / float64(n)
			}
			frac = min(1, frac)
			fmt.Fprintf(b.progress, "\r%-28s [%-30s] %3.0f%% %8d ops", name, strings.Repeat("=", int(frac*30)), frac*100, count.Load())
			select {
			case <-stop:
				fmt.Fprintf(b.progress, "\r%s\r", strings.Repeat(" ", 80))
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(stop); <-done }
}

// machine describes where the numbers came from.
func machine() map[string]string {
	m := map[string]string{"cpus": fmt.Sprint(runtime.NumCPU()), "os": runtime.GOOS + "/" + runtime.GOARCH, "go": runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				m["cpu"] = strings.TrimSpace(strings.SplitN(line, ":", 2)[1])
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		line := strings.SplitN(string(b), "\n", 2)[0]
		m["memory"] = strings.Join(strings.Fields(line)[1:], " ")
	}
	return m
}
