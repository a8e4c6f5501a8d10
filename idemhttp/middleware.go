package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
)

// Defaults of Config.
const (
	DefaultMaxRequestBody  = 1 << 20
	DefaultMaxResponseBody = 1<<20 - 64<<10 // leaves room for headers in a 1 MiB record
	DefaultMaxWait         = 60 * time.Second
)

// headerRoom is the part of a record of size max kept for a response's
// headers: 64 KiB, or a quarter of a smaller record.
func headerRoom(max int) int { return min(64<<10, max/4) }

// MaxResponseBodyFor is the largest MaxResponseBody a store whose records
// hold maxRecordSize bytes takes (the rest is the headers' room).
func MaxResponseBodyFor(maxRecordSize int) int { return maxRecordSize - headerRoom(maxRecordSize) }

// Config configures a Middleware. Store is required; every other field has a
// default.
type Config struct {
	Store Store

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
	// OnStatus decides, from the handler's status, whether its answer is
	// saved and replayed, released or abandoned (default
	// DefaultStatusPolicy: 429, and 503 with Retry-After, are released;
	// everything else is saved). Rules builds one from rules.
	OnStatus StatusPolicy
	// DenyHeaders are response headers never saved nor replayed (default
	// DefaultDenyHeaders: Set-Cookie: a replay must not hand the first
	// caller's session to whoever knows the key). An empty, non-nil list
	// denies none. AllowHeaders, when set, are the only ones saved. Either
	// way, hop-by-hop headers, those the response's Connection header
	// names, trailers, Content-Length and Date are never saved.
	DenyHeaders, AllowHeaders []string
	// ProblemDocs is the URL idem's own problem answers point to, in
	// Link: <URL>; rel="describedby" (default DefaultProblemDocs; "none":
	// no Link).
	ProblemDocs string
	// Limiter bounds what each tenant may make idem write (default: no
	// limits): past it, a keyed request gets 429 rate-limited before any
	// claim.
	Limiter *Limiter
	// OnUnknownOutcome says how a claim ends when the request may have
	// reached the handler's upstream but no whole answer came back: a
	// timeout, a connection that broke after the request was sent, a
	// response cut off after its status. The upstream may have acted.
	// etcdstore.EndSave (the default) saves a 502 or 504 problem saying
	// so, replayed to every retry: the client must reconcile before it
	// uses a new key (Stripe's advice for unknown outcomes).
	// etcdstore.EndRelease releases the key and etcdstore.EndAbandon
	// abandons it for the next request to take over: either way the retry
	// reaches the upstream again, which is safe only for an upstream that
	// deduplicates by the forwarded key or refuses stale fencing tokens.
	// A request that provably never reached the upstream (connection
	// refused, a DNS failure) is always released.
	OnUnknownOutcome etcdstore.End
	// MaxWait caps "Prefer: wait=N" (default 60 s).
	MaxWait time.Duration
	// ClaimDeadline, when set, gives every claim a deadline (see
	// etcdstore.WithDeadline): past it, another request may take the key
	// over and reach the upstream again. It must outlast the slowest honest
	// request: a forwarded request is cancelled a fifth of the time left
	// before its claim stops being held (the deadline, or the in-flight
	// record's expiry: etcdstore.Claim.BeforeEnd); its outcome is then
	// unknown, and saved as such by default (OnUnknownOutcome), so that it
	// never runs while another owner's does.
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
	cfg         Config
	deny, allow map[string]bool // canonical header names; allow nil: all
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
	room := cfg.Store.MaxRecordSize() - headerRoom(cfg.Store.MaxRecordSize())
	if cfg.MaxResponseBody <= 0 {
		cfg.MaxResponseBody = min(DefaultMaxResponseBody, room)
	}
	if cfg.MaxResponseBody > room {
		return nil, fmt.Errorf("idemhttp: %w: MaxResponseBody %d leaves no room for headers in the store's %d-byte records (at most %d)",
			etcdstore.ErrInvalidArgument, cfg.MaxResponseBody, cfg.Store.MaxRecordSize(), room)
	}
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.OnStatus == nil {
		cfg.OnStatus = DefaultStatusPolicy
	}
	if cfg.DenyHeaders == nil {
		cfg.DenyHeaders = DefaultDenyHeaders
	}
	m := &Middleware{cfg: cfg, deny: map[string]bool{}}
	for _, k := range cfg.DenyHeaders {
		if !httpguts.ValidHeaderFieldName(k) {
			return nil, fmt.Errorf("idemhttp: DenyHeaders: %q is not a header name", k)
		}
		m.deny[http.CanonicalHeaderKey(k)] = true
	}
	if len(cfg.AllowHeaders) > 0 {
		m.allow = map[string]bool{}
		for _, k := range cfg.AllowHeaders {
			if !httpguts.ValidHeaderFieldName(k) {
				return nil, fmt.Errorf("idemhttp: AllowHeaders: %q is not a header name", k)
			}
			m.allow[http.CanonicalHeaderKey(k)] = true
		}
	}
	m.cfg.ProblemDocs = problemDocs(cfg.ProblemDocs)
	if m.cfg.Logger == nil {
		m.cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return m, nil
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
	logKey keyLog
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) string {
	// The fence header is idem's to set: a client must never forge one. It
	// is dropped from requests idem passes through, and refuses a keyed
	// request that carries one.
	forged := len(r.Header.Values(fencing.Header)) > 0
	r.Header.Del(fencing.Header)
	if !slices.Contains(m.cfg.Methods, r.Method) {
		next.ServeHTTP(w, r)
		return labelPassthrough
	}
	id, present, err := keyFromHeader(r.Header)
	if err != nil {
		return m.refuse(w, r, NewProblem(http.StatusBadRequest, KindInvalidKey, err.Error()))
	}
	if !present {
		if m.cfg.RequireKey != nil && m.cfg.RequireKey(r) {
			return m.refuse(w, r, NewProblem(http.StatusBadRequest, KindMissingKey,
				"this route requires an Idempotency-Key header: generate one per operation and send it on every retry"))
		}
		next.ServeHTTP(w, r)
		return labelPassthrough
	}
	if forged {
		return m.refuse(w, r, NewProblem(http.StatusBadRequest, KindInvalidRequest,
			fencing.Header+" is set by idem for the upstream; a client must not send it"))
	}
	req, p := m.parse(w, r, id)
	if p != nil {
		return m.refuse(w, r, *p)
	}
	if p := m.cfg.Limiter.admitClaim(req.key.Tenant); p != nil {
		m.refuse(w, r, *p)
		return labelRateLimited
	}
	w.Header().Set(HeaderRetention, strconv.Itoa(int(m.cfg.Store.Retention().Seconds())))

	var opts []etcdstore.RunOption
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
			return labelError
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
	body, err := readBody(http.MaxBytesReader(w, r.Body, m.cfg.MaxRequestBody), r.ContentLength)
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
	return &request{r: r, key: key, fp: fp, body: body, logKey: keyLog{key, m.cfg.LogKeys}}, nil
}

// run claims the key and serves the request once: it replays a done key,
// or runs next, saves its response and sends it. It returns the outcome, or
// an error from the claim (conflict, mismatch, unavailable...) for the
// caller to answer.
func (m *Middleware) run(w http.ResponseWriter, req *request, next http.Handler, opts []etcdstore.RunOption) (string, error) {
	r := req.r
	var rec *recorder
	var ans answer
	outcome := labelClaimed
	res, err := m.cfg.Store.Run(r.Context(), req.key, req.fp, func(_ context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		if c.TookOver() {
			outcome = labelTakeover
		}
		if why := mayHaveRun(c); why != "" && m.cfg.OnUnknownOutcome == etcdstore.EndSave {
			// The earlier attempt was cut short after it may have
			// reached the handler (its process was killed, or lost its
			// session or its deadline): its outcome is unknown, and under
			// the default policy an outcome that may have happened is
			// never run again. Its answer is saved, as the earlier
			// attempt's own unknown outcome would have been.
			rec = newRecorder(w, m.cfg.MaxResponseBody)
			rec.req = r
			ans = m.unknownOutcome(http.StatusBadGateway, why)
			return ans.out, ans.end
		}
		// Once forwarded, the request runs to its end, even if its client
		// hangs up or the claim is lost meanwhile: cutting it short would
		// turn a definite answer into an unknown outcome. Its answer is
		// saved if the claim still holds (the write is fenced); the
		// client's retry replays it.
		ctx := fencing.NewContext(context.WithoutCancel(r.Context()), c.Token())
		// Once the claim is no longer held (past its deadline, or its
		// record's expiry) another request may take the key over and reach
		// the upstream again: this one is cancelled a fifth of the time
		// left before that, leaving time to save what came of it (an
		// unknown outcome, if the upstream had not answered: saved, and
		// replayed to the retry).
		ctx, cancel := c.BeforeEnd(ctx)
		defer cancel()
		up := r.Clone(ctx)
		up.Body = newBody(req.body)
		up.ContentLength = int64(len(req.body))
		fencing.SetHeader(up.Header, c.Token())
		up.Header[HeaderKey] = []string{FormatKey(req.key.ID)} // one form per key, whatever the client sent
		rec = newRecorder(w, m.cfg.MaxResponseBody)
		rec.req = r
		aborted := serveCatchingAbort(next, rec, up)
		ans = m.decide(rec, aborted)
		return ans.out, ans.end
	}, opts...)
	if rec != nil && ans.end == etcdstore.EndSave {
		// The outcome is saved (or will be): the work ran, so it is never
		// refused after the fact; the tenant's next claims pay for it.
		m.cfg.Limiter.charge(req.key.Tenant, outcomeSize(ans.out.Status, ans.out.Header, ans.out.Body, ans.out.Err))
	}

	if rec == nil { // the handler did not run: a replay or a refusal
		if err != nil {
			return "", err
		}
		writeOutcome(w, m.replayed(res.Outcome), true, m.cfg.ProblemDocs)
		m.log(req, labelReplayed, res.Token, res.Status)
		return labelReplayed, nil
	}
	if ans.abort {
		// Part of the response is already with the client and the rest is
		// lost: only a broken connection tells the client so. The claim
		// ended first (what was saved says the response was cut off).
		m.cfg.Logger.Warn("idem: response cut off while streaming; what was saved says so",
			"key", req.logKey, "token", int64(res.Token), "status", rec.status)
		panic(http.ErrAbortHandler)
	}
	switch {
	case errors.Is(err, etcdstore.ErrFenced) || errors.Is(err, etcdstore.ErrClaimEnded):
		// Another owner took the key over while this one ran: the first
		// saved outcome is theirs, and every client must see that one.
		m.log(req, labelFenced, res.Token, rec.status)
		if rec.overflow {
			return labelFenced, nil
		}
		if cur, gerr := m.cfg.Store.Get(r.Context(), req.key); gerr == nil && cur.State == etcdstore.Done && cur.Fingerprint == req.fp {
			writeOutcome(w, m.replayed(*cur.Outcome), true, m.cfg.ProblemDocs)
			return labelFenced, nil
		}
		m.writeProblem(w, ProblemFor(err))
		return labelFenced, nil
	case errors.Is(err, etcdstore.ErrUnavailable) && !rec.overflow:
		// The handler answered, but its answer is not saved yet (the store
		// keeps trying in the background). Acknowledging it now could let a
		// crash replace it with a different answer to a retry: the client
		// retries with the same key and gets the saved one.
		p := NewProblem(http.StatusServiceUnavailable, KindUnavailable,
			"the request ran but its response could not be saved yet; retry with the same key to get it")
		p.RetryAfter = 1
		if errors.Is(err, etcdstore.ErrStoreFull) {
			p = NewProblem(http.StatusServiceUnavailable, KindStoreFull,
				"the request ran but its response could not be saved yet: the idempotency store is out of space (NOSPACE); retry with the same key to get it once an operator frees space")
			p.RetryAfter = 30
		}
		m.writeProblem(w, p)
		m.log(req, labelUnavailable, res.Token, p.Status)
		return labelUnavailable, nil
	case err != nil && !errors.Is(err, etcdstore.ErrUnavailable):
		m.cfg.Logger.Error("idem: ending a claim", "key", req.logKey, "err", m.redact(req, err))
	}
	if ans.unknown != "" {
		m.cfg.Logger.Warn("idem: the upstream's outcome is unknown", "key", req.logKey, "token", int64(res.Token), "why", ans.unknown)
	}
	switch {
	case ans.problem != nil:
		m.writeProblem(w, *ans.problem)
		m.log(req, ans.label, res.Token, ans.problem.Status)
		return ans.label, nil
	case !rec.overflow:
		o := res.Outcome
		if ans.live != nil {
			o.Header = ans.live // the first caller gets what was not saved, too
		}
		writeOutcome(w, o, false, m.cfg.ProblemDocs)
	}
	if ans.label != "" {
		outcome = ans.label
	}
	m.log(req, outcome, res.Token, res.Status)
	return outcome, nil
}

// body is a request body read into memory: the proxy can rewind it for the
// re-sends net/http makes when nothing was written.
type body struct {
	*bytes.Reader
	b []byte
}

type rewindable interface{ rewind() (io.ReadCloser, error) }

func newBody(b []byte) *body                   { return &body{bytes.NewReader(b), b} }
func (*body) Close() error                     { return nil }
func (b *body) rewind() (io.ReadCloser, error) { return newBody(b.b), nil }

// fail answers a request whose claim failed.
func (m *Middleware) fail(w http.ResponseWriter, req *request, err error) string {
	if req.r.Context().Err() != nil {
		return labelError // the client is gone; nothing to answer
	}
	p := ProblemFor(err)
	m.writeProblem(w, p)
	outcome := labelOf(p)
	m.cfg.Logger.Info("idem: refused", "key", req.logKey, "outcome", outcome, "status", p.Status, "err", m.redact(req, err))
	return outcome
}

// redact returns err's text with the key replaced by its log form: store
// errors name their key, and keys are logged only as a hash unless LogKeys.
func (m *Middleware) redact(req *request, err error) string {
	if m.cfg.LogKeys {
		return err.Error()
	}
	return strings.ReplaceAll(err.Error(), req.key.String(), "key#"+req.logKey.String())
}

// refuse answers a request that was refused before any claim.
func (m *Middleware) refuse(w http.ResponseWriter, r *http.Request, p Problem) string {
	m.writeProblem(w, p)
	m.cfg.Logger.Info("idem: refused", "method", r.Method, "status", p.Status, "type", p.Type, "detail", p.Detail)
	return labelInvalid
}

// keyLog is a key as the logs show it: its digest, or itself with
// Config.LogKeys; computed only for a record a handler takes.
type keyLog struct {
	key  etcdstore.Key
	full bool
}

func (k keyLog) String() string {
	if k.full {
		return k.key.String()
	}
	return k.key.Digest()
}

func (k keyLog) LogValue() slog.Value { return slog.StringValue(k.String()) }

func (m *Middleware) log(req *request, outcome string, token fencing.Token, status int) {
	m.cfg.Logger.Info("idem: served", "key", req.logKey, "outcome", outcome, "token", int64(token), "status", status)
}

// writeProblem answers with p, linking to the problem types' docs.
func (m *Middleware) writeProblem(w http.ResponseWriter, p Problem) {
	p.Docs = m.cfg.ProblemDocs
	p.Write(w)
}

// writeOutcome sends a saved or fresh outcome. An outcome that records a
// failure to save the response is sent as a response-not-saved problem.
func writeOutcome(w http.ResponseWriter, o etcdstore.Outcome, replayed bool, docs string) {
	if o.Err != "" && o.Status == 0 {
		if replayed {
			w.Header().Set(HeaderReplayed, "true")
		}
		p := NewProblem(http.StatusInternalServerError, KindResponseNotSaved,
			"the request ran once, but its response could not be saved: "+o.Err+"; do not retry it with a new key")
		p.Docs = docs
		p.Write(w)
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

// replayed is o as a replay sends it: without the headers DenyHeaders and
// AllowHeaders keep from a replay now, though a record saved under an
// earlier policy holds them (a Set-Cookie denied after an incident is not
// replayed from the records saved before).
func (m *Middleware) replayed(o etcdstore.Outcome) etcdstore.Outcome {
	o.Header = m.savedHeaders(o.Header)
	return o
}

// preallocBody is the largest declared body length read into a buffer
// allocated before the body arrives.
const preallocBody = 64 << 10

// readBody reads a request body whole: into one buffer of the declared
// length when there is one and it is small (no growing and copying; a
// larger one grows with what arrives, so that a client that declares much
// and sends little does not pin the whole of it), checking that no more
// follows.
func readBody(r io.Reader, declared int64) ([]byte, error) {
	if declared <= 0 || declared > preallocBody {
		return io.ReadAll(r)
	}
	b := make([]byte, declared, declared+1)
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			err = fmt.Errorf("the body ended before its Content-Length of %d bytes: %w", declared, err)
		}
		return nil, err
	}
	var one [1]byte
	switch n, err := io.ReadFull(r, one[:]); {
	case n == 0 && errors.Is(err, io.EOF):
		return b, nil
	case n == 0:
		return nil, err
	}
	rest, err := io.ReadAll(r) // more than declared: a reader that does not enforce it
	if err != nil {
		return nil, err
	}
	return append(append(b, one[0]), rest...), nil
}

// mayHaveRun says why claim c, a takeover, follows an attempt that may have
// reached the handler ("" when it does not): an earlier claim held the key
// and was cut short, its owner gone or past its deadline (Claim.CutShort:
// kept through a reaper's fence, the abandon of a takeover whose reply was
// lost, and a claim that recognises its own landed takeover, with no
// Previous record). An attempt abandoned on purpose, to run again, with
// none cut short before it, did not.
func mayHaveRun(c *etcdstore.Claim) string {
	if !c.TookOver() || !c.CutShort() {
		return ""
	}
	return "an earlier attempt at this key was cut short, its idem process gone or its claim past its deadline, after it may have reached the upstream"
}
