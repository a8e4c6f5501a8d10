package idemhttp

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/canonjson"
	"github.com/idem-dev/idem/jobs"
)

// Defaults of APIConfig.
const (
	DefaultAPIDeadline    = 30 * time.Second
	DefaultAPIMaxDeadline = time.Hour
)

// Route is one route of the worker API: its method, its path pattern, and
// the operationId that documents it in api/openapi.yaml.
type Route struct{ Method, Pattern, Op string }

// APIRoutes returns the worker API's routes, as NewAPI serves them and
// api/openapi.yaml documents them (a test checks that the two agree).
func APIRoutes() []Route { return slices.Clone(apiRoutes) }

var apiRoutes = []Route{
	{"POST", "/v1/claim", "claim"},
	{"POST", "/v1/complete", "complete"},
	{"POST", "/v1/checkpoint", "checkpoint"},
	{"POST", "/v1/renew", "renew"},
	{"POST", "/v1/release", "release"},
	{"POST", "/v1/abandon", "abandon"},
	{"GET", "/v1/keys/{key}", "get"},
	{"POST", "/v1/jobs", "submitJob"},
	{"GET", "/v1/jobs/{id}", "getJob"},
	{"POST", "/v1/jobs/{id}/signals/{event}", "signalJob"},
	{"GET", "/v1/limits", "listSlots"},
	{"GET", "/v1/kinds", "listKinds"},
	{"GET", "/v1/kinds/{kind}", "getKind"},
	{"PUT", "/v1/kinds/{kind}", "putKind"},
	{"DELETE", "/v1/kinds/{kind}", "deleteKind"},
	{"POST", "/v1/work/next", "nextTask"},
	{"POST", "/v1/work/tasks/{task}/{op}", "reportTask"},
}

// APIConfig configures the worker API.
type APIConfig struct {
	Store Store
	// Tenant scopes keys (default FixedTenant(etcdstore.DefaultTenant)).
	Tenant TenantFunc
	// MaxBody is the largest request body (default 2 MiB, room for a 1 MiB
	// outcome in base64).
	MaxBody int64
	// Deadline is the claim deadline when a claim asks for none (default
	// 30 s): a worker that dies without ending its claim holds the key no
	// longer than this. MaxDeadline caps what a claim may ask (default 1 h).
	Deadline, MaxDeadline time.Duration
	// MaxWait caps waiting (default 60 s).
	MaxWait time.Duration
	// ProblemDocs is the URL problem answers link to (default
	// DefaultProblemDocs; "none": no Link).
	ProblemDocs string
	// MaxCheckpoint is the largest checkpoint a worker may save (default
	// DefaultMaxCheckpoint; 413 past it).
	MaxCheckpoint int
	// Limiter bounds what each tenant may make idem write (default: no
	// limits).
	Limiter *Limiter
	Metrics *Metrics
	// Jobs serves the jobs routes (/v1/jobs...); nil answers them 404
	// no-such-route (a shard set has no jobs).
	Jobs *JobsConfig
}

// DefaultMaxCheckpoint is the default of APIConfig.MaxCheckpoint: a
// recovery point names where to resume (a step, an id), not the work's
// data, and every checkpoint rewrites the whole record, which etcd keeps
// in its history until compaction.
const DefaultMaxCheckpoint = 64 << 10

// API is idem's JSON API for workers in any language: claim, checkpoint,
// renew, complete, release, abandon, get and wait, under /v1/. It is
// documented in api/openapi.yaml.
//
// A claim made through the API is not tied to any idem process's session:
// only its deadline, renewed by the worker (renew, or checkpoint with
// extend_ms), keeps it. A worker that dies stops renewing and the key is
// taken over after the deadline; the idem process that made the claim may
// restart meanwhile. Every call after claim carries the claim's handle,
// so it may reach any idem process of the deployment.
type API struct {
	cfg APIConfig
	mux *http.ServeMux

	mu     sync.Mutex
	claims map[heldKey]*etcdstore.Claim // claims made here
}

// heldKey names a claim made here: attempt ids are the client's, unique
// only per key (and a key's tenant comes from authentication).
type heldKey struct {
	key     etcdstore.Key
	attempt string
}

