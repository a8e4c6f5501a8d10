package main

import (
	"flag"
	"io"
	"testing"
)

// "--" ends the flags: a key that starts with "-" after it is an argument,
// also when "--" comes first (idem get -- -x).
func TestReview6DoubleDashFirstEndsFlags(t *testing.T) {
	for _, args := range [][]string{{"a", "--", "-x"}, {"--", "-x"}, {"--limit", "3", "--", "-x"}} {
		fs := flag.NewFlagSet("get", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		fs.Int("limit", 0, "")
		if err := parseFlags(fs, args); err != nil {
			t.Errorf("parseFlags(%q) = %v; want \"-x\" taken as an argument", args, err)
			continue
		}
		if last := fs.Arg(fs.NArg() - 1); last != "-x" {
			t.Errorf("parseFlags(%q): args %q; want the last one \"-x\"", args, fs.Args())
		}
	}
}
