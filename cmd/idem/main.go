// Command idem is the idempotency service: an HTTP reverse proxy (sidecar)
// or JSON API that makes retried requests take effect once, on etcd, plus
// the admin commands to inspect what it holds.
//
//	idem serve            run the service (embedded etcd unless --endpoints)
//	idem get KEY          show one key
//	idem ls               list keys
//	idem evict KEY        forget a key so it runs again
//	idem status           etcd cluster and key counts
//	idem echo             a non-idempotent demo upstream
//	idem version          print the version
//
// Run "idem COMMAND -h" for a command's flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	_ "time/tzdata" // schedules' zones, in images without a zone database
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "idem:", err)
	}
	os.Exit(exitCode(err))
}

const usage = `usage: idem COMMAND [flags]

Commands:
  serve     run the idempotency service (embedded etcd unless --endpoints)
  get       show one key:           idem get [--tenant T] KEY
  ls        list keys:              idem ls [--tenant T] [--state in_flight|done]
  evict     forget a key:           idem evict [--tenant T] KEY
  status    etcd cluster and keys:  idem status
  jobs      jobs and schedules:     idem jobs submit|signal|ls|get|retry|cancel|schedules|pause|resume|backfill|limits
  snapshot  etcd backups:           idem snapshot save|restore|bump-epoch
  echo      a non-idempotent demo upstream, to put idem in front of
  injector  the Kubernetes webhook that adds idem as a sidecar to labelled pods
  version   print the version

Run "idem COMMAND -h" for a command's flags.
`

// run runs one command. It is main without the process: tests call it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errUsage
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "serve":
		return serve(ctx, rest, stdout, stderr)
	case "get":
		return adminGet(ctx, rest, stdout, stderr)
	case "ls":
		return adminList(ctx, rest, stdout, stderr)
	case "evict":
		return adminEvict(ctx, rest, stdout, stderr)
	case "status":
		return adminStatus(ctx, rest, stdout, stderr)
	case "jobs":
		return jobsCmd(ctx, rest, stdout, stderr)
	case "snapshot":
		return snapshotCmd(ctx, rest, stdout, stderr)
	case "echo":
		return echo(ctx, rest, stdout, stderr)
	case "injector":
		return injector(ctx, rest, stdout, stderr)
	case "version", "--version":
		fs := flag.NewFlagSet("version", flag.ContinueOnError)
		fs.SetOutput(stderr)
		fs.Usage = func() {
			fmt.Fprint(stderr, "usage: idem version\n\nPrints the release, the module version and the VCS revision idem was built from.\n")
		}
		if err := parseFlags(fs, rest); err != nil {
			return err
		}
		if fs.NArg() > 0 {
			fs.Usage()
			return usageError{fmt.Errorf("version takes no arguments, got %q", fs.Args())}
		}
		fmt.Fprintln(stdout, "idem", version())
		return nil
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return usageError{fmt.Errorf("unknown command %q", cmd)}
}

// errUsage is a usage error: exit code 2.
var errUsage = errors.New("usage")

// exitCode is the process's exit status for err: 0 after -h (help was
// asked for), 2 for a usage error (no or an unknown command, a bad flag or
// argument), 1 for anything else.
func exitCode(err error) int {
	var ue usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage), errors.As(err, &ue):
		return 2
	}
	return 1
}

// usageError marks an error in a command's arguments.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

func version() string {
	v := Release
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	if bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		v += " (module " + bi.Main.Version + ")"
	}
	var rev, when, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			when = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = ", modified"
			}
		}
	}
	if rev != "" {
		v += fmt.Sprintf(" revision %.12s (%s%s)", rev, when, dirty)
	} else {
		v += " (built without VCS information)"
	}
	return v + ", " + bi.GoVersion
}

// Release is the release of idem this source is, or will be: CHANGELOG.md
// lists each one (TestReleaseIsInTheChangelog).
const Release = "0.5.0-dev"
