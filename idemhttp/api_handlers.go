package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/storex"
)

func (a *API) claim(w http.ResponseWriter, r *http.Request) {
	var req ClaimRequest
	tenant, ok := a.decode(w, r, &req)
	if !ok {
		return
	}
	key := etcdstore.Key{Tenant: tenant, ID: req.Key}
	fp, err := requestFingerprint(req)
	if err != nil {
		a.problem(w, ProblemFor(err))
		return
	}
	deadline := a.cfg.Deadline
	if req.DeadlineMS != 0 {
		deadline = time.Duration(req.DeadlineMS) * time.Millisecond
		if deadline <= 0 || deadline > a.cfg.MaxDeadline {
			a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest,
				fmt.Sprintf("deadline_ms %d must be between 1 and %d", req.DeadlineMS, a.cfg.MaxDeadline.Milliseconds())))
			return
		}
	}
	// The worker's liveness is its renewals, not this process's session:
	// the claim survives a restart of this idem process.
	opts := []etcdstore.ClaimOption{etcdstore.WithDeadline(deadline), etcdstore.WithoutSession()}
	if req.Attempt != "" {
		if len(req.Attempt) < MinAttemptLen {
			a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf(
				"attempt is %d characters; it must be at least %d of a random id (a UUIDv4, or 16 random bytes in base64url): with the key and the token it is the claim's capability",
				len(req.Attempt), MinAttemptLen)))
			return
		}
		opts = append(opts, etcdstore.WithAttempt(req.Attempt))
	}
	wait := preferWait(r.Header, a.cfg.MaxWait)
	if req.WaitMS > 0 {
		wait = min(time.Duration(req.WaitMS)*time.Millisecond, a.cfg.MaxWait)
	}
	ctx := r.Context()
	if wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, wait)
		defer cancel()
		opts = append(opts, etcdstore.WithWait())
	}
	if p := a.cfg.Limiter.admitClaim(tenant); p != nil {
		a.problem(w, *p)
		a.labelIs(w, labelRateLimited)
		return
	}
	if held := a.held(key, req.Attempt); held != nil {
		if held.Fingerprint() != fp {
			a.problem(w, ProblemFor(&etcdstore.MismatchError{Key: key}))
			a.labelIs(w, labelMismatch)
			return
		}
		// The same attempt claims again: its first reply was lost. Answer
		// with the claim as it stands.
		a.labelIs(w, labelClaimed)
		writeJSON(w, http.StatusCreated, claimResponse(held))
		return
	}
	c, done, err := a.cfg.Store.Claim(ctx, key, fp, opts...)
	if err != nil {
		if wait > 0 && errors.Is(err, context.DeadlineExceeded) && r.Context().Err() == nil {
			err = &etcdstore.ConflictError{Key: key, RetryAfter: time.Second}
		}
		a.fail(w, err)
		return
	}
	if done != nil {
		a.labelIs(w, labelReplayed)
		writeJSON(w, http.StatusOK, ClaimResponse{State: "done", Token: int64(done.Token), Outcome: outcomeJSON(done.Outcome)})
		return
	}
	a.hold(c)
	a.labelIs(w, labelClaimed)
	if c.TookOver() {
		a.labelIs(w, labelTakeover)
	}
	writeJSON(w, http.StatusCreated, claimResponse(c))
}

func claimResponse(c *etcdstore.Claim) ClaimResponse {
	resp := ClaimResponse{State: "claimed", Token: int64(c.Token()), Handle: handleJSON(c.Handle()), TookOver: c.TookOver(), Checkpoint: c.LastCheckpoint()}
	if d := c.Deadline(); !d.IsZero() {
		resp.Deadline = &d
	}
	return resp
}

