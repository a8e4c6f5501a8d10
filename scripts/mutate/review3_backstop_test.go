package main

import (
	"os"
	"path/filepath"
	"testing"
)

// A backstop counts its mutant as killed whenever its test fails with the
// mutant applied, without ever running the test on the unmutated code: a
// backstop test that fails anyway (a flake, a test broken by an unrelated
// change, a machine too slow for its timeouts) "kills" every mutant it
// backs, and the report prints KILLED by that test. Here the mutant only
// rewords a comment (an equivalent mutant: nothing can kill it), and its
// backstop fails whatever the code.
func TestReview3BackstopKillsOnlyWhatTheMutantBreaks(t *testing.T) {
	dir := t.TempDir()
	files := map[string]string{
		"go.mod": "module example.com/backstop\n\ngo 1.22\n",
		"a.go":   "package backstop\n\n// Answer is forty-two.\nfunc Answer() int { return 42 }\n",
		"a_test.go": "package backstop\n\nimport \"testing\"\n\n" +
			"func TestAnswer(t *testing.T) {\n\tt.Fatal(\"fails on the unmutated code too (a flake, a broken test)\")\n}\n",
	}
	for name, src := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Chdir(dir)
	t.Setenv("GOWORK", "off")
	m := mutant{name: "an equivalent mutant", file: "a.go", old: "// Answer is forty-two.", new: "// Answer is 42."}
	r := applyBackstop(m, backstop{".", "TestAnswer"})
	if r.killed {
		t.Errorf("an equivalent mutant counted as killed by a backstop that fails without it: %s", r)
	}
	if src, _ := os.ReadFile(filepath.Join(dir, "a.go")); string(src) != files["a.go"] {
		t.Errorf("a.go not restored: %q", src)
	}
}
