package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
)

// Defaults of Config.
const (
	DefaultMaxRequestBody  = 1 << 20
	DefaultMaxResponseBody = 1<<20 - 64<<10 // leaves room for headers in a 1 MiB record
	DefaultMaxWait         = 60 * time.Second
)

// headerRoom is the part of a record kept for a response's headers.
const headerRoom = 64 << 10

// Config configures a Middleware. Store is required; every other field has a
// default.
type Config struct {
	Store *etcdstore.Store

	// Methods are the methods whose requests are claimed when they carry an
	// Idempotency-Key (default POST and PATCH). Others pass through.
	Methods []string
	// RequireKey reports whether a request of a claimed method must carry a
	// key; without one it gets 400. Nil: a key is never required.
	RequireKey func(*http.Request) bool
	// Tenant scopes keys (default FixedTenant(etcdstore.DefaultTenant)).
	Tenant TenantFunc
	// FingerprintHeaders are request headers that are part of the
	// fingerprint, besides method, path, query and body.
	FingerprintHeaders []string
	// MaxRequestBody is the largest request body accepted with a key
	// (default 1 MiB); larger gets 413 before anything is claimed.
	MaxRequestBody int64
	// MaxResponseBody is the largest response body saved (default 960 KiB).
	// A larger response is streamed to its client and a problem saying so is
	// saved and replayed instead: the work ran once, but its response
	// cannot be replayed.
	MaxResponseBody int
	// Save5xx reports whether a 5xx response is saved and replayed (true,
	// the default, as Stripe does) or released so a retry runs again (safe
	// only if the handler is idempotent downstream).
	Save5xx func(*http.Request) bool
	// KeepOnNoResponse says how a claim ends when the handler got no
	// response (NoResponse: the upstream was unreachable or timed out).
	// False (the default) releases it: there is no answer to save, and the
	// retry reaches the upstream again with the same key, which an upstream
	// that dedupes by key turns into its first answer. True abandons it
	// with its fingerprint, for the next request to resume.
	KeepOnNoResponse bool
	// MaxWait caps "Prefer: wait=N" (default 60 s).
	MaxWait time.Duration
	// ClaimDeadline, when set, gives every claim a deadline (see
	// etcdstore.WithDeadline). It must outlast the slowest honest request.
	ClaimDeadline time.Duration
	// Logger gets one line per claimed or refused request (default: none).
	// Keys are logged as a hash unless LogKeys; bodies never.
	Logger  *slog.Logger
	LogKeys bool
	// Metrics, when set, counts requests by outcome.
	Metrics *Metrics
}

// Middleware makes the requests of an http.Handler idempotent by key.
type Middleware struct {
	cfg Config
}

// New validates cfg and returns a Middleware.
func New(cfg Config) (*Middleware, error) {
	if cfg.Store == nil {
		return nil, errors.New("idemhttp: nil store")
	}
	if len(cfg.Methods) == 0 {
		cfg.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	for i, m := range cfg.Methods {
		switch m {
		case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete:
		default:
			return nil, fmt.Errorf("idemhttp: method %q cannot be claimed", m)
		}
		cfg.Methods[i] = m
	}
	if cfg.Tenant == nil {
		cfg.Tenant = FixedTenant(etcdstore.DefaultTenant)
	}
	if cfg.MaxRequestBody <= 0 {
		cfg.MaxRequestBody = DefaultMaxRequestBody
	}
	if cfg.MaxResponseBody <= 0 {
		cfg.MaxResponseBody = min(DefaultMaxResponseBody, cfg.Store.MaxRecordSize()-headerRoom)
	}
	if cfg.MaxResponseBody > cfg.Store.MaxRecordSize()-headerRoom {
		return nil, fmt.Errorf("idemhttp: MaxResponseBody %d leaves no room for headers in the store's %d-byte records (at most %d)",
			cfg.MaxResponseBody, cfg.Store.MaxRecordSize(), cfg.Store.MaxRecordSize()-headerRoom)
	}
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Middleware{cfg: cfg}, nil
}

// Wrap returns next behind the middleware.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		outcome := m.serve(w, r, next)
		if mt := m.cfg.Metrics; mt != nil {
			mt.Requests.WithLabelValues(outcome).Inc()
			mt.Duration.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
		}
	})
}

