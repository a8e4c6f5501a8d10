package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/idem-dev/idem/internal/inject"
	"github.com/idem-dev/idem/internal/tlsfiles"
)

const injectorUsage = `usage: idem injector --tls-cert-file F --tls-key-file F --image IMAGE [flags]

Serves the Kubernetes mutating admission webhook that adds idem as a
sidecar to every pod labelled idem.dev/inject=true, in front of the app's
port, as the pod's idem.dev/* annotations say (deploy/README.md, "Put idem
in front of your service"). It serves POST /inject and GET /livez over TLS
only (the API server calls webhooks over HTTPS); the certificate files are
read again when they change, as cert-manager renews them. It talks to no
etcd: the sidecars it adds do.

Every flag can also be set with an environment variable: IDEM_ and the
flag's name in capitals, dashes as underscores.

Flags:
`

type injectorConfig struct {
	listen, certFile, keyFile, logFormat, resources string
	cfg                                             inject.Config
}

func injectorFlags(stderr io.Writer) (*flag.FlagSet, *injectorConfig) {
	c := &injectorConfig{}
	fs := flag.NewFlagSet("injector", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, injectorUsage); fs.PrintDefaults() }
	fs.StringVar(&c.listen, "listen", "127.0.0.1:9443", "address of the webhook's TLS listener")
	fs.StringVar(&c.certFile, "tls-cert-file", "", "the webhook's certificate (PEM; reloaded when it changes); required")
	fs.StringVar(&c.keyFile, "tls-key-file", "", "key of --tls-cert-file; required")
	fs.StringVar(&c.logFormat, "log-format", "json", "log format: json or text")
	fs.StringVar(&c.cfg.Image, "image", "", "idem's image, as injected; required")
	fs.StringVar(&c.cfg.PullPolicy, "image-pull-policy", "", "the sidecar's imagePullPolicy: Always, IfNotPresent or Never (empty: Kubernetes' default)")
	fs.StringVar(&c.cfg.Endpoints, "endpoints", "", "etcd client URLs the sidecars use, comma-separated, unless a pod's idem.dev/etcd-endpoints or idem.dev/shards-configmap says otherwise")
	fs.StringVar(&c.cfg.EtcdTLSSecret, "etcd-tls-secret", "", "Secret (in each pod's namespace) with the sidecars' etcd client certificate: tls.crt, tls.key, ca.crt (empty: no client TLS)")
	fs.StringVar(&c.cfg.Prefix, "prefix", "", "etcd key prefix of the sidecars (empty: idem's default, /idem/)")
	fs.DurationVar(&c.cfg.Retention, "retention", 24*time.Hour, "the sidecars' key retention unless a pod's idem.dev/retention says otherwise")
	fs.DurationVar(&c.cfg.SessionTTL, "session-ttl", 10*time.Second, "the sidecars' --session-ttl")
	fs.DurationVar(&c.cfg.ShutdownGrace, "shutdown-grace", 40*time.Second, "the sidecars' --shutdown-grace: keep it under the pods' terminationGracePeriodSeconds")
	fs.IntVar(&c.cfg.PreStopSeconds, "pre-stop-seconds", 0, "a preStop sleep for the sidecar, seconds (0: none; a native sidecar is stopped only after the app has exited)")
	fs.BoolVar(&c.cfg.Native, "native-sidecars", true, "inject idem as a native sidecar (an init container with restartPolicy: Always; Kubernetes 1.29 and later); false: as one more app container, for older clusters")
	fs.StringVar(&c.resources, "resources", `{"requests":{"cpu":"100m","memory":"64Mi"},"limits":{"memory":"256Mi"}}`, "the sidecar's resources, as JSON: requests and limits of Kubernetes quantities ({} for none)")
	return fs, c
}

func (c *injectorConfig) validate() error {
	switch {
	case c.certFile == "" || c.keyFile == "":
		return errors.New("--tls-cert-file and --tls-key-file are required: the API server calls webhooks over HTTPS only")
	case c.cfg.Image == "":
		return errors.New("--image is required: the idem image the sidecars run")
	case strings.ContainsAny(c.cfg.Image, " \t\n"):
		return fmt.Errorf("--image %q: an image reference has no spaces", c.cfg.Image)
	case c.logFormat != "json" && c.logFormat != "text":
		return fmt.Errorf("--log-format %q: must be json or text", c.logFormat)
	case c.cfg.Retention < time.Second || c.cfg.Retention%time.Second != 0:
		return fmt.Errorf("--retention %v: must be a whole number of seconds, at least 1s (as idem serve takes it)", c.cfg.Retention)
	case c.cfg.Prefix != "" && !strings.HasSuffix(c.cfg.Prefix, "/"):
		return fmt.Errorf("--prefix %q: must end in / (as idem serve takes it)", c.cfg.Prefix)
	case c.cfg.SessionTTL < time.Second || c.cfg.SessionTTL%time.Second != 0:
		return fmt.Errorf("--session-ttl %v: must be a whole number of seconds, at least 1s", c.cfg.SessionTTL)
	case c.cfg.ShutdownGrace < 0 || c.cfg.PreStopSeconds < 0:
		return errors.New("--shutdown-grace and --pre-stop-seconds cannot be negative")
	}
	switch c.cfg.PullPolicy {
	case "", "Always", "IfNotPresent", "Never":
	default:
		return fmt.Errorf("--image-pull-policy %q: must be Always, IfNotPresent or Never", c.cfg.PullPolicy)
	}
	var res map[string]map[string]any
	d := json.NewDecoder(strings.NewReader(c.resources))
	d.UseNumber()
	if err := d.Decode(&res); err != nil {
		return fmt.Errorf("--resources %q: not a JSON object of requests and limits: %v", c.resources, err)
	}
	c.cfg.Resources = map[string]map[string]string{}
	for k, m := range res {
		c.cfg.Resources[k] = map[string]string{}
		for name, q := range m {
			c.cfg.Resources[k][name] = fmt.Sprint(q) // a number (cpu: 1) is a quantity too
		}
	}
	if err := inject.CheckResources(c.cfg.Resources); err != nil {
		return fmt.Errorf("--resources: %w", err)
	}
	if c.cfg.Endpoints != "" {
		if err := inject.CheckEndpoints(c.cfg.Endpoints); err != nil {
			return fmt.Errorf("--endpoints: %w", err)
		}
	}
	return nil
}

// injector runs the sidecar injection webhook until ctx ends.
func injector(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, c := injectorFlags(stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return usageError{fmt.Errorf("injector takes no arguments, got %q", fs.Args())}
	}
	if err := c.validate(); err != nil {
		return usageError{err}
	}
	kp, err := tlsfiles.LoadKeypair(c.certFile, c.keyFile)
	if err != nil {
		return usageError{fmt.Errorf("--tls-cert-file/--tls-key-file: %w", err)}
	}
	var h slog.Handler = slog.NewJSONHandler(stderr, nil)
	if c.logFormat == "text" {
		h = slog.NewTextHandler(stderr, nil)
	}
	log := slog.New(h)
	mux := http.NewServeMux()
	mux.Handle("/inject", c.cfg.Handler(log))
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") })
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		TLSConfig:         &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: kp.GetCertificate},
		ErrorLog:          slog.NewLogLogger(h, slog.LevelWarn),
	}
	ln, err := net.Listen("tcp", c.listen)
	if err != nil {
		return usageError{fmt.Errorf("--listen: %w", err)}
	}
	log.Info("idem injector listening", "listen", ln.Addr().String(), "image", c.cfg.Image, "native_sidecars", c.cfg.Native)
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.ServeTLS(ln, "", ""); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	<-done
	return nil
}