// NewAPI returns the worker API handler.
func NewAPI(cfg APIConfig) (*API, error) {
	if cfg.Store == nil {
		return nil, errors.New("idemhttp: nil store")
	}
	if cfg.Tenant == nil {
		cfg.Tenant = FixedTenant(etcdstore.DefaultTenant)
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = 2 << 20
	}
	if cfg.Deadline <= 0 {
		cfg.Deadline = DefaultAPIDeadline
	}
	if cfg.MaxDeadline <= 0 {
		cfg.MaxDeadline = DefaultAPIMaxDeadline
	}
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.MaxCheckpoint <= 0 {
		cfg.MaxCheckpoint = DefaultMaxCheckpoint
	}
	cfg.ProblemDocs = problemDocs(cfg.ProblemDocs)
	a := &API{cfg: cfg, mux: http.NewServeMux(), claims: make(map[heldKey]*etcdstore.Claim)}
	handlers := map[string]http.HandlerFunc{
		"claim": a.claim, "complete": a.complete, "checkpoint": a.checkpoint,
		"renew": a.renew, "release": a.release, "abandon": a.abandon, "get": a.get,
		"submitJob": a.submitJob, "getJob": a.getJob, "signalJob": a.signalJob, "listSlots": a.listSlots,
		"listKinds": a.listKinds, "getKind": a.getKind, "putKind": a.putKind, "deleteKind": a.deleteKind,
		"nextTask": a.nextTask, "reportTask": a.reportTask,
	}
	if cfg.Jobs == nil {
		for _, op := range []string{"submitJob", "getJob", "signalJob", "listSlots", "listKinds", "getKind", "putKind", "deleteKind", "nextTask", "reportTask"} {
			handlers[op] = func(w http.ResponseWriter, r *http.Request) {
				a.problem(w, NewProblem(http.StatusNotFound, KindNoSuchRoute, "this idem serves no jobs (they run on one etcd cluster, not a shard set)"))
			}
		}
	} else if cfg.Jobs.Tenant == nil {
		cfg.Jobs.Tenant = FixedTenant(jobs.DefaultTenant)
	}
	for _, rt := range apiRoutes {
		a.mux.HandleFunc(rt.Method+" "+rt.Pattern, handlers[rt.Op])
	}
	a.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		// A route that exists with other methods is a 405 naming them.
		var allow []string
		for _, rt := range apiRoutes {
			probe := r.Clone(r.Context())
			probe.Method = rt.Method
			if _, pattern := a.mux.Handler(probe); pattern != "/" && !slices.Contains(allow, rt.Method) {
				allow = append(allow, rt.Method)
			}
		}
		if len(allow) > 0 {
			w.Header().Set("Allow", strings.Join(allow, ", "))
			a.problem(w, NewProblem(http.StatusMethodNotAllowed, KindMethodNotAllowed,
				fmt.Sprintf("%s %s: this route takes %s", r.Method, r.URL.Path, strings.Join(allow, " or "))))
			return
		}
		a.problem(w, NewProblem(http.StatusNotFound, KindNoSuchRoute, "no such API route: "+r.Method+" "+r.URL.Path))
	})
	return a, nil
}

func (a *API) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rw := &statusWriter{ResponseWriter: w}
	if why := crossSite(r); why != "" {
		a.problem(rw, NewProblem(http.StatusForbidden, KindCrossSite, why))
		rw.outcome = labelError
	} else {
		a.mux.ServeHTTP(rw, r)
	}
	if m := a.cfg.Metrics; m != nil {
		outcome := rw.outcome
		if outcome == "" {
			outcome = labelError
		}
		m.Requests.WithLabelValues(outcome).Inc()
		m.Duration.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	}
}

// statusWriter remembers the outcome a handler set.
type statusWriter struct {
	http.ResponseWriter
	outcome string
}

// MinAttemptLen is the shortest attempt id a worker of the API may choose:
// 22 characters hold 128 random bits in base64url (a UUIDv4, 36, holds 122).
const MinAttemptLen = 22

// HandleJSON is a claim handle on the wire. It is a capability over the
// claim (its attempt id is a secret): give it only to the claim's worker.
type HandleJSON struct {
	Key      string `json:"key"`
	Attempt  string `json:"attempt"`
	Token    int64  `json:"token"`
	Revision int64  `json:"revision"`
}

// OutcomeJSON is an outcome on the wire. Body is base64 in JSON.
type OutcomeJSON struct {
	Status  int                 `json:"status,omitempty"`
	Headers map[string][]string `json:"headers,omitempty"`
	Body    []byte              `json:"body,omitempty"`
	Error   string              `json:"error,omitempty"`
}