// request is one keyed request on its way through the middleware.
type request struct {
	r      *http.Request
	key    etcdstore.Key
	fp     etcdstore.Fingerprint
	body   []byte
	logKey string
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) string {
	// The fence header is idem's to set: a client must never forge one. It
	// is dropped from requests idem passes through, and refuses a keyed
	// request that carries one.
	forged := len(r.Header.Values(fencing.Header)) > 0
	r.Header.Del(fencing.Header)
	if !slices.Contains(m.cfg.Methods, r.Method) {
		next.ServeHTTP(w, r)
		return OutcomePassthrough
	}
	id, err := keyFromHeader(r.Header)
	if err != nil {
		return m.refuse(w, r, NewProblem(http.StatusBadRequest, KindInvalidKey, err.Error()))
	}
	if id == "" {
		if m.cfg.RequireKey != nil && m.cfg.RequireKey(r) {
			return m.refuse(w, r, NewProblem(http.StatusBadRequest, KindMissingKey,
				"this route requires an Idempotency-Key header: generate one per operation and send it on every retry"))
		}
		next.ServeHTTP(w, r)
		return OutcomePassthrough
	}
	if forged {
		return m.refuse(w, r, NewProblem(http.StatusBadRequest, KindInvalidRequest,
			fencing.Header+" is set by idem for the upstream; a client must not send it"))
	}
	req, p := m.parse(w, r, id)
	if p != nil {
		return m.refuse(w, r, *p)
	}
	w.Header().Set(HeaderRetention, strconv.Itoa(int(m.cfg.Store.Retention().Seconds())))

	var opts []etcdstore.ClaimOption
	if m.cfg.ClaimDeadline > 0 {
		opts = append(opts, etcdstore.WithDeadline(m.cfg.ClaimDeadline))
	}
	waitUntil := time.Now().Add(preferWait(r.Header, m.cfg.MaxWait))
	for {
		outcome, err := m.run(w, req, next, opts)
		var ce *etcdstore.ConflictError
		if !errors.As(err, &ce) || !time.Now().Before(waitUntil) {
			if err != nil {
				return m.fail(w, req, err)
			}
			return outcome
		}
		// Prefer: wait=N. Wait on the key's Watch, then claim again: the key
		// is done (replay), released (run), or stale (take over).
		if m.cfg.Metrics != nil {
			m.cfg.Metrics.Waits.Inc()
		}
		wctx, cancel := context.WithDeadline(r.Context(), waitUntil)
		_, werr := m.cfg.Store.Wait(wctx, req.key)
		cancel()
		if r.Context().Err() != nil {
			return OutcomeError
		}
		if werr != nil && !errors.Is(werr, etcdstore.ErrNotFound) && !errors.Is(werr, context.DeadlineExceeded) {
			return m.fail(w, req, werr)
		}
	}
}

// parse validates the key and tenant, reads the body and fingerprints it.
func (m *Middleware) parse(w http.ResponseWriter, r *http.Request, id string) (*request, *Problem) {
	tenant, err := m.cfg.Tenant(r)
	if err != nil {
		p := tenantProblem(err)
		return nil, &p
	}
	key := etcdstore.Key{Tenant: tenant, ID: id}
	if err := key.Validate(); err != nil {
		p := ProblemFor(err)
		return nil, &p
	}
	if r.ContentLength > m.cfg.MaxRequestBody {
		p := NewProblem(http.StatusRequestEntityTooLarge, KindRequestTooLarge,
			fmt.Sprintf("request body is %d bytes, limit %d", r.ContentLength, m.cfg.MaxRequestBody))
		return nil, &p
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxRequestBody))
	if err != nil {
		var mbe *http.MaxBytesError
		p := NewProblem(http.StatusBadRequest, KindInvalidRequest, "reading the request body: "+err.Error())
		if errors.As(err, &mbe) {
			p = NewProblem(http.StatusRequestEntityTooLarge, KindRequestTooLarge,
				fmt.Sprintf("request body over the limit of %d bytes", m.cfg.MaxRequestBody))
		}
		return nil, &p
	}
	fp, err := Fingerprint(r, body, m.cfg.FingerprintHeaders)
	if err != nil {
		p := ProblemFor(err)
		return nil, &p
	}
	logKey := key.String()
	if !m.cfg.LogKeys {
		sum := sha256.Sum256([]byte(logKey))
		logKey = hex.EncodeToString(sum[:8])
	}
	return &request{r: r, key: key, fp: fp, body: body, logKey: logKey}, nil
}

// run claims the key and serves the request once: it replays a done key,
// or runs next, saves its response and sends it. It returns the outcome, or
// an error from the claim (conflict, mismatch, unavailable...) for the
// caller to answer.
func (m *Middleware) run(w http.ResponseWriter, req *request, next http.Handler, opts []etcdstore.ClaimOption) (string, error) {
	r := req.r
	var rec *recorder
	outcome := OutcomeClaimed
	res, err := m.cfg.Store.Run(r.Context(), req.key, req.fp, func(_ context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		if c.TookOver() {
			outcome = OutcomeTakeover
		}
		// Once forwarded, the request runs to its end even if its client
		// hangs up: its response is saved and the client's retry replays
		// it. Cutting it short would leave an unknown outcome and make the
		// retry run the operation again. Only losing the claim stops it.
		ctx, cancel := c.Context(context.WithoutCancel(r.Context()))
		defer cancel()
		up := r.Clone(ctx)
		up.Body = io.NopCloser(bytes.NewReader(req.body))
		up.ContentLength = int64(len(req.body))
		fencing.SetHeader(up.Header, c.Token())
		rec = newRecorder(w, m.cfg.MaxResponseBody)
		next.ServeHTTP(rec, up)
		lost := c.Err() != nil
		switch {
		case rec.noResp != nil && (lost || m.cfg.KeepOnNoResponse):
			return etcdstore.Outcome{}, etcdstore.EndAbandon
		case rec.noResp != nil:
			return etcdstore.Outcome{}, etcdstore.EndRelease
		case rec.overflow:
			p := NewProblem(http.StatusInternalServerError, KindResponseNotSaved, fmt.Sprintf(
				"the request ran once, but its response was over the %d-byte limit and cannot be replayed; do not retry it with a new key",
				m.cfg.MaxResponseBody))
			return etcdstore.Outcome{Status: p.Status, Header: map[string][]string{"Content-Type": {"application/problem+json"}}, Body: p.Body()}, etcdstore.EndSave
		}
		if rec.status == 0 {
			rec.status = http.StatusOK
		}
		out := etcdstore.Outcome{Status: rec.status, Header: savedHeaders(rec.header), Body: rec.body.Bytes()}
		switch {
		case rec.status >= 500 && lost:
			// Likely caused by losing the claim: not the operation's answer.
			return out, etcdstore.EndAbandon
		case rec.status >= 500 && m.cfg.Save5xx != nil && !m.cfg.Save5xx(r):
			return out, etcdstore.EndRelease
		}
		return out, etcdstore.EndSave
	}, opts...)

	if rec == nil { // the handler did not run: a replay or a refusal
		if err != nil {
			return "", err
		}
		writeOutcome(w, res.Outcome, true)
		m.log(req, OutcomeReplayed, res.Token, res.Status)
		return OutcomeReplayed, nil
	}
	switch {
	case errors.Is(err, etcdstore.ErrFenced) || errors.Is(err, etcdstore.ErrClaimEnded):
		// Another owner took the key over while this one ran: the first
		// saved outcome is theirs, and every client must see that one.
		m.log(req, OutcomeFenced, res.Token, rec.status)
		if rec.overflow {
			return OutcomeFenced, nil
		}
		if cur, gerr := m.cfg.Store.Get(r.Context(), req.key); gerr == nil && cur.State == etcdstore.Done && cur.Fingerprint == req.fp {
			writeOutcome(w, *cur.Outcome, true)
			return OutcomeFenced, nil
		}
		ProblemFor(err).Write(w)
		return OutcomeFenced, nil
	case errors.Is(err, etcdstore.ErrUnavailable) && !rec.overflow:
		// The handler answered, but its answer is not saved yet (the store
		// keeps trying in the background). Acknowledging it now could let a
		// crash replace it with a different answer to a retry: the client
		// retries with the same key and gets the saved one.
		p := NewProblem(http.StatusServiceUnavailable, KindUnavailable,
			"the request ran but its response could not be saved yet; retry with the same key to get it")
		p.RetryAfter = 1
		p.Write(w)
		m.log(req, OutcomeUnavailable, res.Token, p.Status)
		return OutcomeUnavailable, nil
	case err != nil && !errors.Is(err, etcdstore.ErrUnavailable):
		m.cfg.Logger.Error("idem: ending a claim", "key", req.logKey, "err", m.redact(req, err))
	}
	switch {
	case rec.noResp != nil:
		p := NewProblem(http.StatusBadGateway, KindUpstreamUnavailable, "no response: "+rec.noResp.Error()+"; retry with the same key")
		p.Write(w)
		m.log(req, OutcomeUpstream, res.Token, p.Status)
		return OutcomeUpstream, nil
	case !rec.overflow:
		writeOutcome(w, res.Outcome, false)
	}
	m.log(req, outcome, res.Token, rec.status)
	return outcome, nil
}

