package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"os"
	"strings"
	"testing"
)

// Help asked for is not an error (exit 0); a bad flag is a usage error
// (exit 2).
func TestHelpAndUsage(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}} {
		if err := bench(context.Background(), args, io.Discard, io.Discard); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("idem-bench %v = %v; want flag.ErrHelp (exit 0)", args, err)
		}
	}
	if err := bench(context.Background(), []string{"--no-such-flag"}, io.Discard, io.Discard); !errors.As(err, new(usageError)) {
		t.Errorf("idem-bench --no-such-flag = %v; want a usage error (exit 2)", err)
	}
}

// Every suite is in the help text, the --suite flag's usage and
// bench/README.md (which shows the help text), and nothing else is.
func TestSuitesListedEverywhere(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var help bytes.Buffer
	if err := bench(context.Background(), []string{"-h"}, io.Discard, &help); !errors.Is(err, flag.ErrHelp) {
		t.Fatal(err)
	}
	_, flagUsage, _ := strings.Cut(help.String(), "suites to run, comma-separated:")
	flagUsage, _, _ = strings.Cut(flagUsage, "\n")
	for name := range suites {
		if !strings.Contains(benchUsage, "\n  "+name+" ") {
			t.Errorf("the help text does not list the suite %s", name)
		}
		if !strings.Contains(flagUsage, " "+name) {
			t.Errorf("--suite's usage does not name %s: %q", name, flagUsage)
		}
	}
	if !bytes.Contains(readme, bytes.TrimSpace(help.Bytes())) {
		t.Errorf("bench/README.md does not show the help text as idem-bench prints it (idem-bench --help):\n%s", help.String())
	}
	suitesText := benchUsage[strings.Index(benchUsage, "Suites (--suite"):strings.Index(benchUsage, "Flags:")]
	if !bytes.Contains(readme, []byte(suitesText)) {
		t.Errorf("bench/README.md does not show the help text's suites:\n%s", suitesText)
	}
	for _, line := range strings.Split(suitesText, "\n")[1:] {
		if f := strings.Fields(line); len(f) > 0 {
			if _, ok := suites[f[0]]; !ok {
				t.Errorf("the help text lists %s, which is no suite", f[0])
			}
		}
	}
}

// The raw batched pair is batched by idem's own rule: its pacer is a copy
// of etcdstore's, kept identical.
func TestPacerIsEtcdstores(t *testing.T) {
	orig, err := os.ReadFile("../../../etcdstore/internal/send/pace.go")
	if err != nil {
		t.Fatal(err)
	}
	copied, err := os.ReadFile("pace.go")
	if err != nil {
		t.Fatal(err)
	}
	want := "// Code generated from etcdstore/internal/send/pace.go (a copy; TestPacerIsEtcdstores keeps it identical). DO NOT EDIT.\n\n" +
		strings.Replace(string(orig), "package send", "package main", 1)
	if string(copied) != want {
		t.Fatalf("bench/cmd/idem-bench/pace.go differs from etcdstore/internal/send/pace.go: copy it again (see the first line)")
	}
}
