package main

import (
	"google.golang.org/grpc"
	"slices"

	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/internal/tlsfiles"
)

// envName is the environment variable that sets flag name: IDEM_ and the
// name in upper case with dashes as underscores (--session-ttl:
// IDEM_SESSION_TTL).
func envName(name string) string {
	return "IDEM_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// parseFlags sets every flag of fs from its environment variable, then from
// args: the command line wins. A bad environment value is an error naming
// the variable.
func parseFlags(fs *flag.FlagSet, args []string) error {
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if v, ok := os.LookupEnv(envName(f.Name)); ok && err == nil {
			if e := fs.Set(f.Name, v); e != nil {
				err = usageError{fmt.Errorf("environment %s=%q: %w", envName(f.Name), v, e)}
			}
		}
	})
	if err != nil {
		return err
	}
	// Flags may come after the arguments too (idem jobs signal ID EVENT
	// --payload JSON, as JOBS.md writes it); "--" ends the flags.
	// "--" ends the flags wherever it is: what follows is arguments,
	// even an argument that starts with "-" (a key "-x").
	var pos, tail []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, tail = args[:i], args[i+1:]
	}
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return err
			}
			return usageError{err}
		}
		rest := fs.Args()
		i := 0
		for i < len(rest) && (rest[i] == "-" || !strings.HasPrefix(rest[i], "-")) {
			i++
		}
		pos = append(pos, rest[:i]...)
		if i == len(rest) {
			break
		}
		args = rest[i:]
	}
	pos = append(pos, tail...)
	if err := fs.Parse(append([]string{"--"}, pos...)); err != nil {
		return usageError{err}
	}
	if fs.NArg() > 0 && fs.Name() == "serve" {
		return usageError{fmt.Errorf("unexpected arguments: %q", fs.Args())}
	}
	return nil
}

// listFlag is a comma-separated list that may also be repeated. The first
// value given replaces the default; later ones add to it. Register it with
// fs.Var(list(&l), ...): the value that tracks whether it was set lives
// with the flag, so flag sets parsed at once (tests run commands in
// parallel) share nothing.
type listFlag []string

// listValue is the flag.Value of a listFlag.
type listValue struct {
	l   *listFlag
	set bool
}

func list(l *listFlag) *listValue { return &listValue{l: l} }

func (v *listValue) String() string {
	if v == nil || v.l == nil {
		return ""
	}
	return strings.Join(*v.l, ",")
}

func (v *listValue) Set(s string) error {
	if !v.set {
		*v.l, v.set = nil, true
	}
	for _, x := range strings.Split(s, ",") {
		if x = strings.TrimSpace(x); x != "" {
			*v.l = append(*v.l, x)
		}
	}
	return nil
}

// etcdFlags are the connection flags, named as etcdctl names them.
type etcdFlags struct {
	dialOptions []grpc.DialOption // tracing

	endpoints   listFlag
	cacert      string
	cert        string
	key         string
	user        string
	password    string
	dialTimeout time.Duration
	prefix      string
}

func (e *etcdFlags) register(fs *flag.FlagSet, defaultEndpoints []string) {
	e.registerConnection(fs, defaultEndpoints)
	fs.StringVar(&e.prefix, "prefix", "/idem/", "etcd key prefix of idem's data")
}

// registerConnection registers the flags that say how to reach etcd, and
// not --prefix: for commands that read the whole of etcd (snapshot save).
func (e *etcdFlags) registerConnection(fs *flag.FlagSet, defaultEndpoints []string) {
	e.prefix = "/idem/"
	e.endpoints = defaultEndpoints
	usage := "etcd endpoints, comma-separated"
	if len(defaultEndpoints) == 0 {
		usage += " (none: start an embedded etcd)"
	}
	fs.Var(list(&e.endpoints), "endpoints", usage)
	fs.StringVar(&e.cacert, "cacert", "", "verify etcd's certificate with this CA bundle")
	fs.StringVar(&e.cert, "cert", "", "client certificate for etcd (mTLS)")
	fs.StringVar(&e.key, "key", "", "client certificate key for etcd (mTLS)")
	fs.StringVar(&e.user, "user", "", "etcd user name, or user:password")
	fs.StringVar(&e.password, "password", "", "etcd password (prefer IDEM_PASSWORD to the command line)")
	fs.DurationVar(&e.dialTimeout, "dial-timeout", 5*time.Second, "timeout for connecting to etcd")
}

