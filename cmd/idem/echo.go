package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

const echoUsage = `usage: idem echo [--listen ADDR]

Runs a deliberately non-idempotent demo upstream: every request is a new
"charge" with a new id. Put idem serve --upstream in front of it to see a
retry replayed instead of charged twice.

Flags:
`

// echo runs the demo upstream until ctx ends.
func echo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("echo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, echoUsage); fs.PrintDefaults() }
	listen := fs.String("listen", "127.0.0.1:9000", "address to listen on")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	var charges atomic.Int64
	srv := &http.Server{
		ReadHeaderTimeout: 10 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
			n := charges.Add(1)
			log.Info("charge", "n", n, "method", r.Method, "path", r.URL.Path,
				"idempotency_key", r.Header.Get("Idempotency-Key"), "fence", r.Header.Get("Idempotency-Fence"))
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			json.NewEncoder(w).Encode(map[string]any{
				"charge": fmt.Sprintf("ch_%d", n), "method": r.Method, "path": r.URL.Path, "request": string(body),
			})
		}),
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	log.Info("idem echo listening", "listen", ln.Addr().String())
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
