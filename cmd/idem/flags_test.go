package main

import (
	"errors"
	"flag"
	"io"
	"os"
	"strings"
	"testing"
)

func TestServeRefusesBadFlagsBeforeStartingAnything(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--upstream", "ftp://example.com"}, "--upstream"},
		{[]string{"--upstream", "/relative"}, "--upstream"},
		{[]string{"--on-unknown-outcome", "retry"}, "--on-unknown-outcome"},
		{[]string{"--zone", "eu west"}, "--zone"},
		{[]string{"--log-format", "xml"}, "--log-format"},
		{[]string{"--log-level", "loud"}, "--log-level"},
		{[]string{"--tenant-header", "X-Tenant"}, "--trusted-proxies"},
		{[]string{"--tenant-header", "X-Tenant", "--trusted-proxies", "not-an-ip"}, "--trusted-proxies"},
		{[]string{"--require-key", "pay"}, "must start with /"},
		{[]string{"--shutdown-grace", "0s"}, "--shutdown-grace"},
		{[]string{"--session-ttl", "soon"}, "invalid value"},
		{[]string{"extra-arg"}, "unexpected arguments"},
		{[]string{"--no-such-flag"}, "not defined"},
		{[]string{"--on-status", "429=keep"}, "--on-status"},
		{[]string{"--on-status", "7xx=save"}, "not a status"},
		{[]string{"--replay-deny-headers", "Bad Name"}, "--replay-deny-headers"},
		{[]string{"--replay-allow-headers", "X-Ok,a:b"}, "--replay-allow-headers"},
		{[]string{"--problem-docs-url", "docs/HTTP.md"}, "--problem-docs-url"},
		{[]string{"--console-hosts", "idem.example"}, "--console-hosts needs --console"},
		{[]string{"--console", "--console-hosts", "https://idem.example"}, "--console-hosts"},
		{[]string{"--console", "--console-hosts", "idem.example:8081"}, "--console-hosts"},
		// Values the store refuses: found before etcd is called, with an
		// external etcd that does not answer too.
		{[]string{"--endpoints", "127.0.0.1:1", "--session-ttl", "1500ms"}, "--session-ttl 1.5s"},
		{[]string{"--session-ttl", "1s"}, "--session-ttl"},
		{[]string{"--retention", "1500ms"}, "--retention"},
		{[]string{"--bucket-width", "1500ms"}, "--bucket-width"},
		{[]string{"--request-timeout", "-1s"}, "--request-timeout"},
		{[]string{"--claim-deadline", "500ms"}, "--upstream-timeout 30s"},
	} {
		out, err := runCmd(t, append([]string{"serve", "--data-dir", t.TempDir()}, tc.args...)...)
		if err == nil || !strings.Contains(err.Error()+out, tc.want) {
			t.Errorf("serve %v = %v; want an error naming %q", tc.args, err, tc.want)
		}
		if code := exitCode(err); code != 2 {
			t.Errorf("serve %v: exit %d (%v), want 2: a configuration error", tc.args, code, err)
		}
	}
}

func TestEnvironmentSetsFlagsAndCommandLineWins(t *testing.T) {
	t.Setenv("IDEM_LOG_FORMAT", "xml")
	_, err := runCmd(t, "serve")
	if err == nil || !strings.Contains(err.Error(), "--log-format") {
		t.Fatalf("IDEM_LOG_FORMAT=xml: %v; want --log-format refused", err)
	}
	t.Setenv("IDEM_LOG_FORMAT", "text")
	t.Setenv("IDEM_SESSION_TTL", "soon")
	_, err = runCmd(t, "serve")
	if err == nil || !strings.Contains(err.Error(), "IDEM_SESSION_TTL") {
		t.Fatalf("IDEM_SESSION_TTL=soon: %v; want an error naming the variable", err)
	}
	t.Setenv("IDEM_SESSION_TTL", "")
	t.Setenv("IDEM_SESSION_TTL", "5s")
	t.Setenv("IDEM_UPSTREAM", "ftp://bad")
	_, err = runCmd(t, "serve", "--upstream", "ftp://also-bad-but-from-the-command-line")
	if err == nil || !strings.Contains(err.Error(), "also-bad") {
		t.Fatalf("command line vs environment: %v; want the command line's value", err)
	}
	if envName("session-ttl") != "IDEM_SESSION_TTL" {
		t.Fatalf("envName = %s", envName("session-ttl"))
	}
}

