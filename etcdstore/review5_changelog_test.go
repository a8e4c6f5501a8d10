package etcdstore_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strings"
	"testing"
)

// exported returns the package's exported names: top-level ones, and
// Type.Method and Type.Field.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	pkgs, err := parser.ParseDir(token.NewFileSet(), ".", func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, p := range pkgs {
		for _, f := range p.Files {
			for _, d := range f.Decls {
				switch d := d.(type) {
				case *ast.FuncDecl:
					if d.Recv == nil {
						out[d.Name.Name] = true
						continue
					}
					rt := d.Recv.List[0].Type
					if s, ok := rt.(*ast.StarExpr); ok {
						rt = s.X
					}
					if id, ok := rt.(*ast.Ident); ok {
						out[id.Name+"."+d.Name.Name] = true
					}
				case *ast.GenDecl:
					for _, s := range d.Specs {
						switch s := s.(type) {
						case *ast.TypeSpec:
							out[s.Name.Name] = true
							if st, ok := s.Type.(*ast.StructType); ok {
								for _, fl := range st.Fields.List {
									for _, n := range fl.Names {
										out[s.Name.Name+"."+n.Name] = true
									}
									if len(fl.Names) == 0 { // embedded: its methods are promoted
										if id, ok := fl.Type.(*ast.Ident); ok {
											out[s.Name.Name+"."+id.Name] = true
										}
									}
								}
							}
						case *ast.ValueSpec:
							for _, n := range s.Names {
								out[n.Name] = true
							}
						}
					}
				}
			}
		}
	}
	return out
}

// Issue 37, item 4 and 5: the exports that only idem's own packages used
// moved to internal/storex, and the CHANGELOG's "API changes" bullet
// lists them. Every other etcdstore name the release's CHANGELOG section
// gives users as API ("New: ...", "(new etcdstore.Admin.Peek)") must exist:
// a user who reads the CHANGELOG looks for it.
func TestReview5ChangelogNamesOnlyExistingAPI(t *testing.T) {
	log, err := os.ReadFile("../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	sections := regexp.MustCompile(`(?m)^## `).Split(string(log), 3)
	if len(sections) < 3 {
		t.Fatal("no release section in CHANGELOG.md")
	}
	unreleased := sections[1]
	names := exported(t)
	ref := regexp.MustCompile("`etcdstore\\.([A-Z][A-Za-z0-9]*(?:\\.[A-Z][A-Za-z0-9]*)?)")
	var missing []string
	seen := map[string]bool{}
	for _, bullet := range regexp.MustCompile(`(?m)^- `).Split(unreleased, -1) {
		if strings.HasPrefix(bullet, "**API changes**") {
			continue // the names that moved away
		}
		for _, m := range ref.FindAllStringSubmatch(bullet, -1) {
			n := m[1]
			if names[n] || names["Store."+n] || names["Admin."+n] {
				continue // (etcdstore.Enqueue: the store's method)
			}
			// A method promoted from Admin (Store embeds it).
			if typ, meth, ok := strings.Cut(n, "."); ok && typ == "Store" && names["Admin."+meth] {
				continue
			}
			if !seen[n] {
				seen[n] = true
				missing = append(missing, n)
				t.Logf("  - %.120s", strings.ReplaceAll(bullet, "\n", " "))
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("CHANGELOG.md's unreleased (0.5.0) section gives %d etcdstore names as API that etcdstore does not have: %v", len(missing), missing)
	}
}
