package idemclient

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/idem-dev/idem/idemhttp"
)

// Errors of the worker API, matched with errors.Is on an *Error.
var (
	ErrInFlight    = errors.New("idemclient: the key is in flight")                   // 409
	ErrKeyReused   = errors.New("idemclient: the key was used with other parameters") // 422
	ErrUnavailable = errors.New("idemclient: idem is unavailable")                    // 503
	ErrFenced      = errors.New("idemclient: the claim was taken over")               // 409 fenced
	ErrNotFound    = errors.New("idemclient: no such key")                            // 404
)

// Error is an answer of idem other than success: its status and its
// problem document (RFC 9457).
type Error struct {
	Status  int
	Problem idemhttp.Problem
}

func (e *Error) Error() string {
	return fmt.Sprintf("idem: %d %s: %s", e.Status, e.Problem.Title, e.Problem.Detail)
}

// Is matches the package's sentinels by status and problem type.
func (e *Error) Is(target error) bool {
	kind := problemKind(e.Problem.Type)
	switch target {
	case ErrFenced:
		return kind == idemhttp.KindFenced
	case ErrInFlight:
		return e.Status == http.StatusConflict && kind != idemhttp.KindFenced
	case ErrKeyReused:
		return e.Status == http.StatusUnprocessableEntity
	case ErrUnavailable:
		return e.Status == http.StatusServiceUnavailable
	case ErrNotFound:
		return e.Status == http.StatusNotFound
	}
	return false
}

// Worker is a client of idem's worker API (docs/HTTP.md, api/openapi.yaml)
// for workers that hold claims themselves. Every call is retried on network
// errors, 409 (in flight) and 503 within the Transport's budget; a claim is
// retried with the same attempt id, so a claim whose reply was lost is
// recognised as this worker's own.
type Worker struct {
	base   string
	client *http.Client
}

// NewWorker returns a client of the worker API at baseURL (idem's listen
// address, "http://idem:8080"). t shapes the retries (nil: defaults); its
// Base may carry TLS and authentication.
func NewWorker(baseURL string, t *Transport) (*Worker, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("idemclient: worker API URL %q: want http(s)://host[:port]", baseURL)
	}
	tr := Transport{}
	if t != nil {
		tr = *t
	}
	tr.keyless = true
	return &Worker{base: strings.TrimRight(baseURL, "/"), client: &http.Client{Transport: &tr}}, nil
}

// ClaimOptions are the optional parts of a claim.
type ClaimOptions struct {
	// Deadline bounds how long the claim is held without a renewal
	// (default: the server's).
	Deadline time.Duration
	// Wait, when set, waits up to this long for a claim in flight to end
	// instead of answering 409 at once.
	Wait time.Duration
}

// Claim claims key for an operation with params (JSON, fingerprinted in
// canonical form). The answer's State is "claimed" (run the work, then
// Complete with the handle) or "done" (the saved Outcome: do not run it).
func (w *Worker) Claim(ctx context.Context, key string, params json.RawMessage, o ClaimOptions) (*idemhttp.ClaimResponse, error) {
	var attempt [24]byte
	if _, err := rand.Read(attempt[:]); err != nil {
		return nil, err
	}
	req := idemhttp.ClaimRequest{Key: key, Params: params, Attempt: base64.RawURLEncoding.EncodeToString(attempt[:]),
		DeadlineMS: o.Deadline.Milliseconds(), WaitMS: o.Wait.Milliseconds()}
	var out idemhttp.ClaimResponse
	return &out, w.call(ctx, http.MethodPost, "/v1/claim", req, &out)
}

// Complete saves the outcome of a claimed key, replayed to every later
// claim.
func (w *Worker) Complete(ctx context.Context, h idemhttp.HandleJSON, out idemhttp.OutcomeJSON) (*idemhttp.HandleResponse, error) {
	var resp idemhttp.HandleResponse
	return &resp, w.call(ctx, http.MethodPost, "/v1/complete", idemhttp.CompleteRequest{Handle: h, Outcome: &out}, &resp)
}

// Checkpoint saves a recovery point (and, with extend, moves the deadline).
func (w *Worker) Checkpoint(ctx context.Context, h idemhttp.HandleJSON, checkpoint []byte, extend time.Duration) (*idemhttp.HandleResponse, error) {
	var resp idemhttp.HandleResponse
	return &resp, w.call(ctx, http.MethodPost, "/v1/checkpoint", idemhttp.CheckpointRequest{Handle: h, Checkpoint: checkpoint, ExtendMS: extend.Milliseconds()}, &resp)
}

// Renew moves the claim's deadline to extend from now.
func (w *Worker) Renew(ctx context.Context, h idemhttp.HandleJSON, extend time.Duration) (*idemhttp.HandleResponse, error) {
	var resp idemhttp.HandleResponse
	return &resp, w.call(ctx, http.MethodPost, "/v1/renew", idemhttp.RenewRequest{Handle: h, ExtendMS: extend.Milliseconds()}, &resp)
}

// Release deletes the claim: a later claim runs the work again. Only for
// work that had no effect.
func (w *Worker) Release(ctx context.Context, h idemhttp.HandleJSON) (*idemhttp.HandleResponse, error) {
	var resp idemhttp.HandleResponse
	return &resp, w.call(ctx, http.MethodPost, "/v1/release", idemhttp.HandleRequest{Handle: h}, &resp)
}

// Abandon leaves the claim for the next claimant to take over at once,
// resuming from its last checkpoint.
func (w *Worker) Abandon(ctx context.Context, h idemhttp.HandleJSON) (*idemhttp.HandleResponse, error) {
	var resp idemhttp.HandleResponse
	return &resp, w.call(ctx, http.MethodPost, "/v1/abandon", idemhttp.HandleRequest{Handle: h}, &resp)
}

// Get reads a key's record.
func (w *Worker) Get(ctx context.Context, key string) (*idemhttp.RecordJSON, error) {
	var rec idemhttp.RecordJSON
	return &rec, w.call(ctx, http.MethodGet, "/v1/keys/"+url.PathEscape(key), nil, &rec)
}

func (w *Worker) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("idemclient: encoding %s: %w", path, err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, w.base+path, body)
	if err != nil {
		return fmt.Errorf("idemclient: %s: %w", path, err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := w.client.Do(req)
	if err != nil {
		return fmt.Errorf("idemclient: %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return fmt.Errorf("idemclient: %s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode >= 300 {
		e := &Error{Status: resp.StatusCode}
		if json.Unmarshal(b, &e.Problem) != nil || e.Problem.Type == "" {
			e.Problem = idemhttp.Problem{Title: http.StatusText(resp.StatusCode), Detail: strings.TrimSpace(string(b))}
		}
		return fmt.Errorf("idemclient: %s %s: %w", method, path, e)
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("idemclient: %s %s: decoding the answer: %w", method, path, err)
	}
	return nil
}
