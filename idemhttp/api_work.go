package idemhttp

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/idem-dev/idem/jobs"
)

// The job-worker protocol: kinds declared once (/v1/kinds), and workers
// in any language that long-poll for a step of them (/v1/work/next) and
// report on it (/v1/work/tasks/{task}/...). Each tenant's steps come from
// its jobs.Hub: the engine a Go jobs.Worker runs.

// TaskJSON is a step handed to a worker: POST /v1/work/next's answer.
type TaskJSON struct {
	Task         string                     `json:"task"`
	Job          string                     `json:"job"`
	Kind         string                     `json:"kind"`
	Step         string                     `json:"step"`
	Attempt      int                        `json:"attempt"`
	Token        string                     `json:"token"`
	StepKey      string                     `json:"step_key"`
	Compensating bool                       `json:"compensating,omitempty"`
	Params       json.RawMessage            `json:"params,omitempty"`
	ParamsB64    []byte                     `json:"params_base64,omitempty"`
	Outputs      map[string]json.RawMessage `json:"outputs,omitempty"`
	OutputsB64   map[string][]byte          `json:"outputs_base64,omitempty"`
	TimeoutMS    int64                      `json:"timeout_ms"`
}

// NextRequest is the body of POST /v1/work/next.
type NextRequest struct {
	Kinds  []string `json:"kinds"`
	WaitMS int64    `json:"wait_ms,omitempty"`
}

// ReportRequest is the body of POST /v1/work/tasks/{task}/{op}: Seq
// numbers a task's reports from 1 (renew takes none).
type ReportRequest struct {
	Seq          int             `json:"seq,omitempty"`
	DurationMS   int64           `json:"duration_ms,omitempty"` // sleep
	Until        *time.Time      `json:"until,omitempty"`       // sleep
	Event        string          `json:"event,omitempty"`       // await
	TimeoutMS    int64           `json:"timeout_ms,omitempty"`  // await
	Output       json.RawMessage `json:"output,omitempty"`      // done
	OutputBase64 []byte          `json:"output_base64,omitempty"`
	Error        string          `json:"error,omitempty"` // fail
}

// AnswerJSON is the answer to a report.
type AnswerJSON struct {
	Result     string          `json:"result"`
	Payload    json.RawMessage `json:"payload,omitempty"`
	PayloadB64 []byte          `json:"payload_base64,omitempty"`
	Error      string          `json:"error,omitempty"`
}

func taskView(t *jobs.Task) TaskJSON {
	v := TaskJSON{Task: t.ID, Job: t.Job, Kind: t.Kind, Step: t.Step, Attempt: t.Attempt, Token: t.Token, StepKey: t.StepKey,
		Compensating: t.Compensating, TimeoutMS: t.Timeout.Milliseconds()}
	v.Params, v.ParamsB64 = rawOrBase64(t.Params)
	for name, out := range t.Outputs {
		raw, b64 := rawOrBase64(out)
		switch {
		case raw != nil:
			if v.Outputs == nil {
				v.Outputs = map[string]json.RawMessage{}
			}
			v.Outputs[name] = raw
		case b64 != nil:
			if v.OutputsB64 == nil {
				v.OutputsB64 = map[string][]byte{}
			}
			v.OutputsB64[name] = b64
		}
	}
	return v
}

// hub is the request's tenant's hub, or nil when the request was answered.
func (a *API) hub(w http.ResponseWriter, r *http.Request) *jobs.Hub {
	tenant, ok := a.jobsTenant(w, r)
	if !ok {
		return nil
	}
	if a.cfg.Jobs.Hub == nil {
		a.problem(w, NewProblem(http.StatusNotFound, KindNoSuchRoute, "this idem runs no declared kinds"))
		return nil
	}
	h, err := a.cfg.Jobs.Hub(tenant)
	if err != nil {
		a.fail(w, err)
		return nil
	}
	return h
}

func (a *API) nextTask(w http.ResponseWriter, r *http.Request) {
	var req NextRequest
	if _, ok := a.decode(w, r, &req); !ok {
		return
	}
	switch {
	case len(req.Kinds) == 0:
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, "kinds: name the kinds this worker runs"))
		return
	case req.WaitMS < 0:
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("wait_ms %d is negative", req.WaitMS)))
		return
	}
	h := a.hub(w, r)
	if h == nil {
		return
	}
	wait := a.cfg.MaxWait // wait_ms: default and cap
	if req.WaitMS > 0 {
		wait = min(time.Duration(req.WaitMS)*time.Millisecond, a.cfg.MaxWait)
	}
	ctx, cancel := context.WithTimeout(r.Context(), wait)
	defer cancel()
	t, err := h.Next(ctx, req.Kinds)
	switch {
	case err != nil:
		a.fail(w, err)
	case t == nil:
		a.labelIs(w, labelPassthrough)
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusNoContent)
	default:
		a.labelIs(w, labelClaimed)
		writeJSON(w, http.StatusOK, taskView(t))
	}
}

