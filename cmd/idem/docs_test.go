package main

import (
	"errors"
	"flag"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Every Go snippet in the docs is the body of an Example function
// somewhere in the repository, so it compiles with the tests and cannot
// drift from the API.
func TestDocSnippetsAreExamples(t *testing.T) {
	root := "../.."
	examples := map[string]string{} // normalised body -> function
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return err
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, src, 0)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || !strings.HasPrefix(fn.Name.Name, "Example") || fn.Body == nil {
				continue
			}
			body := src[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset]
			examples[normalise(string(body))] = path + ":" + fn.Name.Name
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	docs, _ := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	docs = append(docs, filepath.Join(root, "README.md"), filepath.Join(root, "deploy", "README.md"))
	block := regexp.MustCompile("(?s)```go\n(.*?)```")
	snippets := 0
	for _, doc := range docs {
		text, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range block.FindAllStringSubmatch(string(text), -1) {
			snippets++
			if _, ok := examples[normalise(m[1])]; !ok {
				t.Errorf("%s: a Go snippet is not the body of any Example function:\n%s", doc, m[1])
			}
		}
	}
	if snippets == 0 {
		t.Fatal("no Go snippet found in the docs: the test checks nothing")
	}
}

// normalise drops indentation and blank lines.
func normalise(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// The release idem version prints is the CHANGELOG's newest, and every
// release the docs name ("since 0.3", "upgrading from 0.4") is one of the
// CHANGELOG's.
func TestReleaseIsInTheChangelog(t *testing.T) {
	log, err := os.ReadFile("../../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	heads := regexp.MustCompile(`(?m)^## (?:Unreleased \()?(\d+\.\d+)\.\d+`).FindAllStringSubmatch(string(log), -1)
	if len(heads) == 0 || !strings.HasPrefix(Release, heads[0][1]+".") {
		t.Fatalf("idem version says %s; the CHANGELOG's newest release is %v", Release, heads)
	}
	released := map[string]bool{}
	for _, h := range heads {
		released[h[1]] = true
	}
	docs, _ := filepath.Glob("../../docs/*.md")
	mention := regexp.MustCompile(`\b(?:idem|since|from|before|Before|until|in|to|\() ?(0\.\d+)\b`)
	for _, d := range append(docs, "../../README.md") {
		text, err := os.ReadFile(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mention.FindAllStringSubmatch(string(text), -1) {
			if !released[m[1]] {
				t.Errorf("%s names idem %s (%q), which the CHANGELOG does not list", filepath.Base(d), m[1], m[0])
			}
		}
	}
}

// docs/CLI.md's metrics table lists exactly the metrics idem serve
// registers (the cache's included), and every outcome of
// idem_requests_total.
func TestMetricsTableMatchesTheRegistry(t *testing.T) {
	doc, err := os.ReadFile("../../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{} // metric -> its row
	for _, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(line, "| `idem_") {
			continue
		}
		cells := strings.Split(line, "|")
		for _, m := range regexp.MustCompile("`(idem_[a-z_]+)`").FindAllStringSubmatch(cells[1], -1) {
			rows[m[1]] = line
		}
	}
	s := &server{cfg: &serveConfig{}}
	s.registerMetrics(true)
	s.metrics.Duration.WithLabelValues("claimed").Observe(0) // a vector without observations is not gathered
	names := map[string]bool{}
	mfs, err := s.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var outcomes []string
	for _, mf := range mfs {
		names[mf.GetName()] = true
		if mf.GetName() == "idem_requests_total" {
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "outcome" {
						outcomes = append(outcomes, l.GetValue())
					}
				}
			}
		}
	}
	descs := make(chan *prometheus.Desc, 16)
	etcdCollector{s}.Describe(descs)
	close(descs)
	for d := range descs {
		names[regexp.MustCompile(`fqName: "([a-z_]+)"`).FindStringSubmatch(d.String())[1]] = true
	}
	for name := range names {
		if !strings.HasPrefix(name, "idem_") {
			continue // Go runtime and process metrics
		}
		if _, ok := rows[name]; !ok {
			t.Errorf("docs/CLI.md's metrics table does not list %s", name)
		}
	}
	for name := range rows {
		if !names[name] {
			t.Errorf("docs/CLI.md lists %s, which idem does not register", name)
		}
	}
	if len(outcomes) < 10 {
		t.Fatalf("outcomes of idem_requests_total: %v", outcomes)
	}
	for _, o := range outcomes {
		if !strings.Contains(rows["idem_requests_total"], "`"+o+"`") {
			t.Errorf("docs/CLI.md's idem_requests_total row does not name the outcome %q", o)
		}
	}
}

// The command lists of the README and docs/CLI.md name every command of
// idem's usage.
func TestDocsNameEveryCommand(t *testing.T) {
	var cmds []string
	in := false
	for _, line := range strings.Split(usage, "\n") {
		switch {
		case line == "Commands:":
			in = true
		case in && strings.HasPrefix(line, "  "):
			cmds = append(cmds, strings.Fields(line)[0])
		case in && line == "":
			in = false
		}
	}
	if len(cmds) < 8 {
		t.Fatalf("commands in usage: %v", cmds)
	}
	// docs/CLI.md opens with the usage's list itself.
	cli, err := os.ReadFile("../../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, line := range strings.Split(usage, "\n") {
		if strings.HasPrefix(line, "  ") && slices.Contains(cmds, strings.Fields(line)[0]) {
			want = append(want, "idem "+line[2:])
		}
	}
	if !strings.Contains(string(cli), "```\n"+strings.Join(want, "\n")+"\n```") {
		t.Errorf("docs/CLI.md does not open with idem's usage list:\n%s", strings.Join(want, "\n"))
	}
	for _, d := range []string{"../../README.md", "../../docs/CLI.md"} {
		text, err := os.ReadFile(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cmds {
			if !strings.Contains(string(text), "idem "+c) {
				t.Errorf("%s does not name the command idem %s", filepath.Base(d), c)
			}
		}
	}
}

// Every flag of every command is in docs/CLI.md (as --name, or in a
// command's verbatim "Flags:" list), and every "Flags:" list in it is
// some command's -h output, word for word (issue 37: docs that cannot
// drift).
func TestCLIDocsNameEveryFlag(t *testing.T) {
	doc, err := os.ReadFile("../../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	cmds := [][]string{{"serve"}, {"get"}, {"ls"}, {"evict"}, {"status"}, {"echo"}, {"injector"},
		{"snapshot", "save"}, {"snapshot", "restore"}, {"snapshot", "bump-epoch"}}
	for _, c := range jobsCommands(t) {
		cmds = append(cmds, []string{"jobs", c})
	}
	flagRe := regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`)
	var helps []string
	for _, c := range cmds {
		var out, errOut strings.Builder
		if err := run(t.Context(), append(slices.Clone(c), "-h"), &out, &errOut); err != nil && !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("idem %s -h: %v", strings.Join(c, " "), err)
		}
		help := out.String() + errOut.String()
		_, flags, ok := strings.Cut(help, "Flags:\n")
		if !ok {
			t.Fatalf("idem %s -h lists no flags:\n%s", strings.Join(c, " "), help)
		}
		helps = append(helps, "Flags:\n"+flags)
		for _, m := range flagRe.FindAllStringSubmatch(flags, -1) {
			if !strings.Contains(string(doc), "--"+m[1]) && !strings.Contains(string(doc), "\n  -"+m[1]+" ") && !strings.Contains(string(doc), "\n  -"+m[1]+"\n") {
				t.Errorf("docs/CLI.md does not name idem %s's flag --%s", strings.Join(c, " "), m[1])
			}
		}
	}
	blocks := regexp.MustCompile("(?s)```\nFlags:\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	if len(blocks) == 0 {
		t.Fatal("docs/CLI.md has no Flags: list")
	}
	for _, b := range blocks {
		found := false
		for _, h := range helps {
			found = found || strings.Contains(h, "Flags:\n"+b[1])
		}
		if !found {
			t.Errorf("a Flags: list in docs/CLI.md is no command's -h output:\n%.300s", b[1])
		}
	}
}
