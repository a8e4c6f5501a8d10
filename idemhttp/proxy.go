package idemhttp

import (
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"

	"github.com/idem-dev/idem/fencing"
)

// ProxyOptions configure NewProxy.
type ProxyOptions struct {
	// Timeout bounds the wait for the upstream's response headers (default
	// 30 s). Past it the upstream may have acted without answering: an
	// unknown outcome (see Config.OnUnknownOutcome).
	Timeout time.Duration
	// Transport replaces the default transport (for TLS to the upstream).
	// Timeout is then the transport's to enforce (ResponseHeaderTimeout).
	Transport http.RoundTripper
	// WrapTransport, when set, wraps the transport (Transport or the
	// default): for tracing, say otelhttp.NewTransport.
	WrapTransport func(http.RoundTripper) http.RoundTripper
	// Logger receives upstream errors (default: none).
	Logger *slog.Logger
	// ProblemDocs is the URL of the problem types, linked from the 502 the
	// proxy answers for a request it passed through (default
	// DefaultProblemDocs; "none": no Link).
	ProblemDocs string
}

// noReplay stops net/http from sending a claimed request twice. Its
// Transport re-sends a request that carries an Idempotency-Key header when
// the upstream closes a reused connection before answering
// (golang.org/issue/19943): the upstream may have acted, and idem's promise
// is that it gets the request once. The key goes out under its lower-case
// name (header names are case-insensitive; HTTP/2 sends them so anyway),
// which the Transport does not look for, and the body can be rewound: only
// the re-sends the Transport makes when nothing was written remain.
func noReplay(r *http.Request) {
	for _, name := range []string{HeaderKey, "X-Idempotency-Key"} {
		if vs, ok := r.Header[name]; ok {
			delete(r.Header, name)
			r.Header[strings.ToLower(name)] = vs
		}
	}
	if r.Body != nil && r.Body != http.NoBody && r.GetBody == nil {
		if body, ok := r.Body.(rewindable); ok {
			r.GetBody = body.rewind
		}
	}
}

// NewProxy returns a reverse proxy to upstream, behind mw: idem as a sidecar.
// Requests with a key are claimed, forwarded once with the key and the
// fencing token (header Idempotency-Fence), and their response saved and
// replayed; other requests are forwarded as they are. When the upstream
// cannot be reached, the claim is released and the client gets 502; when
// the request may have reached it but no whole answer came back (a
// timeout, a broken connection, a cut-off body), the claim ends as the
// middleware's OnUnknownOutcome says.
func NewProxy(upstream *url.URL, mw *Middleware, o ProxyOptions) (http.Handler, error) {
	rp, err := ReverseProxy(upstream, o)
	if err != nil {
		return nil, err
	}
	return mw.Wrap(rp), nil
}

// ReverseProxy returns the reverse proxy NewProxy puts behind a
// Middleware, for callers that put handlers of their own between the two.
// It reports a failed upstream call to the middleware (NoResponse) and
// never lets net/http send a claimed request twice.
func ReverseProxy(upstream *url.URL, o ProxyOptions) (http.Handler, error) {
	if upstream == nil || upstream.Scheme != "http" && upstream.Scheme != "https" || upstream.Host == "" {
		return nil, errors.New("idemhttp: upstream must be an absolute http or https URL")
	}
	if o.Timeout <= 0 {
		o.Timeout = 30 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	tr := o.Transport
	if tr == nil {
		tr = &http.Transport{
			Proxy:                 nil, // a sidecar talks to its app directly
			DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          256,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: o.Timeout,
			ExpectContinueTimeout: time.Second,
			// The client's Accept-Encoding goes through as it came. net/http
			// would otherwise ask the upstream for gzip on a request that
			// named no encoding and unzip the answer itself: CPU on both
			// sides of a hop that is most often loopback.
			DisableCompression: true,
			WriteBufferSize:    32 << 10,
			ReadBufferSize:     32 << 10,
		}
	}
	if o.WrapTransport != nil {
		tr = o.WrapTransport(tr)
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(upstream)
			pr.SetXForwarded()
			if pr.Out.Header.Get(fencing.Header) != "" {
				noReplay(pr.Out)
			}
		},
		Transport: tr,
		// httputil's own messages (a body cut off while it was copied) go
		// to the same logger, not to the standard logger's stderr.
		ErrorLog: slog.NewLogLogger(o.Logger.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			o.Logger.Warn("idem: upstream error", "method", r.Method, "err", err)
			if NoResponse(w, err) {
				return // the middleware answers and ends the claim
			}
			p := NewProblem(http.StatusBadGateway, KindUpstreamUnavailable, "no response from the upstream: "+err.Error())
			p.Docs = problemDocs(o.ProblemDocs)
			p.Write(w)
		},
	}
	return rp, nil
}
