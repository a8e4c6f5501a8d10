package idemhttp

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

// Problem is an RFC 9457 problem detail, the body of every error idem
// answers itself.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// RetryAfter is the Retry-After hint in seconds, when there is one.
	RetryAfter int `json:"retry_after,omitempty"`
	// Challenge is the WWW-Authenticate challenge of a 401.
	Challenge string `json:"-"`
	// Docs, when set, is sent as Link: <Docs>; rel="describedby", where a
	// client finds what the problem types mean (as the IETF
	// Idempotency-Key draft suggests).
	Docs string `json:"-"`
}

// DefaultProblemDocs is where idem's problem types are documented.
const DefaultProblemDocs = "https://github.com/idem-dev/idem/blob/main/docs/HTTP.md#statuses-idem-answers-itself"

// problemDocs returns the docs URL a configuration names: the default for
// "", none for "none".
func problemDocs(url string) string {
	switch url {
	case "":
		return DefaultProblemDocs
	case "none":
		return ""
	}
	return url
}

// link is p's Link header value, or "".
func (p Problem) link() string {
	if p.Docs == "" {
		return ""
	}
	return "<" + p.Docs + `>; rel="describedby"`
}

// ProblemTypePrefix starts every problem type URI; the rest is the kind,
// documented in docs/HTTP.md.
const ProblemTypePrefix = "urn:idem:problem:"

// The kinds of problem, one per error kind.
const (
	KindMissingKey          = "missing-key"
	KindInvalidKey          = "invalid-key"
	KindInvalidTenant       = "invalid-tenant"
	KindUntrustedTenant     = "untrusted-tenant"
	KindInvalidRequest      = "invalid-request"
	KindInvalidJSON         = "invalid-json"
	KindRequestTooLarge     = "request-too-large"
	KindConflict            = "conflict"
	KindMismatch            = "mismatch"
	KindFenced              = "fenced"
	KindNotFound            = "not-found"
	KindNoSuchRoute         = "no-such-route"
	KindUnavailable         = "unavailable"
	KindUpstreamUnavailable = "upstream-unavailable"
	KindUpstreamUnknown     = "upstream-outcome-unknown"
	KindResponseNotSaved    = "response-not-saved"
	KindInternal            = "internal"
	KindMethodNotAllowed    = "method-not-allowed"
	KindUnauthorized        = "unauthorized"
	KindStoreFull           = "store-full"
	KindRateLimited         = "rate-limited"
	KindDuplicateJob        = "duplicate-job"
	KindSignalMismatch      = "signal-mismatch"
	KindJobEnded            = "job-ended"
	KindCrossSite           = "cross-site"
	KindTaskGone            = "task-gone"
	KindUnknownKind         = "unknown-kind"
)

var titles = map[string]string{
	KindMissingKey:          "Idempotency-Key header required",
	KindInvalidKey:          "Invalid Idempotency-Key",
	KindInvalidTenant:       "Invalid tenant",
	KindUntrustedTenant:     "Tenant header from an untrusted source",
	KindInvalidRequest:      "Invalid request",
	KindInvalidJSON:         "Request body is not canonicalisable JSON",
	KindRequestTooLarge:     "Request too large",
	KindConflict:            "Request with this Idempotency-Key is still in flight",
	KindMismatch:            "Idempotency-Key reused with different parameters",
	KindDuplicateJob:        "A job of this id was submitted before",
	KindSignalMismatch:      "Event signalled before with another payload",
	KindJobEnded:            "The job has ended",
	KindFenced:              "Claim lost to a newer owner",
	KindNotFound:            "No such idempotency key",
	KindNoSuchRoute:         "No such API route",
	KindUnavailable:         "Idempotency store unavailable",
	KindUpstreamUnavailable: "Upstream could not be reached",
	KindUpstreamUnknown:     "Upstream may have acted; its answer was lost",
	KindResponseNotSaved:    "First response too large to replay",
	KindInternal:            "Internal error",
	KindMethodNotAllowed:    "Method not allowed",
	KindUnauthorized:        "Unauthorized",
	KindStoreFull:           "Idempotency store out of space",
	KindRateLimited:         "Over the tenant's limits",
}

// NewProblem returns the problem of kind with status and detail.
func NewProblem(status int, kind, detail string) Problem {
	return Problem{Type: ProblemTypePrefix + kind, Title: titles[kind], Status: status, Detail: detail}
}

