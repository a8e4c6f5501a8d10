// Command idem-bench measures idem against what it is built on (raw etcd
// transactions, reads, a lock) and against the peers a user would pick
// instead (PostgreSQL), each comparison in one run, and reports the ratios.
// It lives in a module of its own so that the idem binary and the library
// never link its peers' drivers or the test clusters' fault proxies.
//
//	go -C bench run ./cmd/idem-bench --suite do,replay
//	bench/bench-pg.sh --suite mix
//
// Run "idem-bench -h" for the suites and flags; docs/PERFORMANCE.md has every
// measurement with the command that produced it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := bench(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "idem-bench:", err)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "idem-bench:", err)
		os.Exit(1)
	}
}

// usageError marks an error in the arguments: exit code 2.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// parseFlags parses args; a bad flag is a usage error.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err}
	}
	return nil
}

// listFlag is a comma-separated list that may also be repeated. The first
// value given replaces the default; later ones add to it.
type listFlag struct {
	vals []string
	set  bool
}

func list(vals ...string) listFlag { return listFlag{vals: vals} }

func (l *listFlag) String() string { return strings.Join(l.vals, ",") }

func (l *listFlag) Set(s string) error {
	if !l.set {
		l.vals, l.set = nil, true
	}
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			l.vals = append(l.vals, v)
		}
	}
	return nil
}

// etcdFlags names an external etcd to measure instead of embedded clusters.
type etcdFlags struct {
	endpoints listFlag
}

func (e *etcdFlags) register(fs *flag.FlagSet) {
	fs.Var(&e.endpoints, "endpoints", "etcd endpoints to measure, comma-separated (none: start embedded clusters)")
}

func (e *etcdFlags) client() (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{Endpoints: e.endpoints.vals, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
}
