package jobs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// stateConsts are the job states package jobs declares (the constants of
// type State in state.go), read from the source.
func stateConsts(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "state.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		vs, ok := n.(*ast.ValueSpec)
		if !ok {
			return true
		}
		if id, isIdent := vs.Type.(*ast.Ident); !isIdent || id.Name != "State" {
			return true
		}
		for _, v := range vs.Values {
			if lit, ok := v.(*ast.BasicLit); ok {
				s, _ := strconv.Unquote(lit.Value)
				out = append(out, s)
			}
		}
		return true
	})
	return out
}

// Every job state is in the docs that list them: JOBS.md's paragraph of
// states and its jobs ls synopsis, CLI.md's jobs ls row; and nothing else
// is (issue 37: a list that mirrors the code is tested against it).
func TestDocsListEveryJobState(t *testing.T) {
	states := stateConsts(t)
	if len(states) < 8 {
		t.Fatalf("states read from state.go: %v", states)
	}
	jobsDoc, err := os.ReadFile("../docs/JOBS.md")
	if err != nil {
		t.Fatal(err)
	}
	cliDoc, err := os.ReadFile("../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	lists := map[string]string{}
	if m := regexp.MustCompile(`(?s)A job's states: (.*?)\n\n`).FindSubmatch(jobsDoc); m != nil {
		lists["JOBS.md's states"] = string(m[1])
	}
	if m := regexp.MustCompile(`idem jobs ls \[--tenant T\] \[--state ([a-z|]+)\]`).FindSubmatch(jobsDoc); m != nil {
		lists["JOBS.md's jobs ls synopsis"] = "`" + strings.ReplaceAll(string(m[1]), "|", "` `") + "`"
	}
	if m := regexp.MustCompile("\\| `idem jobs ls \\[--state S\\][^|]*\\| jobs, by state: ([^|]*)\\|").FindSubmatch(cliDoc); m != nil {
		lists["CLI.md's jobs ls row"] = string(m[1])
	}
	if len(lists) != 3 {
		t.Fatalf("found %d of the 3 lists of job states in the docs: %v", len(lists), lists)
	}
	for name, text := range lists {
		named := regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(text, -1)
		got := map[string]bool{}
		for _, n := range named {
			got[n[1]] = true
		}
		for _, s := range states {
			if !got[s] {
				t.Errorf("%s does not name the state %q", name, s)
			}
			delete(got, s)
		}
		for s := range got {
			t.Errorf("%s names %q, which is no job state", name, s)
		}
	}
}