func TestCommands(t *testing.T) {
	if _, err := runCmd(t); !errors.Is(err, errUsage) || exitCode(err) != 2 {
		t.Fatalf("no command = %v (exit %d); want a usage error", err, exitCode(err))
	}
	if out, err := runCmd(t, "frobnicate"); exitCode(err) != 2 || !strings.Contains(out, "usage") {
		t.Fatalf("unknown command = %q, %v (exit %d); want usage, exit 2", out, err, exitCode(err))
	}
	if _, err := runCmd(t, "serve", "--no-such-flag"); exitCode(err) != 2 {
		t.Fatalf("unknown flag = %v (exit %d); want exit 2", err, exitCode(err))
	}
	if out, err := runCmd(t, "version"); err != nil || !strings.HasPrefix(out, "idem "+Release) {
		t.Fatalf("version = %q, %v; want idem %s ...", out, err, Release)
	}
	if out, err := runCmd(t, "version", "-h"); exitCode(err) != 0 || !strings.Contains(out, "usage: idem version") || strings.Contains(out, Release) {
		t.Fatalf("version -h = %q, %v; want its help, not the version", out, err)
	}
	if _, err := runCmd(t, "version", "extra"); exitCode(err) != 2 {
		t.Fatalf("version extra = %v; want a usage error", err)
	}
	if _, err := runCmd(t, "get"); exitCode(err) != 2 {
		t.Fatalf("get without a key = %v; want a usage error", err)
	}
	if _, err := runCmd(t, "get", "-w", "yaml", "k"); exitCode(err) != 2 {
		t.Fatalf("get -w yaml = %v; want a usage error", err)
	}
	if _, err := runCmd(t, "ls", "--tenant", "a/b"); exitCode(err) != 2 {
		t.Fatalf("ls --tenant a/b = %v; want a usage error", err)
	}
	// Help asked for is not an error: exit 0, as idem --help.
	for _, args := range [][]string{{"--help"}, {"serve", "-h"}, {"serve", "--help"}, {"get", "-h"}, {"ls", "-h"}, {"evict", "-h"}, {"status", "-h"}, {"echo", "-h"},
		{"jobs", "-h"}, {"jobs", "ls", "-h"}, {"jobs", "get", "-h"}, {"jobs", "retry", "-h"}, {"jobs", "cancel", "-h"}, {"jobs", "schedules", "-h"}} {
		if _, err := runCmd(t, args...); exitCode(err) != 0 {
			t.Errorf("idem %s = %v (exit %d); want exit 0", strings.Join(args, " "), err, exitCode(err))
		}
	}
}

// docs/CLI.md documents every flag of serve and of the admin commands.
func TestCLIDocNamesEveryFlag(t *testing.T) {
	doc, err := os.ReadFile("../../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	var c serveConfig
	cancel := newJobsCmd("cancel", "", io.Discard)
	cancel.fs.String("reason", "", "")
	cancel.fs.Duration("retention", 0, "")
	sets := []*flag.FlagSet{c.flags(io.Discard), newAdminCmd("ls", "", io.Discard).fs, cancel.fs}
	for _, fs := range sets {
		fs.VisitAll(func(f *flag.Flag) {
			if !strings.Contains(string(doc), "-"+f.Name+" ") && !strings.Contains(string(doc), "-"+f.Name+"\n") {
				t.Errorf("docs/CLI.md does not document -%s of %s", f.Name, fs.Name())
			}
		})
	}
}

func TestListFlagReplacesItsDefault(t *testing.T) {
	l := listFlag{"POST", "PATCH"}
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.Var(list(&l), "methods", "")
	if err := fs.Parse([]string{"--methods", "PUT", "--methods", "DELETE,POST"}); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(l, ","); got != "PUT,DELETE,POST" {
		t.Fatalf("methods = %s; want PUT,DELETE,POST (the default replaced, then extended)", got)
	}
}