// ClaimRequest is the body of POST /v1/claim.
type ClaimRequest struct {
	Key string `json:"key"`
	// Params are the operation's parameters, fingerprinted in canonical
	// JSON form. Or send Fingerprint, a hex SHA-256 computed by the worker.
	Params      json.RawMessage `json:"params,omitempty"`
	Fingerprint string          `json:"fingerprint,omitempty"`
	// Attempt lets a worker that lost the reply of a claim retry it and be
	// recognised as the owner. Default: a new random id, returned in the
	// handle. A worker's own must be random, MinAttemptLen to 64
	// characters: it is the claim's capability.
	Attempt    string `json:"attempt,omitempty"`
	DeadlineMS int64  `json:"deadline_ms,omitempty"`
	WaitMS     int64  `json:"wait_ms,omitempty"`
}

// ClaimResponse is the answer to POST /v1/claim.
type ClaimResponse struct {
	State      string       `json:"state"` // "claimed" or "done"
	Token      int64        `json:"token"`
	Handle     *HandleJSON  `json:"handle,omitempty"`
	TookOver   bool         `json:"took_over,omitempty"`
	Checkpoint []byte       `json:"checkpoint,omitempty"`
	Deadline   *time.Time   `json:"deadline,omitempty"`
	Outcome    *OutcomeJSON `json:"outcome,omitempty"`
}

// CompleteRequest is the body of POST /v1/complete.
type CompleteRequest struct {
	Handle  HandleJSON   `json:"handle"`
	Outcome *OutcomeJSON `json:"outcome"`
}

// CheckpointRequest is the body of POST /v1/checkpoint. ExtendMS, when
// set, also moves the deadline to that far from now.
type CheckpointRequest struct {
	Handle     HandleJSON `json:"handle"`
	Checkpoint []byte     `json:"checkpoint,omitempty"`
	ExtendMS   int64      `json:"extend_ms,omitempty"`
}

// RenewRequest is the body of POST /v1/renew: the deadline moves to
// ExtendMS from now.
type RenewRequest struct {
	Handle   HandleJSON `json:"handle"`
	ExtendMS int64      `json:"extend_ms"`
}

// HandleRequest is the body of POST /v1/release and /v1/abandon.
type HandleRequest struct {
	Handle HandleJSON `json:"handle"`
}

// HandleResponse is the answer to complete, checkpoint, renew, release and
// abandon: the key's state after the call, and the new handle while the
// claim is held.
type HandleResponse struct {
	State  string      `json:"state"` // "done", "claimed", "released" or "abandoned"
	Handle *HandleJSON `json:"handle,omitempty"`
}

// RecordView is how the API (and idem's admin commands) show a record.
func RecordView(rec *etcdstore.Record) RecordJSON {
	out := RecordJSON{
		Key: rec.Key.ID, State: string(rec.State), Kind: string(rec.Kind), Token: int64(rec.Token), Fingerprint: rec.Fingerprint.String(),
		Created: rec.Created.UTC(), Expires: rec.Expires.UTC(), Takeovers: rec.Takeovers,
		Abandoned: rec.State == etcdstore.InFlight && rec.Owner == "", Checkpoint: rec.Checkpoint,
	}
	if !rec.Deadline.IsZero() {
		d := rec.Deadline.UTC()
		out.Deadline = &d
	}
	if rec.Outcome != nil {
		out.Outcome = outcomeJSON(rec.Outcome)
	}
	return out
}

// RecordJSON is the answer to GET /v1/keys/{key}.
type RecordJSON struct {
	Key         string       `json:"key"`
	State       string       `json:"state"`
	Kind        string       `json:"kind,omitempty"` // etcdstore.KindKey or KindJob
	Token       int64        `json:"token"`
	Fingerprint string       `json:"fingerprint"`
	Created     time.Time    `json:"created"`
	Expires     time.Time    `json:"expires"`
	Deadline    *time.Time   `json:"deadline,omitempty"`
	Takeovers   int          `json:"takeovers,omitempty"`
	Abandoned   bool         `json:"abandoned,omitempty"`
	Checkpoint  []byte       `json:"checkpoint,omitempty"`
	Outcome     *OutcomeJSON `json:"outcome,omitempty"`
}

