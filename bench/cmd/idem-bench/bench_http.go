package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"runtime/pprof"
	"strconv"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/idemhttp"
)

// suiteHTTP: the HTTP proxy against the library call and against the
// upstream called directly, all on loopback.
func suiteHTTP(ctx context.Context, b *bencher) ([]suiteReport, error) {
	t, err := b.open(ctx, 1, etcdtest.Options{})
	if err != nil {
		return nil, err
	}
	defer t.close()
	store, err := t.newStore(ctx, t.clients[0], etcdstore.WithCache(256<<20))
	if err != nil {
		return nil, err
	}
	body := payload(b.cfg.payload)
	upstream, err := serveLoopback(labelled("upstream", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(body)
	})))
	if err != nil {
		return nil, err
	}
	defer upstream.Close()
	mw, err := idemhttp.New(idemhttp.Config{Store: store})
	if err != nil {
		return nil, err
	}
	up, _ := url.Parse(upstream.URL)
	proxy, err := idemhttp.NewProxy(up, mw, idemhttp.ProxyOptions{})
	if err != nil {
		return nil, err
	}
	// A plain reverse proxy, no idempotency: what one net/http hop costs.
	// Its transport keeps as many idle connections as idem's does.
	plainRP := httputil.NewSingleHostReverseProxy(up)
	plainRP.Transport = &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 256}
	plain, err := serveLoopback(labelled("plain", plainRP))
	if err != nil {
		return nil, err
	}
	defer plain.Close()
	front, err := serveLoopback(labelled("proxy", proxy))
	if err != nil {
		return nil, err
	}
	defer front.Close()

	// The same, traced as idem serve traces when OTEL_EXPORTER_OTLP_* is
	// set: every span sampled, batched to an exporter that drops them (the
	// cost of making and batching spans, not of a collector's network).
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardSpans{}))
	defer tp.Shutdown(context.Background())
	tracedStore, err := t.newStore(ctx, t.clients[0], etcdstore.WithCache(256<<20), etcdstore.WithTracerProvider(tp))
	if err != nil {
		return nil, err
	}
	tmw, err := idemhttp.New(idemhttp.Config{Store: tracedStore})
	if err != nil {
		return nil, err
	}
	tproxy, err := idemhttp.NewProxy(up, tmw, idemhttp.ProxyOptions{WrapTransport: func(rt http.RoundTripper) http.RoundTripper {
		return otelhttp.NewTransport(rt, otelhttp.WithTracerProvider(tp))
	}})
	if err != nil {
		return nil, err
	}
	tfront, err := serveLoopback(otelhttp.NewHandler(tproxy, "idem", otelhttp.WithTracerProvider(tp)))
	if err != nil {
		return nil, err
	}
	defer tfront.Close()

	client := &http.Client{Transport: &http.Transport{MaxIdleConns: b.cfg.concurrency * 2, MaxIdleConnsPerHost: b.cfg.concurrency * 2}}
	reqBody := []byte(`{"amount":100,"currency":"eur"}`)
	post := func(ctx context.Context, u, key string) (string, error) {
		req, _ := http.NewRequestWithContext(ctx, "POST", u, bytes.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := client.Do(req)
		if err != nil {
			return "", err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			return "", fmt.Errorf("status %d", resp.StatusCode)
		}
		if resp.Header.Get(idemhttp.HeaderReplayed) == "true" {
			return "replayed", nil
		}
		return "created", nil
	}
	lk, pk, tk := &keys{prefix: "lib-"}, &keys{prefix: "proxy-"}, &keys{prefix: "traced-"}
	var done []string
	for i := 0; i < 1000; i++ { // keys for the proxy's replays
		k := "replayed-" + strconv.Itoa(i)
		if _, err := post(ctx, front.URL+"/charges", k); err != nil {
			return nil, err
		}
		done = append(done, k)
	}
	res := b.compare(ctx,
		side{"upstream called directly", func(ctx context.Context, w int) (string, error) {
			return post(ctx, upstream.URL+"/charges", "")
		}},
		side{"library Do calling the upstream", func(ctx context.Context, w int) (string, error) {
			return doOutcome(store.Do(ctx, etcdstore.Key{ID: lk.next()}, reqBody, func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
				_, err := post(ctx, upstream.URL+"/charges", "")
				return body, err
			}))
		}},
		side{"idem proxy, new keys", func(ctx context.Context, w int) (string, error) {
			return post(ctx, front.URL+"/charges", pk.next())
		}},
		side{"idem proxy, replays", func(ctx context.Context, w int) (string, error) {
			return post(ctx, front.URL+"/charges", done[w%len(done)])
		}},
		side{"idem proxy, new keys, traced (all spans sampled)", func(ctx context.Context, w int) (string, error) {
			return post(ctx, tfront.URL+"/charges", tk.next())
		}},
		side{"plain reverse proxy (httputil, no idempotency)", func(ctx context.Context, w int) (string, error) {
			return post(ctx, plain.URL+"/charges", "")
		}},
	)
	// The hop: the time per request (on these shared cores) that a plain
	// net/http reverse proxy adds to calling the upstream directly. The
	// library with that hop added is what a sidecar on net/http can reach.
	hop := 1/res[5].OpsPerS - 1/res[0].OpsPerS
	withHop := &result{OpsPerS: 1 / (1/res[1].OpsPerS + hop)}
	return []suiteReport{{
		Suite: "http", Title: fmt.Sprintf("the HTTP proxy against the library and the upstream, %s, %d clients, loopback", t.name, b.cfg.concurrency),
		Results: res,
		Ratios: []ratio{
			ratioOf("proxy / library", res[2], res[1], 0),
			ratioOf("proxy / upstream direct", res[2], res[0], 0),
			ratioOf("proxy replays / upstream direct", res[3], res[0], 0),
			// Untraced, idem runs no tracing code (a nil check per span);
			// this is what turning tracing on costs.
			ratioOf("proxy traced / untraced", res[4], res[2], 0),
			ratioOf("the library with one net/http hop added / library", withHop, res[1], 0),
			ratioOf("proxy / the library with one net/http hop added", res[2], withHop, 0),
		},
		Extra: map[string]string{"one net/http hop (plain proxy minus direct), µs of these cores per request": fmt.Sprintf("%.1f", hop*1e6)},
	}}, nil
}

// loopbackServer is an HTTP server on a kernel-chosen loopback port.
type loopbackServer struct {
	URL string
	srv *http.Server
}

// labelled runs h under the profiler label server=name, so that a profile
// (--cpuprofile; go tool pprof -tagfocus server=proxy) tells the proxy's
// own CPU from its client's and its upstream's.
func labelled(name string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pprof.Do(r.Context(), pprof.Labels("server", name), func(context.Context) { h.ServeHTTP(w, r) })
	})
}

func serveLoopback(h http.Handler) (*loopbackServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &loopbackServer{URL: "http://" + ln.Addr().String(), srv: &http.Server{Handler: h}}
	go s.srv.Serve(ln)
	return s, nil
}

func (s *loopbackServer) Close() { s.srv.Close() }

// discardSpans is a span exporter that drops what it is given.
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }
