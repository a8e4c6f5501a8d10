// Package tidy holds the repository's checks of its own code's shape, as
// TigerBeetle's tidy.zig does: they fail the test suite, not a review.
package tidy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// maxLines is the longest a function of the core packages may be: a
// function that does not fit on a screen hides its decisions.
const maxLines = 70

// core are the packages held to maxLines (with their sub-packages): the
// store and the kernel whose decisions it executes.
var core = []string{"etcdstore", "internal/kernel"}

// TestFunctionLength fails on every function of the core packages longer
// than maxLines, tests aside.
func TestFunctionLength(t *testing.T) {
	for _, dir := range core {
		root := filepath.Join("..", "..", dir)
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			fset := token.NewFileSet()
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				return err
			}
			for _, decl := range f.Decls {
				fn, ok := decl.(*ast.FuncDecl)
				if !ok || fn.Body == nil {
					continue
				}
				if n := fset.Position(fn.End()).Line - fset.Position(fn.Pos()).Line + 1; n > maxLines {
					rel, _ := filepath.Rel(filepath.Join("..", ".."), path)
					t.Errorf("%s: %s is %d lines, over %d: split it", rel, fn.Name.Name, n, maxLines)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}