// decode reads a strict JSON body (unknown fields and trailing data are
// errors) and the request's tenant. It answers the request itself on error.
func (a *API) decode(w http.ResponseWriter, r *http.Request, v any) (string, bool) {
	tenant, err := a.cfg.Tenant(r)
	if err != nil {
		a.problem(w, tenantProblem(err))
		return "", false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, a.cfg.MaxBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			a.problem(w, NewProblem(http.StatusRequestEntityTooLarge, KindRequestTooLarge, fmt.Sprintf("body over the limit of %d bytes", a.cfg.MaxBody)))
		} else {
			a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, err.Error()))
		}
		return "", false
	}
	if _, err := canonjson.Canonical(body); err != nil && json.Valid(body) {
		// Valid JSON with no single meaning: a member named twice (one
		// parser takes the first, another the last: {"key":"a","key":"b"}
		// claimed b), a number that does not survive a round trip.
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidJSON, "request body: "+err.Error()))
		return "", false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, "request body: "+err.Error()))
		return "", false
	}
	if dec.More() {
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, "request body: data after the JSON object"))
		return "", false
	}
	return tenant, true
}

// problem answers a refusal made before any store call.
func (a *API) problem(w http.ResponseWriter, p Problem) {
	if sw, ok := w.(*statusWriter); ok && sw.outcome == "" {
		sw.outcome = labelInvalid
	}
	p.Docs = a.cfg.ProblemDocs
	p.Write(w)
}

// fail answers a call the store refused, or could not serve.
func (a *API) fail(w http.ResponseWriter, err error) {
	p := ProblemFor(err)
	a.labelIs(w, labelOf(p))
	p.Docs = a.cfg.ProblemDocs
	p.Write(w)
}

func (a *API) labelIs(w http.ResponseWriter, label string) {
	if sw, ok := w.(*statusWriter); ok {
		sw.outcome = label
	}
}

func tenantProblem(err error) Problem {
	if errors.Is(err, ErrUntrustedTenant) {
		return NewProblem(http.StatusForbidden, KindUntrustedTenant, err.Error())
	}
	if errors.Is(err, ErrUnauthenticated) {
		p := NewProblem(http.StatusUnauthorized, KindUnauthorized, err.Error())
		p.Challenge = `Bearer realm="idem"`
		return p
	}
	return ProblemFor(err)
}

// requestFingerprint is the fingerprint a claim request names or implies.
func requestFingerprint(req ClaimRequest) (etcdstore.Fingerprint, error) {
	var fp etcdstore.Fingerprint
	switch {
	case req.Fingerprint != "" && len(req.Params) > 0:
		return fp, fmt.Errorf("%w: send params or fingerprint, not both", etcdstore.ErrInvalidArgument)
	case req.Fingerprint != "":
		b, err := hex.DecodeString(req.Fingerprint)
		if err != nil || len(b) != len(fp) {
			return fp, fmt.Errorf("%w: fingerprint must be 64 hex digits (a SHA-256)", etcdstore.ErrInvalidArgument)
		}
		copy(fp[:], b)
		return fp, nil
	}
	if len(req.Params) == 0 {
		return etcdstore.FingerprintOf([]byte("null")) // no params: all such claims agree
	}
	return etcdstore.FingerprintOf(req.Params)
}

func handleJSON(h etcdstore.Handle) *HandleJSON {
	return &HandleJSON{Key: h.Key.ID, Attempt: h.Attempt, Token: int64(h.Token), Revision: h.Revision}
}

func outcomeJSON(o *etcdstore.Outcome) *OutcomeJSON {
	return &OutcomeJSON{Status: o.Status, Headers: o.Header, Body: o.Body, Error: o.Err}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// crossSite says why a request that changes something must be refused as
// one a browser could send from another site's page ("" when it need not
// be): the worker API takes no cookies, but it is often reached on
// loopback or a private network that a page can reach too (issue 38: a
// page on another loopback port approved a refund through it). A browser
// says where a request comes from (Sec-Fetch-Site, Origin), and sends a
// body cross-site without asking first only as text/plain or a form:
// every body the API takes is JSON. Programs (curl, SDKs) send neither
// header, and any JSON content type, or none.
func crossSite(r *http.Request) string {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return ""
	}
	if s := r.Header.Get("Sec-Fetch-Site"); s != "" && s != "same-origin" && s != "none" {
		return "a browser sent this request from another site (Sec-Fetch-Site: " + s + "); the worker API takes requests from programs, and from pages it serves itself"
	}
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		if err != nil || u.Host != r.Host {
			return "a browser sent this request from another origin (Origin: " + o + ")"
		}
	}
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || mt != "application/json" && !strings.HasSuffix(mt, "+json") {
			return "the body must be JSON (Content-Type: application/json), not " + ct + ": a browser sends other types from any site's page without asking"
		}
	}
	return ""
}
