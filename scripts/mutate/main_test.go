package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// Every mutant's text occurs exactly once in its file: a change to the
// code under a mutant fails here, in CI, instead of at the next
// measurement (two mutants of jobs/worker.go had stopped applying so).
func TestEveryMutantApplies(t *testing.T) {
	dir := root()
	for _, m := range all() {
		src, err := os.ReadFile(filepath.Join(dir, m.file))
		if err != nil {
			t.Fatal(err)
		}
		if n := bytes.Count(src, []byte(m.old)); n != 1 {
			t.Errorf("mutant %q: its text occurs %d times in %s, not once: update it", m.name, n, m.file)
		}
		if m.old == m.new {
			t.Errorf("mutant %q changes nothing", m.name)
		}
	}
}

// Every backstop names a mutant of the list and a test that exists in its
// package: a renamed test fails here, not as a backstop that runs nothing.
func TestEveryBackstopNamesAMutantAndATest(t *testing.T) {
	dir := root()
	names := map[string]bool{}
	for _, m := range all() {
		names[m.name] = true
	}
	checks := map[string]backstop{}
	for name, bs := range backstops {
		checks[name] = bs
	}
	for name, bs := range contract {
		if _, both := backstops[name]; both {
			t.Errorf("mutant %q has a backstop and a contract test", name)
		}
		checks[name] = bs
	}
	for name, bs := range checks {
		if !names[name] {
			t.Errorf("backstop %s: no mutant %q", bs.test, name)
		}
		files, err := filepath.Glob(filepath.Join(dir, bs.pkg, "*_test.go"))
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, f := range files {
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			found = found || bytes.Contains(src, []byte("\nfunc "+bs.test+"(t *testing.T) {"))
		}
		if !found {
			t.Errorf("mutant %q: its backstop %s is not a test in %s", name, bs.test, bs.pkg)
		}
	}
}
