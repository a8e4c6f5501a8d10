package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// jobsCommands are the commands `idem jobs` dispatches (the cases of
// jobsCmd's switch), read from the source.
func jobsCommands(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "jobs.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range f.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if !ok || fn.Name.Name != "jobsCmd" {
			continue
		}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			cc, ok := n.(*ast.CaseClause)
			if !ok {
				return true
			}
			for _, e := range cc.List {
				if lit, ok := e.(*ast.BasicLit); ok {
					s, _ := strconv.Unquote(lit.Value)
					if s != "help" && !strings.HasPrefix(s, "-") {
						out = append(out, s)
					}
				}
			}
			return true
		})
	}
	return out
}

// Issue 37, item 5: the CLI's commands in docs/CLI.md and README are
// tested against the code. `idem jobs` runs a command its own usage (the
// help a user reads) does not list, which docs/CLI.md documents; and
// TestCLIDocsNameEveryFlag's hand-written list of commands leaves it out,
// so its flags are checked against nothing.
func TestReview5JobsUsageListsEveryJobsCommand(t *testing.T) {
	cmds := jobsCommands(t)
	if len(cmds) < 8 {
		t.Fatalf("commands read from jobsCmd: %v", cmds)
	}
	doc, err := os.ReadFile("../../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	in := false
	for _, line := range strings.Split(jobsUsage, "\n") {
		switch {
		case line == "Commands:":
			in = true
		case in && strings.HasPrefix(line, "  "):
			listed[strings.Fields(line)[0]] = true
		case in && line == "":
			in = false
		}
	}
	for _, c := range cmds {
		if !strings.Contains(string(doc), "idem jobs "+c) {
			t.Errorf("docs/CLI.md does not name idem jobs %s", c)
		}
		if !listed[c] {
			t.Errorf("idem jobs runs %q, but its usage (idem jobs -h) does not list it: %v", c, listed)
		}
	}
}
