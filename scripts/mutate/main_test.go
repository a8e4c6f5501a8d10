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
