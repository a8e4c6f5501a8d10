package idemhttp

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

// JobsConfig serves jobs (package jobs) on the worker API: submit, get and
// signal, for programs in any language.
type JobsConfig struct {
	// Queue returns the queue of a tenant's jobs.
	Queue func(tenant string) (*jobs.Queue, error)
	// Tenant is the tenant of a request's jobs (default
	// FixedTenant(jobs.DefaultTenant); with authentication, the caller's).
	Tenant TenantFunc
	// Hub returns the hub that runs a tenant's declared kinds for the
	// workers of /v1/work (nil: those routes answer 404 no-such-route).
	Hub func(tenant string) (*jobs.Hub, error)
}

// SubmitJobRequest is the body of POST /v1/jobs.
type SubmitJobRequest struct {
	ID   string `json:"id"`
	Kind string `json:"kind"`
	// Params are the job's parameters as JSON, or ParamsBase64 any bytes.
	Params       json.RawMessage `json:"params,omitempty"`
	ParamsBase64 []byte          `json:"params_base64,omitempty"`
	// RunAt holds the first attempt back until then (RFC 3339).
	RunAt *time.Time `json:"run_at,omitempty"`
	// IfExists: "return" (default) answers the job the id names already
	// (200); "refuse" answers 409 duplicate-job with it.
	IfExists string `json:"if_exists,omitempty"`
	// DedupWindowMS: the id names one job for this long after it was
	// submitted; past it, an ended job is replaced (0: the retention).
	DedupWindowMS int64 `json:"dedup_window_ms,omitempty"`
	// SubmissionID names this submission on every retry of it, so that a
	// retry after an unknown outcome (a 503, a lost reply) gets 201 and its
	// own job, not 200 or 409 duplicate-job.
	SubmissionID string `json:"submission_id,omitempty"`
}

// maxDedupWindowMS bounds dedup_window_ms (100 years): past it, it would
// overflow a time.Duration.
const maxDedupWindowMS = 100 * 365 * 24 * 3600 * 1000

// SignalRequest is the body of POST /v1/jobs/{id}/signals/{event}.
type SignalRequest struct {
	Payload       json.RawMessage `json:"payload,omitempty"`
	PayloadBase64 []byte          `json:"payload_base64,omitempty"`
}

// JobJSON is a job on the wire.
type JobJSON struct {
	Tenant    string          `json:"tenant"`
	ID        string          `json:"id"`
	Kind      string          `json:"kind"`
	State     jobs.State      `json:"state"`
	Attempts  int             `json:"attempts"`
	Token     int64           `json:"token"`
	Params    json.RawMessage `json:"params,omitempty"`
	ParamsB64 []byte          `json:"params_base64,omitempty"`
	Steps     []JobStepJSON   `json:"steps,omitempty"`
	Error     string          `json:"error,omitempty"`
	NotBefore *time.Time      `json:"not_before,omitempty"`
	Awaiting  string          `json:"awaiting,omitempty"`
	Limited   string          `json:"limited,omitempty"`
	Zone      string          `json:"zone,omitempty"`
	Created   time.Time       `json:"created"`
	Expires   time.Time       `json:"expires"`
}

// JobStepJSON is one step of a job on the wire.
type JobStepJSON struct {
	Name      string          `json:"name"`
	Finished  bool            `json:"finished"`
	Token     int64           `json:"token,omitempty"`
	Output    json.RawMessage `json:"output,omitempty"`
	OutputB64 []byte          `json:"output_base64,omitempty"`
}

// JobView is j on the wire.
func JobView(j *jobs.Job) JobJSON {
	v := JobJSON{Tenant: j.Key.Tenant, ID: j.Key.ID, Kind: j.Kind, State: j.State, Attempts: j.Attempts, Token: int64(j.Token),
		Error: j.Err, Awaiting: j.Awaiting, Limited: j.Limited, Zone: j.Zone, Created: j.Created, Expires: j.Expires}
	v.Params, v.ParamsB64 = rawOrBase64(j.Params)
	if !j.NotBefore.IsZero() {
		nb := j.NotBefore
		v.NotBefore = &nb
	}
	for _, s := range j.Steps {
		sv := JobStepJSON{Name: s.Name, Finished: s.Finished, Token: int64(s.Token)}
		sv.Output, sv.OutputB64 = rawOrBase64(s.Output)
		v.Steps = append(v.Steps, sv)
	}
	return v
}

func rawOrBase64(b []byte) (json.RawMessage, []byte) {
	switch {
	case len(b) == 0:
		return nil, nil
	case json.Valid(b):
		return json.RawMessage(b), nil
	}
	return nil, b
}

// bytesOf is a request's JSON or base64 bytes: one of the two.
func bytesOf(what string, raw json.RawMessage, b64 []byte) ([]byte, *Problem) {
	if len(raw) > 0 && len(b64) > 0 {
		p := NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("%s and %s_base64: send one", what, what))
		return nil, &p
	}
	if len(raw) > 0 {
		return raw, nil
	}
	return b64, nil
}