// fail answers a request whose claim failed.
func (m *Middleware) fail(w http.ResponseWriter, req *request, err error) string {
	if req.r.Context().Err() != nil {
		return OutcomeError // the client is gone; nothing to answer
	}
	p := ProblemFor(err)
	p.Write(w)
	outcome := OutcomeError
	switch p.Type {
	case ProblemTypePrefix + KindConflict:
		outcome = OutcomeConflict
	case ProblemTypePrefix + KindMismatch:
		outcome = OutcomeMismatch
	case ProblemTypePrefix + KindUnavailable:
		outcome = OutcomeUnavailable
	case ProblemTypePrefix + KindInvalidJSON, ProblemTypePrefix + KindInvalidKey, ProblemTypePrefix + KindRequestTooLarge:
		outcome = OutcomeInvalid
	}
	m.cfg.Logger.Info("idem: refused", "key", req.logKey, "outcome", outcome, "status", p.Status, "err", m.redact(req, err))
	return outcome
}

// redact returns err's text with the key replaced by its log form: store
// errors name their key, and keys are logged only as a hash unless LogKeys.
func (m *Middleware) redact(req *request, err error) string {
	if m.cfg.LogKeys {
		return err.Error()
	}
	return strings.ReplaceAll(err.Error(), req.key.String(), "key#"+req.logKey)
}

// refuse answers a request that was refused before any claim.
func (m *Middleware) refuse(w http.ResponseWriter, r *http.Request, p Problem) string {
	p.Write(w)
	m.cfg.Logger.Info("idem: refused", "method", r.Method, "status", p.Status, "type", p.Type, "detail", p.Detail)
	return OutcomeInvalid
}

func (m *Middleware) log(req *request, outcome string, token fencing.Token, status int) {
	m.cfg.Logger.Info("idem: served", "key", req.logKey, "outcome", outcome, "token", int64(token), "status", status)
}

// writeOutcome sends a saved or fresh outcome. An outcome that records a
// failure to save the response is sent as a response-not-saved problem.
func writeOutcome(w http.ResponseWriter, o etcdstore.Outcome, replayed bool) {
	if o.Err != "" && o.Status == 0 {
		if replayed {
			w.Header().Set(HeaderReplayed, "true")
		}
		NewProblem(http.StatusInternalServerError, KindResponseNotSaved,
			"the request ran once, but its response could not be saved: "+o.Err+"; do not retry it with a new key").Write(w)
		return
	}
	h := w.Header()
	for k, vs := range o.Header {
		h[k] = append([]string(nil), vs...)
	}
	if replayed {
		h.Set(HeaderReplayed, "true")
	}
	h.Set("Content-Length", strconv.Itoa(len(o.Body)))
	status := o.Status
	if status == 0 {
		status = http.StatusOK
	}
	w.WriteHeader(status)
	_, _ = w.Write(o.Body)
}