// Write writes p as application/problem+json, with Retry-After when set.
func (p Problem) Write(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	if p.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(p.RetryAfter))
	}
	if p.Challenge != "" {
		h.Set("WWW-Authenticate", p.Challenge)
	}
	if l := p.link(); l != "" {
		h.Set("Link", l)
	}
	w.WriteHeader(p.Status)
	_ = json.NewEncoder(w).Encode(p)
}

// Body returns p encoded, for saving as an outcome.
func (p Problem) Body() []byte {
	b, _ := json.Marshal(p)
	return append(b, '\n')
}

// ProblemFor maps a store error to its HTTP problem: every store error
// becomes a status here. (The middleware also answers, itself, 503 for a
// response it could not save yet, and the worker API a conflict for a wait
// that ended with the key still in flight.)
func ProblemFor(err error) Problem {
	var ce *etcdstore.ConflictError
	switch {
	case errors.As(err, &ce):
		p := NewProblem(http.StatusConflict, KindConflict, "retry later with the same key and parameters")
		p.RetryAfter = retrySeconds(ce.RetryAfter)
		return p
	case errors.Is(err, jobs.ErrDuplicate):
		return NewProblem(http.StatusConflict, KindDuplicateJob, err.Error())
	case errors.Is(err, jobs.ErrSignalMismatch):
		return NewProblem(http.StatusConflict, KindSignalMismatch, err.Error())
	case errors.Is(err, jobs.ErrFinal):
		return NewProblem(http.StatusConflict, KindJobEnded, err.Error())
	case errors.Is(err, jobs.ErrInvalid):
		return NewProblem(http.StatusBadRequest, KindInvalidRequest, err.Error())
	case errors.Is(err, jobs.ErrTaskGone):
		return NewProblem(http.StatusGone, KindTaskGone, err.Error()+": stop this step; the job resumes from its last recovery point")
	case errors.Is(err, jobs.ErrUnknownKind):
		return NewProblem(http.StatusNotFound, KindUnknownKind, err.Error())
	case errors.Is(err, jobs.ErrNotJob):
		return NewProblem(http.StatusNotFound, KindNotFound, err.Error())
	case errors.Is(err, etcdstore.ErrMismatch):
		return NewProblem(http.StatusUnprocessableEntity, KindMismatch,
			"this key was first used with other parameters; do not retry: use a new key for a new operation")
	case errors.Is(err, etcdstore.ErrFenced), errors.Is(err, etcdstore.ErrClaimEnded):
		return NewProblem(http.StatusConflict, KindFenced, err.Error())
	case errors.Is(err, etcdstore.ErrInvalidKey):
		return NewProblem(http.StatusBadRequest, KindInvalidKey, err.Error())
	case errors.Is(err, etcdstore.ErrInvalidTenant):
		return NewProblem(http.StatusBadRequest, KindInvalidTenant, err.Error())
	case errors.Is(err, etcdstore.ErrInvalidParams):
		return NewProblem(http.StatusBadRequest, KindInvalidJSON, err.Error())
	case errors.Is(err, etcdstore.ErrInvalidArgument):
		return NewProblem(http.StatusBadRequest, KindInvalidRequest, err.Error())
	case errors.Is(err, etcdstore.ErrTooLarge):
		return NewProblem(http.StatusRequestEntityTooLarge, KindRequestTooLarge, err.Error())
	case errors.Is(err, etcdstore.ErrNotFound):
		return NewProblem(http.StatusNotFound, KindNotFound, err.Error())
	case errors.Is(err, etcdstore.ErrStoreFull):
		p := NewProblem(http.StatusServiceUnavailable, KindStoreFull,
			"the idempotency store is out of space (etcd's NOSPACE alarm): new operations cannot be claimed until an operator frees space; replays of finished ones still work; retry later with the same key")
		p.RetryAfter = 30
		return p
	case errors.Is(err, etcdstore.ErrRestored):
		p := NewProblem(http.StatusServiceUnavailable, KindUnavailable,
			"the idempotency store's etcd was restored from a snapshot: writes resume once idem has raised its epoch, so that no fencing token goes back; retry with the same key")
		p.RetryAfter = 1
		return p
	case errors.Is(err, etcdstore.ErrUnavailable), errors.Is(err, etcdstore.ErrClosed),
		errors.Is(err, context.DeadlineExceeded):
		p := NewProblem(http.StatusServiceUnavailable, KindUnavailable, "the idempotency store cannot be reached; retry with the same key")
		p.RetryAfter = 1
		return p
	}
	return NewProblem(http.StatusInternalServerError, KindInternal, "")
}

// retrySeconds rounds a retry hint up to whole seconds, at least 1.
func retrySeconds(d time.Duration) int {
	return max(1, int(math.Ceil(d.Seconds())))
}