// jobsQueue is the queue of the request's tenant, or nil when the request
// was answered.
func (a *API) jobsQueue(w http.ResponseWriter, r *http.Request, tenant string) *jobs.Queue {
	q, err := a.cfg.Jobs.Queue(tenant)
	if err != nil {
		if errors.Is(err, jobs.ErrInvalid) || errors.Is(err, etcdstore.ErrInvalidTenant) {
			a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidTenant, err.Error()))
		} else {
			a.fail(w, err)
		}
		return nil
	}
	return q
}

func (a *API) jobsTenant(w http.ResponseWriter, r *http.Request) (string, bool) {
	tenant, err := a.cfg.Jobs.Tenant(r)
	if err != nil {
		a.problem(w, tenantProblem(err))
		return "", false
	}
	return tenant, true
}

func (a *API) submitJob(w http.ResponseWriter, r *http.Request) {
	var req SubmitJobRequest
	if _, ok := a.decode(w, r, &req); !ok {
		return
	}
	tenant, ok := a.jobsTenant(w, r)
	if !ok {
		return
	}
	params, p := bytesOf("params", req.Params, req.ParamsBase64)
	switch {
	case p != nil:
		a.problem(w, *p)
		return
	case req.ID == "" || req.Kind == "":
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, "id and kind are required"))
		return
	case req.IfExists != "" && req.IfExists != "return" && req.IfExists != "refuse":
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("if_exists %q: return or refuse", req.IfExists)))
		return
	case req.DedupWindowMS < 0 || req.DedupWindowMS > maxDedupWindowMS:
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("dedup_window_ms must be 0 to %d (100 years)", maxDedupWindowMS)))
		return
	}
	q := a.jobsQueue(w, r, tenant)
	if q == nil {
		return
	}
	// Refused duplicates are how a new job is told from an existing one:
	// 201 for this request's job, 200 (or 409) for another's.
	opts := []jobs.SubmitOption{jobs.RefuseDuplicate(), jobs.DedupWindow(time.Duration(req.DedupWindowMS) * time.Millisecond)}
	if req.RunAt != nil {
		opts = append(opts, jobs.RunAt(*req.RunAt))
	}
	if req.SubmissionID != "" {
		opts = append(opts, jobs.SubmissionID(req.SubmissionID))
	}
	j, err := q.Submit(r.Context(), req.ID, req.Kind, params, opts...)
	switch {
	case errors.Is(err, jobs.ErrDuplicate) && req.IfExists == "refuse":
		a.fail(w, err)
	case errors.Is(err, jobs.ErrDuplicate):
		a.labelIs(w, labelReplayed)
		writeJSON(w, http.StatusOK, JobView(j))
	case err != nil:
		a.fail(w, err)
	default:
		a.labelIs(w, labelClaimed)
		writeJSON(w, http.StatusCreated, JobView(j))
	}
}

func (a *API) getJob(w http.ResponseWriter, r *http.Request) {
	tenant, ok := a.jobsTenant(w, r)
	if !ok {
		return
	}
	q := a.jobsQueue(w, r, tenant)
	if q == nil {
		return
	}
	j, err := q.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		a.fail(w, err)
		return
	}
	a.labelIs(w, labelPassthrough)
	writeJSON(w, http.StatusOK, JobView(j))
}

func (a *API) signalJob(w http.ResponseWriter, r *http.Request) {
	var req SignalRequest
	if _, ok := a.decode(w, r, &req); !ok {
		return
	}
	tenant, ok := a.jobsTenant(w, r)
	if !ok {
		return
	}
	payload, p := bytesOf("payload", req.Payload, req.PayloadBase64)
	if p != nil {
		a.problem(w, *p)
		return
	}
	q := a.jobsQueue(w, r, tenant)
	if q == nil {
		return
	}
	if err := q.Signal(r.Context(), r.PathValue("id"), r.PathValue("event"), payload); err != nil {
		a.fail(w, err)
		return
	}
	a.labelIs(w, labelClaimed)
	writeJSON(w, http.StatusAccepted, struct {
		ID    string `json:"id"`
		Event string `json:"event"`
	}{r.PathValue("id"), r.PathValue("event")})
}

// SlotJSON is one held slot of a jobs limit on the wire.
type SlotJSON struct {
	Limit string    `json:"limit"`
	Key   string    `json:"key"`
	Slot  int       `json:"slot"`
	Job   string    `json:"job"`
	Token int64     `json:"token"`
	Since time.Time `json:"since"`
}

// listSlots answers the concurrency slots of the caller's jobs limits held
// now (?limit=NAME: one limit's).
func (a *API) listSlots(w http.ResponseWriter, r *http.Request) {
	tenant, ok := a.jobsTenant(w, r)
	if !ok {
		return
	}
	limit := r.URL.Query().Get("limit")
	if limit != "" {
		if err := jobs.ValidateName(limit); err != nil {
			a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, "limit: "+err.Error()))
			return
		}
	}
	q := a.jobsQueue(w, r, tenant)
	if q == nil {
		return
	}
	slots, err := q.Slots(r.Context(), limit)
	if err != nil {
		a.fail(w, err)
		return
	}
	out := make([]SlotJSON, len(slots))
	for i, s := range slots {
		out[i] = SlotJSON{Limit: s.Limit, Key: s.Key, Slot: s.Slot, Job: s.Job, Token: int64(s.Token), Since: s.Since}
	}
	a.labelIs(w, labelPassthrough)
	writeJSON(w, http.StatusOK, map[string]any{"slots": out})
}