func (a *API) reportTask(w http.ResponseWriter, r *http.Request) {
	var req ReportRequest
	if _, ok := a.decode(w, r, &req); !ok {
		return
	}
	rep := jobs.Report{Seq: req.Seq, Op: r.PathValue("op"), Event: req.Event, Error: req.Error}
	var problem string
	switch rep.Op {
	case "renew":
	case "sleep":
		if req.Until != nil {
			rep.Until = *req.Until
		}
		rep.For = time.Duration(req.DurationMS) * time.Millisecond
		if (req.Until == nil) == (req.DurationMS == 0) && req.DurationMS >= 0 {
			problem = "a sleep names duration_ms or until: one of them"
		}
		if req.DurationMS < 0 {
			problem = fmt.Sprintf("duration_ms %d is negative", req.DurationMS)
		}
	case "await":
		rep.For = time.Duration(req.TimeoutMS) * time.Millisecond
		if req.Event == "" {
			problem = "an await names its event"
		}
		if req.TimeoutMS < 0 {
			problem = fmt.Sprintf("timeout_ms %d is negative", req.TimeoutMS)
		}
	case "done":
		out, p := bytesOf("output", req.Output, req.OutputBase64)
		if p != nil {
			a.problem(w, *p)
			return
		}
		rep.Output = out
	case "fail":
		if req.Error == "" {
			problem = "a failure says why: error"
		}
	default:
		a.problem(w, NewProblem(http.StatusNotFound, KindNoSuchRoute, "no such report: "+rep.Op+" (renew, sleep, await, done or fail)"))
		return
	}
	if problem != "" {
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, problem))
		return
	}
	h := a.hub(w, r)
	if h == nil {
		return
	}
	ans, err := h.Report(r.Context(), r.PathValue("task"), rep)
	if err != nil {
		a.fail(w, err)
		return
	}
	v := AnswerJSON{Result: ans.Result, Error: ans.Error}
	v.Payload, v.PayloadB64 = rawOrBase64(ans.Payload)
	a.labelIs(w, labelClaimed)
	writeJSON(w, http.StatusOK, v)
}

func (a *API) putKind(w http.ResponseWriter, r *http.Request) {
	var d jobs.Declaration
	if _, ok := a.decode(w, r, &d); !ok {
		return
	}
	if d.Name == "" {
		d.Name = r.PathValue("kind")
	}
	if d.Name != r.PathValue("kind") {
		a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("name %q differs from the path's kind %q", d.Name, r.PathValue("kind"))))
		return
	}
	q := a.kindsQueue(w, r)
	if q == nil {
		return
	}
	if err := q.Declare(r.Context(), d); err != nil {
		a.fail(w, err)
		return
	}
	a.labelIs(w, labelClaimed)
	writeJSON(w, http.StatusOK, d)
}

func (a *API) kindsQueue(w http.ResponseWriter, r *http.Request) *jobs.Queue {
	tenant, ok := a.jobsTenant(w, r)
	if !ok {
		return nil
	}
	return a.jobsQueue(w, r, tenant)
}

// declared is the request's tenant's declared kinds, or false when the
// request was answered.
func (a *API) declared(w http.ResponseWriter, r *http.Request) ([]jobs.Declaration, bool) {
	q := a.kindsQueue(w, r)
	if q == nil {
		return nil, false
	}
	ds, err := q.Declared(r.Context())
	if err != nil {
		a.fail(w, err)
		return nil, false
	}
	return ds, true
}

func (a *API) listKinds(w http.ResponseWriter, r *http.Request) {
	ds, ok := a.declared(w, r)
	if !ok {
		return
	}
	if ds == nil {
		ds = []jobs.Declaration{}
	}
	a.labelIs(w, labelPassthrough)
	writeJSON(w, http.StatusOK, struct {
		Kinds []jobs.Declaration `json:"kinds"`
	}{ds})
}

func (a *API) getKind(w http.ResponseWriter, r *http.Request) {
	ds, ok := a.declared(w, r)
	if !ok {
		return
	}
	for _, d := range ds {
		if d.Name == r.PathValue("kind") {
			a.labelIs(w, labelPassthrough)
			writeJSON(w, http.StatusOK, d)
			return
		}
	}
	a.fail(w, fmt.Errorf("%w: %s", jobs.ErrUnknownKind, r.PathValue("kind")))
}

func (a *API) deleteKind(w http.ResponseWriter, r *http.Request) {
	q := a.kindsQueue(w, r)
	if q == nil {
		return
	}
	ok, err := q.Undeclare(r.Context(), r.PathValue("kind"))
	switch {
	case err != nil:
		a.fail(w, err)
	case !ok:
		a.fail(w, fmt.Errorf("%w: %s", jobs.ErrUnknownKind, r.PathValue("kind")))
	default:
		a.labelIs(w, labelClaimed)
		w.WriteHeader(http.StatusNoContent)
	}
}
