package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Issue 38 item 13: the README's test command failed on a fresh machine:
// the console's browser test needs Debian's chromium and npm's axe-core,
// which only .ci/run installed. The README's two commands must be all a
// newcomer runs: scripts/test installs, before any test runs, every program
// the tests look for, and .ci/run runs exactly that command.
func TestTheREADMETestCommandInstallsWhatTheTestsNeed(t *testing.T) {
	root := filepath.Join("..", "..")
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	readme, test, deps, ci := read("README.md"), read("scripts/test"), read("scripts/test-deps"), read(".ci/run")
	if !strings.Contains(readme, "\nscripts/test\n") {
		t.Fatal("README.md does not give scripts/test as its test command")
	}
	lines := func(script string) []string {
		var out []string
		for _, l := range strings.Split(script, "\n") {
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				out = append(out, l)
			}
		}
		return out
	}
	first := func(script, re string) int {
		for i, l := range lines(script) {
			if regexp.MustCompile(re).MatchString(l) {
				return i
			}
		}
		return -1
	}
	if d, g := first(test, `^scripts/test-deps$`), first(test, `^go test `); d < 0 || g < 0 || d > g {
		t.Fatalf("scripts/test runs scripts/test-deps at line %d and its first go test at %d: the dependencies must come first", d, g)
	}
	if first(ci, `^scripts/test$`) < 0 {
		t.Fatal(".ci/run does not run the README's test command, scripts/test")
	}
	// What the tests look for (exec.LookPath, chromiumPath, the axe-core
	// the console's audit loads), and how test-deps installs it.
	for program, install := range map[string]string{
		"etcd":         "etcd-server",
		"redis-server": "redis-server",
		"chromium":     "chromium",
		"npm":          "npm",
		"node":         "nodejs",
	} {
		if !strings.Contains(deps, "command -v "+program+" ") || !strings.Contains(deps, "need+=("+install+")") {
			t.Errorf("scripts/test-deps does not install %s (Debian's %s) when it is missing", program, install)
		}
	}
	if !strings.Contains(deps, "/usr/bin/python3 -c 'import pytest'") || !strings.Contains(deps, "need+=(python3-pytest)") {
		t.Error("scripts/test-deps does not install Debian's python3-pytest for the Python client's tests")
	}
	if !strings.Contains(deps, "npm ci --prefix clients/typescript") {
		t.Error("scripts/test-deps does not install the TypeScript client's compiler")
	}
	if !strings.Contains(deps, "axe-core/axe.min.js") || !strings.Contains(deps, "npm ci --prefix cmd/idem/testdata/npm") {
		t.Error("scripts/test-deps does not install npm's axe-core for the console's audit")
	}
}
