package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdtest"
)

// validateServe parses args as idem serve does and runs its validation
// (what decides exit 2 before anything starts).
func validateServe(t *testing.T, args ...string) error {
	t.Helper()
	var c serveConfig
	fs := c.flags(io.Discard)
	if err := parseFlags(fs, args); err != nil {
		t.Fatalf("parsing %v: %v", args, err)
	}
	return c.validate()
}

// docs/CLI.md: --claim-deadline must be at least 5/4 of --upstream-timeout,
// refused otherwise (exit 2). --upstream-timeout 0 (or less) is not "no
// timeout": the proxy replaces it with 30 s (idemhttp/proxy.go), so a
// 1 s claim deadline under a 30 s wait for the upstream's headers must be
// refused as it is with --upstream-timeout 30s.
func TestReviewClaimDeadlineAgainstTheEffectiveUpstreamTimeout(t *testing.T) {
	base := []string{"--upstream", "http://127.0.0.1:1", "--data-dir", t.TempDir(), "--claim-deadline", "1s"}
	if err := validateServe(t, append(base, "--upstream-timeout", "30s")...); err == nil {
		t.Fatalf("--claim-deadline 1s --upstream-timeout 30s accepted")
	}
	for _, ut := range []string{"0s", "-5s"} {
		if err := validateServe(t, append(base, "--upstream-timeout", ut)...); err == nil {
			t.Errorf("--claim-deadline 1s --upstream-timeout %s accepted, though the proxy then waits 30s for the upstream's headers", ut)
		}
	}
}

// A --max-response-body the store's records cannot hold is refused by
// idemhttp.New, but only once idem has connected to etcd: validate lets
// it through. Against a reachable external etcd, idem serve then logs
// "etcd cannot be reached", serves (keyed requests 503 for good) and
// reconnects forever, instead of exiting 2 at once.
func TestReviewServeRefusesAnOversizedMaxResponseBodyBeforeEtcd(t *testing.T) {
	if err := validateServe(t, "--upstream", "http://127.0.0.1:1", "--max-response-body", "2000000"); err == nil {
		t.Errorf("validate accepted --max-response-body 2000000 (records hold 1 MiB)")
	}
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Second)
	defer cancel()
	var out, errOut bytes.Buffer
	start := time.Now()
	err := run(ctx, []string{"serve", "--endpoints", c.Endpoints()[0], "--upstream", "http://127.0.0.1:1",
		"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--max-response-body", "2000000"}, &out, &errOut)
	took := time.Since(start)
	if exitCode(err) != 2 || took > 5*time.Second {
		logs := errOut.String()
		if len(logs) > 1500 {
			logs = logs[:1500]
		}
		t.Fatalf("serve --max-response-body 2000000 against a reachable etcd: exit %d (%v) after %v; want exit 2 at once\n%s",
			exitCode(err), err, took.Round(time.Millisecond), logs)
	}
}

// docs/CLI.md, jobs submit: "bad input exits 2 and submits nothing".
// Params that are JSON with no canonical form (a repeated member) and
// params over the record size are bad input, refused before any write,
// but exit 1.
func TestReviewJobsSubmitBadParamsExit2(t *testing.T) {
	c := etcdtest.Start(t, 1, etcdtest.Options{})
	ep := c.Endpoints()[0]
	big := filepath.Join(t.TempDir(), "big.json")
	if err := os.WriteFile(big, []byte(`"`+strings.Repeat("x", 2<<20)+`"`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]string{
		{"--params", `{"a":1,"a":2}`, "dup-1", "welcome"},
		{"--params-file", big, "big-1", "welcome"},
	} {
		out, err := runCmd(t, append([]string{"jobs", "submit", "--endpoints", ep}, bad...)...)
		if exitCode(err) != 2 {
			if len(out) > 300 {
				out = out[:300]
			}
			t.Errorf("jobs submit %.60q: exit %d (%v); want 2 (bad input)\n%s", bad, exitCode(err), firstLine(errString(err), 300), out)
		}
	}
}