// tlsConfig builds the TLS configuration for etcd, or nil when no TLS flag
// is set. Endpoints with https:// and no --cacert use the system roots.
func (e *etcdFlags) tlsConfig() (*tls.Config, error) {
	secure := false
	for _, ep := range e.endpoints {
		secure = secure || strings.HasPrefix(ep, "https://")
	}
	if e.cacert == "" && e.cert == "" && e.key == "" && !secure {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if e.cacert != "" {
		pool, err := tlsfiles.LoadCAs(e.cacert)
		if err != nil {
			return nil, fmt.Errorf("--cacert: %w", err)
		}
		cfg.RootCAs = pool
	}
	if (e.cert == "") != (e.key == "") {
		return nil, errors.New("--cert and --key go together")
	}
	if e.cert != "" {
		// Re-read when the files change: a rotated certificate is used
		// from the next connection on, without a restart.
		kp, err := tlsfiles.LoadKeypair(e.cert, e.key)
		if err != nil {
			return nil, fmt.Errorf("--cert/--key: %w", err)
		}
		cfg.GetClientCertificate = kp.GetClientCertificate
	}
	return cfg, nil
}

// client connects to etcd.
func (e *etcdFlags) client() (*clientv3.Client, error) {
	cfg, err := e.config()
	if err != nil {
		return nil, err
	}
	return clientv3.New(cfg)
}

// config is the etcd client configuration the flags describe.
func (e *etcdFlags) config() (clientv3.Config, error) {
	if len(e.endpoints) == 0 {
		return clientv3.Config{}, errors.New("--endpoints: none given")
	}
	tlsCfg, err := e.tlsConfig()
	if err != nil {
		return clientv3.Config{}, err
	}
	user, password := e.user, e.password
	if u, p, ok := strings.Cut(user, ":"); ok {
		user, password = u, p
	}
	if user != "" && password == "" {
		return clientv3.Config{}, errors.New("--user needs a password (--password, IDEM_PASSWORD, or --user name:password)")
	}
	return clientv3.Config{
		Endpoints:            e.endpoints,
		DialTimeout:          e.dialTimeout,
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		TLS:                  tlsCfg,
		Username:             user,
		Password:             password,
		Logger:               zap.NewNop(),
		RejectOldCluster:     false,
		DialOptions:          e.dialOptions,
	}, nil
}

// explain adds to err, a failure to reach etcd, what a direct connection to
// each endpoint says: the gRPC client retries a refused TLS handshake until
// its deadline and reports only the deadline, which sends people looking in
// the wrong place.
func (e *etcdFlags) explain(err error) error {
	if err == nil || !(errors.Is(err, context.DeadlineExceeded) || status.Code(err) == codes.Unavailable || status.Code(err) == codes.DeadlineExceeded) {
		return err
	}
	tlsCfg, cerr := e.tlsConfig()
	if cerr != nil {
		return err
	}
	var why []string
	for _, ep := range e.endpoints {
		if p := probe(ep, tlsCfg, e.dialTimeout); p != "" {
			why = append(why, ep+": "+p)
		}
	}
	if len(why) == 0 {
		return err
	}
	return fmt.Errorf("%w (%s)", err, strings.Join(why, "; "))
}

// probe connects to one endpoint as the client would and returns what went
// wrong, or "" if nothing did.
func probe(endpoint string, tlsCfg *tls.Config, timeout time.Duration) string {
	network, host := "tcp", endpoint
	if sock, ok := unixSocket(endpoint); ok {
		network, host = "unix", sock
	} else if u, err := url.Parse(endpoint); err == nil && u.Host != "" {
		host = u.Host
	}
	timeout = min(max(timeout, time.Second), 5*time.Second)
	conn, err := net.DialTimeout(network, host, timeout)
	if err != nil {
		return err.Error()
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(timeout))
	if tlsCfg == nil {
		// Is it a TLS server? Only a handshake tells; nothing is sent
		// past it, and the certificate is not trusted for anything.
		tc := tls.Client(conn, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}}) //nolint:gosec // probing only
		if tc.Handshake() == nil {
			return "the endpoint speaks TLS: use https:// and --cacert"
		}
		return ""
	}
	cfg := tlsCfg.Clone()
	if cfg.ServerName == "" {
		cfg.ServerName, _, _ = net.SplitHostPort(host)
	}
	cfg.NextProtos = []string{"h2"}
	tc := tls.Client(conn, cfg)
	if err := tc.Handshake(); err != nil {
		return err.Error()
	}
	// With TLS 1.3 the server checks the client certificate after the
	// client's side of the handshake: its verdict arrives as an alert on
	// the first read. A server that accepted us waits for our preface.
	tc.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := tc.Read(make([]byte, 1)); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return ""
		}
		if strings.Contains(err.Error(), "tls") {
			return err.Error()
		}
	}
	return ""
}

// socketsExist checks the unix socket endpoints before a client dials
// them: a socket that is not there (idem serve runs in another directory,
// or not at all) is named at once, instead of a dial that waits out its
// timeout and says "context deadline exceeded".
func (e *etcdFlags) socketsExist() error {
	for _, ep := range e.endpoints {
		path, ok := strings.CutPrefix(ep, "unix://")
		if !ok {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			return fmt.Errorf("no etcd at %s: %w (the embedded etcd of an idem serve started in this directory; give --endpoints for another)", ep, err)
		}
	}
	return nil
}
