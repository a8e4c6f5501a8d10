package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Issue 38, the CLI's bad input: --params and --payload that are not JSON
// were taken (exit 0); `idem jobs signal ID EVENT --payload JSON`, as
// JOBS.md writes it, exited 2; `idem ls --state bogus` exited 1 and
// `--limit -1` was taken; run outside the directory of idem serve, `idem
// status` waited 10 s and said "context deadline exceeded". Bad input
// exits 2 before etcd is reached, naming what is wrong; a missing socket
// is named at once.
func TestCLIBadInputExitsTwoAndSaysWhy(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"jobs", "submit", "--params", "{amount:5}", "j", "k"}, "--params"},
		{[]string{"jobs", "signal", "--payload", "not json", "j", "ev"}, "--payload"},
		{[]string{"ls", "--state", "bogus"}, "--state"},
		{[]string{"ls", "--limit", "-1"}, "--limit"},
		{[]string{"jobs", "ls", "--limit", "-2"}, "--limit"},
	} {
		out, err := runCmd(t, c.args...)
		if exitCode(err) != 2 || !strings.Contains(out+errString(err), c.want) {
			t.Errorf("idem %s = exit %d %q %v; want exit 2 naming %s", strings.Join(c.args, " "), exitCode(err), out, err, c.want)
		}
	}
	start := time.Now()
	out, err := runCmd(t, "status")
	if exitCode(err) != 1 || !strings.Contains(out+errString(err), "no etcd at unix://") || time.Since(start) > 5*time.Second {
		t.Errorf("idem status with no idem serve here = exit %d %q %v after %v; want the missing socket named at once", exitCode(err), out, err, time.Since(start))
	}

	// Flags after the arguments, as JOBS.md writes them.
	dir := tempDir(t)
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	startIdem(t, dir, flags...)
	ep := etcdEndpoint(flags)
	if out, err := runCmd(t, "jobs", "submit", "--endpoints", ep, "refund-7", "refund", "--params", `{"amount":5}`); err != nil {
		t.Fatalf("jobs submit with --params after the arguments = %q, %v", out, err)
	}
	if out, err := runCmd(t, "jobs", "signal", "--endpoints", ep, "refund-7", "approved", "--payload", `{"by":"ada"}`); err != nil {
		t.Fatalf("jobs signal ID EVENT --payload JSON (as JOBS.md writes it) = %q, %v", out, err)
	}
	if out, err := runCmd(t, "jobs", "get", "--endpoints", ep, "refund-7"); err != nil || !strings.Contains(out, "refund") {
		t.Fatalf("jobs get = %q, %v", out, err)
	}
}
