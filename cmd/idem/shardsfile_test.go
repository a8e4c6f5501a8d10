package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/shard"
)

// twoShards starts two one-member etcd clusters behind proxies and writes
// a shards file naming them a and b, with extra lines appended.
func twoShards(t *testing.T, extra string) (file string, proxies []*etcdtest.Proxy) {
	t.Helper()
	dir := tempDir(t)
	var urls []string
	for _, n := range []string{"a", "b"} {
		p := etcdBehindProxy(t, filepath.Join(dir, "etcd-"+n))
		proxies = append(proxies, p)
		urls = append(urls, p.URL())
	}
	file = filepath.Join(dir, "shards.yaml")
	yaml := fmt.Sprintf("shards:\n  - name: a\n    endpoints: [%s]\n  - name: b\n    endpoints: [%s]\n%s", urls[0], urls[1], extra)
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return file, proxies
}

// openShards opens a shard.Store on file's shards, as idem serve does, under
// idem's default prefix.
func openShards(t *testing.T, file string) *shard.Store {
	t.Helper()
	flags, _, cfg, err := readShards(file, etcdFlags{prefix: "/idem/", dialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	clis, errs := shardClients(flags, &cfg)
	t.Cleanup(func() {
		for _, c := range clis {
			c.Close()
		}
	})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	cfg.Check = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := shard.New(ctx, cfg, etcdstore.WithPrefix("/idem/"), etcdstore.WithSessionTTL(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// Found by review, now fixed: idem status --shards-file with one shard
// hung showed no shard set at all, not even the answering shards'.
//
// CLI.md: "idem status asks every shard at once, each within
// --command-timeout, reports each, marks the ones that do not answer, and
// shows the shard set each records: generation, placement, the placement
// keys are still handed over from, and the generation it was last drained
// for". OPERATIONS.md: "idem status --shards-file says when every shard of
// the previous placement is drained".
//
// What happened: the per-shard reports share the command's one deadline;
// the hung shard's report uses all of it, and only then are the shard
// sets read (Admin.Sets, one shard after another) under the same, now
// expired, context: every read fails, and no shard's set or drain mark is
// printed. The operator loses exactly what a change needs while one shard
// is down.
func TestStatusWithAHungShardShowsTheOthersSets(t *testing.T) {
	file, proxies := twoShards(t, "")
	s := openShards(t, file)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := 0; i < 12; i++ { // keys on both shards: each records the set
		if _, err := s.Do(ctx, etcdstore.Key{ID: fmt.Sprintf("order-%d", i)}, nil, func(context.Context, *etcdstore.Claim) ([]byte, error) {
			return []byte("ok"), nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	out, err := runCmd(t, "status", "--shards-file", file, "--command-timeout", "2s")
	if err != nil || strings.Count(out, "shard set: generation 1") != 2 {
		t.Fatalf("idem status with both shards up = %q, %v; want both shards' set", out, err)
	}
	proxies[0].Blackhole() // a hangs
	out, err = runCmd(t, "status", "--shards-file", file, "--command-timeout", "2s")
	if err != nil || !strings.Contains(out, "does not answer") {
		t.Fatalf("idem status with a hung = %q, %v; want a marked", out, err)
	}
	b := out[strings.Index(out, "shard b\n"):]
	if !strings.Contains(b, "shard set: generation 1") {
		t.Fatalf("idem status with shard a hung shows no shard set for b, which answers:\n%s", out)
	}
}

// Found by review, now fixed: a shards file with generation: 0 was
// accepted (as generation 1), and the documented next change, "raise
// generation: by one", was then silently ignored: the same generation as
// the set in force, so the process kept the old placement, and nothing
// (Status.Pending, idem status, the log) said that the file's placement was
// not the one in force. Now generation: 0 is refused, and a placement that
// differs from the one in force at the same generation is reported.
func TestShardsFileGenerationZero(t *testing.T) {
	file, _ := twoShards(t, "generation: 0\nplacement: [a]\n")
	if err := checkShards(file, etcdFlags{prefix: "/idem/"}); err == nil || !strings.Contains(err.Error(), "generation 0 must be at least 1") {
		t.Errorf("a shards file with generation: 0: %v; want it refused (generation must be at least 1)", err)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	one := filepath.Join(filepath.Dir(file), "one.yaml")
	if err := os.WriteFile(one, []byte(strings.Replace(string(b), "generation: 0", "generation: 1", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	first := openShards(t, one)
	if st := first.Status(); st.InForce.Generation != 1 || st.Pending != "" {
		t.Fatalf("generation 1: %+v", st)
	}
	// The operator adds b but forgets to raise the generation.
	next := filepath.Join(filepath.Dir(file), "next.yaml")
	if err := os.WriteFile(next, []byte(strings.Replace(strings.Replace(string(b), "generation: 0", "generation: 1", 1), "placement: [a]", "placement: [a, b]", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	second := openShards(t, next)
	st := second.Status()
	if len(st.InForce.Placement.Shards) != 1 || !strings.Contains(st.Pending, "raise the generation") {
		t.Fatalf("generation 1 with b added, over generation 1 without: in force placement %v, asked %v, pending %q: "+
			"want the set in force kept and the process saying why the file's placement is not in force", st.InForce.Placement.Shards, st.Asked.Placement.Shards, st.Pending)
	}
}

// Found by review, now fixed: with one shard hung, /readyz answered after
// the readiness probe's timeout in the shipped manifests (none set:
// Kubernetes' default, 1 s), so the pod left its Service although the
// other shard served. OPERATIONS.md: "/readyz ... stays 200 while one
// answers"; issue 24's defect 4 was exactly "in Kubernetes the pod leaves
// the Service". Now /readyz answers within readyTimeout as a whole, and the
// manifests' readiness probes wait longer (timeoutSeconds): this test reads
// them, and probes as the kubelet does.
func TestReadyzWithinTheProbeTimeout(t *testing.T) {
	probeTimeout := time.Duration(0)
	timeoutLine := regexp.MustCompile(`(?m)^\s*readinessProbe:(?:\n\s+.*)*?\n\s+timeoutSeconds: (\d+)`)
	for _, f := range []string{"../../deploy/base/idem/deployment.yaml", "../../deploy/overlays/sidecar/shop.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		m := timeoutLine.FindSubmatch(b)
		if m == nil {
			t.Fatalf("%s: its readinessProbe sets no timeoutSeconds (Kubernetes' default, 1 s, is below /readyz's bound %v)", f, readyTimeout)
		}
		n, _ := strconv.Atoi(string(m[1]))
		if d := time.Duration(n) * time.Second; probeTimeout == 0 || d < probeTimeout {
			probeTimeout = d
		}
	}
	values, err := os.ReadFile("../../deploy/helm/idem/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^  readiness:(?:\n\s+.*)*?\n    timeoutSeconds: (\d+)`).FindSubmatch(values)
	if m == nil {
		t.Fatal("the Helm chart's probes.readiness sets no timeoutSeconds")
	}
	if n, _ := strconv.Atoi(string(m[1])); time.Duration(n)*time.Second < probeTimeout {
		probeTimeout = time.Duration(n) * time.Second
	}
	if probeTimeout <= readyTimeout {
		t.Fatalf("the readiness probes wait %v, not more than /readyz's own bound %v", probeTimeout, readyTimeout)
	}
	file, proxies := twoShards(t, "")
	dir := filepath.Join(filepath.Dir(file), "work")
	idem := startIdem(t, dir, "--shards-file", file)
	if r := send(t, "GET", idem.admin+"/readyz", "", ""); r.status != 200 {
		t.Fatalf("/readyz with both shards up = %d %q", r.status, r.body)
	}
	proxies[0].Blackhole()
	// The kubelet's probe: a GET with the probe's timeout.
	failed := 0
	for i := 0; i < 3; i++ {
		began := time.Now()
		resp, err := kubeProbe(idem.admin+"/readyz", probeTimeout)
		if err != nil || resp != 200 {
			failed++
			t.Logf("probe %d: %v, status %d, after %v", i, err, resp, time.Since(began).Round(time.Millisecond))
		}
	}
	if failed > 0 {
		t.Fatalf("%d of 3 readiness probes (timeout %v) failed with shard a hung while b answers: the pod leaves its Service", failed, probeTimeout)
	}
}

// kubeProbe GETs url within timeout, as the kubelet's httpGet probe does, and
// returns the status.
func kubeProbe(url string, timeout time.Duration) (int, error) {
	resp, err := (&http.Client{Timeout: timeout}).Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}