// held returns the claim this process holds for attempt on key, if any.
func (a *API) held(key etcdstore.Key, attempt string) *etcdstore.Claim {
	if attempt == "" {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if c := a.claims[heldKey{key, attempt}]; c != nil && c.Err() == nil {
		return c
	}
	return nil
}

// hold keeps a claim made here until it ends or its deadline passes.
func (a *API) hold(c *etcdstore.Claim) {
	hk := heldKey{c.Key(), c.Attempt()}
	a.mu.Lock()
	a.claims[hk] = c
	a.mu.Unlock()
	go func() {
		<-c.Done() // ended, or past its deadline
		a.mu.Lock()
		if a.claims[hk] == c {
			delete(a.claims, hk)
		}
		a.mu.Unlock()
	}()
}

func (a *API) complete(w http.ResponseWriter, r *http.Request) {
	var req CompleteRequest
	a.withClaim(w, r, &req, &req.Handle, func() *Problem {
		if req.Outcome == nil {
			p := NewProblem(http.StatusBadRequest, KindInvalidRequest, "complete needs an outcome")
			return &p
		}
		return validOutcome(req.Outcome)
	}, func(*etcdstore.Claim) int {
		return outcomeSize(req.Outcome.Status, req.Outcome.Headers, req.Outcome.Body, req.Outcome.Error)
	}, func(ctx context.Context, c *etcdstore.Claim) (string, error) {
		o := req.Outcome
		return "done", c.Complete(ctx, etcdstore.Outcome{Status: o.Status, Header: o.Headers, Body: o.Body, Err: o.Error})
	}, func(rec *etcdstore.Record) bool {
		return rec != nil && rec.State == etcdstore.Done && sameOutcome(rec.Outcome, req.Outcome)
	})
}

func (a *API) checkpoint(w http.ResponseWriter, r *http.Request) {
	var req CheckpointRequest
	a.withClaim(w, r, &req, &req.Handle, func() *Problem {
		if len(req.Checkpoint) > a.cfg.MaxCheckpoint {
			p := NewProblem(http.StatusRequestEntityTooLarge, KindRequestTooLarge,
				fmt.Sprintf("checkpoint is %d bytes, limit %d: a recovery point names where to resume, not the work's data", len(req.Checkpoint), a.cfg.MaxCheckpoint))
			return &p
		}
		return a.checkExtend(req.ExtendMS, false)
	}, func(*etcdstore.Claim) int { return len(req.Checkpoint) },
		func(ctx context.Context, c *etcdstore.Claim) (string, error) {
			err := c.Checkpoint(ctx, req.Checkpoint)
			if err == nil && req.ExtendMS > 0 {
				err = c.Renew(ctx, time.Duration(req.ExtendMS)*time.Millisecond)
			}
			return "claimed", err
		}, nil)
}

func (a *API) renew(w http.ResponseWriter, r *http.Request) {
	var req RenewRequest
	a.withClaim(w, r, &req, &req.Handle, func() *Problem { return a.checkExtend(req.ExtendMS, true) }, rewrite,
		func(ctx context.Context, c *etcdstore.Claim) (string, error) {
			return "claimed", c.Renew(ctx, time.Duration(req.ExtendMS)*time.Millisecond)
		}, nil)
}

func (a *API) release(w http.ResponseWriter, r *http.Request) {
	var req HandleRequest
	a.withClaim(w, r, &req, &req.Handle, nil, nil, func(ctx context.Context, c *etcdstore.Claim) (string, error) {
		if c.TookOver() {
			return "abandoned", c.Release(ctx) // a claim that took over is kept for the next owner
		}
		return "released", c.Release(ctx)
	}, func(rec *etcdstore.Record) bool {
		// A retry after the release landed: the key has no record (or,
		// for a claim that took over, this claim's record abandoned).
		return rec == nil || rec.State == etcdstore.InFlight && rec.Owner == ""
	})
}

func (a *API) abandon(w http.ResponseWriter, r *http.Request) {
	var req HandleRequest
	a.withClaim(w, r, &req, &req.Handle, nil, rewrite, func(ctx context.Context, c *etcdstore.Claim) (string, error) {
		return "abandoned", c.Abandon(ctx)
	}, func(rec *etcdstore.Record) bool {
		return rec != nil && rec.State == etcdstore.InFlight && rec.Owner == ""
	})
}

// checkExtend validates extend_ms: required for renew, optional for
// checkpoint, and never past MaxDeadline.
func (a *API) checkExtend(ms int64, required bool) *Problem {
	if required && ms <= 0 {
		p := NewProblem(http.StatusBadRequest, KindInvalidRequest, "renew needs extend_ms > 0")
		return &p
	}
	if ms < 0 || time.Duration(ms)*time.Millisecond > a.cfg.MaxDeadline {
		p := NewProblem(http.StatusBadRequest, KindInvalidRequest,
			fmt.Sprintf("extend_ms must be between 0 and %d", a.cfg.MaxDeadline.Milliseconds()))
		return &p
	}
	return nil
}

// rewrite is the cost of a write that puts the claim's record again as it
// is (renew, abandon): its checkpoint.
func rewrite(c *etcdstore.Claim) int { return len(c.LastCheckpoint()) }

// withClaim serves one call on a claim's handle: it decodes req (whose
// handle is hj), runs check, finds the claim, takes what op will write
// (cost, nil: nothing counted) from the tenant's byte budget, and runs op. When the
// claim is no longer the handle's and landed reports that the record shows
// this very claim already did what op does (a retry after a lost reply),
// the call is answered with that state instead of a conflict.
func (a *API) withClaim(w http.ResponseWriter, r *http.Request, req any, hj *HandleJSON, check func() *Problem, cost func(*etcdstore.Claim) int,
	op func(context.Context, *etcdstore.Claim) (string, error), landed func(*etcdstore.Record) bool) {
	tenant, ok := a.decode(w, r, req)
	if !ok {
		return
	}
	h := etcdstore.Handle{Key: etcdstore.Key{Tenant: tenant, ID: hj.Key}, Attempt: hj.Attempt, Token: fencing.Token(hj.Token), Revision: hj.Revision}
	if err := h.Key.Validate(); err != nil {
		a.problem(w, ProblemFor(err))
		return
	}
	if check != nil {
		if p := check(); p != nil {
			a.problem(w, *p)
			return
		}
	}
	c, err := a.claimFor(r.Context(), h)
	if err != nil && errors.Is(err, etcdstore.ErrFenced) && landed != nil {
		rec, gerr := a.cfg.Store.Get(r.Context(), h.Key)
		switch {
		case errors.Is(gerr, etcdstore.ErrNotFound) && landed(nil):
			// Nobody holds the key: what this call does (a release) is
			// done, by this call's first try or since.
			a.labelIs(w, labelClaimed)
			writeJSON(w, http.StatusOK, HandleResponse{State: "released"})
			return
		case gerr == nil && rec.Token == h.Token && (rec.State == etcdstore.Done || storex.SameAttempt(rec.Attempt, h.Attempt)) && landed(rec):
			a.labelIs(w, labelClaimed)
			writeJSON(w, http.StatusOK, HandleResponse{State: stateOf(rec)})
			return
		}
	}
	if err != nil {
		a.fail(w, err)
		return
	}
	if cost != nil {
		if p := a.cfg.Limiter.admitBytes(tenant, cost(c)); p != nil {
			a.problem(w, *p)
			a.labelIs(w, labelRateLimited)
			return
		}
	}
	state, err := op(r.Context(), c)
	if err != nil {
		a.fail(w, err)
		return
	}
	resp := HandleResponse{State: state}
	if state == "claimed" {
		resp.Handle = handleJSON(c.Handle())
	}
	a.labelIs(w, labelClaimed)
	writeJSON(w, http.StatusOK, resp)
}

// stateOf names a record's state as the API's answers do.
func stateOf(rec *etcdstore.Record) string {
	switch {
	case rec.State == etcdstore.Done:
		return "done"
	case rec.Owner == "":
		return "abandoned"
	}
	return "claimed"
}

// sameOutcome reports whether a saved outcome is the one a request carries.
func sameOutcome(o *etcdstore.Outcome, j *OutcomeJSON) bool {
	if o.Status != j.Status || o.Err != j.Error || !bytes.Equal(o.Body, j.Body) || len(o.Header) != len(j.Headers) {
		return false
	}
	for k, vs := range o.Header {
		if !slices.Equal(vs, j.Headers[k]) {
			return false
		}
	}
	return true
}

// claimFor finds the claim of h: the one made here, or one attached from
// etcd when the claim was made by another idem process (or before a restart).
func (a *API) claimFor(ctx context.Context, h etcdstore.Handle) (*etcdstore.Claim, error) {
	a.mu.Lock()
	c := a.claims[heldKey{h.Key, h.Attempt}]
	a.mu.Unlock()
	// The handle's tenant comes from authentication: a claim of another
	// tenant is never found here, even with its attempt id. Key, attempt and
	// token identify the claim, here as through Attach.
	if c != nil && c.Token() == h.Token {
		return c, nil
	}
	return a.cfg.Store.Attach(ctx, h)
}

func (a *API) get(w http.ResponseWriter, r *http.Request) {
	tenant, err := a.cfg.Tenant(r)
	if err != nil {
		a.problem(w, tenantProblem(err))
		return
	}
	key := etcdstore.Key{Tenant: tenant, ID: r.PathValue("key")}
	var rec *etcdstore.Record
	wait := preferWait(r.Header, a.cfg.MaxWait)
	if s := r.URL.Query().Get("wait"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			a.problem(w, NewProblem(http.StatusBadRequest, KindInvalidRequest, "wait must be a whole number of seconds"))
			return
		}
		wait = min(time.Duration(n)*time.Second, a.cfg.MaxWait)
	}
	if wait > 0 {
		ctx, cancel := context.WithTimeout(r.Context(), wait)
		defer cancel()
		rec, err = a.cfg.Store.Wait(ctx, key)
		if errors.Is(err, context.DeadlineExceeded) && r.Context().Err() == nil {
			rec, err = a.cfg.Store.Get(r.Context(), key) // still in flight: say so
		}
	} else {
		rec, err = a.cfg.Store.Get(r.Context(), key)
	}
	if err != nil {
		a.problem(w, ProblemFor(err))
		return
	}
	out := RecordView(rec)
	a.labelIs(w, labelPassthrough)
	writeJSON(w, http.StatusOK, out)
}

// validOutcome refuses an outcome a replay could not send as HTTP: a
// status outside 100-599 (0: none, for outcomes that are not HTTP), a
// header name or value HTTP does not allow.
func validOutcome(o *OutcomeJSON) *Problem {
	if o.Status != 0 && (o.Status < 100 || o.Status > 599) {
		p := NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("outcome status %d: an HTTP status is 100 to 599 (0: none)", o.Status))
		return &p
	}
	for name, vs := range o.Headers {
		if !httpguts.ValidHeaderFieldName(name) {
			p := NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("outcome header name %s is not a valid HTTP field name", strconv.QuoteToASCII(name)))
			return &p
		}
		for _, v := range vs {
			if !httpguts.ValidHeaderFieldValue(v) {
				p := NewProblem(http.StatusBadRequest, KindInvalidRequest, fmt.Sprintf("outcome header %s has a value HTTP does not allow: %s", name, strconv.QuoteToASCII(v)))
				return &p
			}
		}
	}
	return nil
}
