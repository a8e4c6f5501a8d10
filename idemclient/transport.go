// Package idemclient is the client half of idempotency keys: an
// http.RoundTripper that gives each logical operation one key and retries
// it safely, and a client for idem's worker API.
//
// The rules it follows (Stripe's and Brandur Leach's, and the IETF
// Idempotency-Key draft's):
//
//   - One key per logical operation: the caller's (WithKey, or an
//     Idempotency-Key header it set), or one generated once and reused by
//     every retry of that operation. A new key is a new operation.
//   - Retry what idem says to retry with the same key (docs/HTTP.md):
//     network errors and a response body cut off (the request may or may
//     not have run; the key makes resending safe), and idem's own problems
//     conflict (409, the key in flight), fenced (409, taken over while the
//     upstream ran), rate-limited (429), upstream-unavailable (502: the
//     request never reached the upstream), unavailable and store-full
//     (503); and a 502, 503 or 504 that did not come through idem's claim
//     (a gateway in front of idem). Never a replay, and never the
//     upstream's own answer whatever its status: both are final.
//   - Back off exponentially with full jitter, and honour Retry-After.
//   - Stop within a budget well inside the key's retention: once a key is
//     forgotten, a retry is a new operation. The budget is capped at a
//     quarter of the retention the server advertises (Idempotency-Retention).
//   - Read the answer's body before returning it (up to
//     MaxBufferedResponse), so that a body cut off is retried with the same
//     key, not surfaced as a bare read error; every error returned names
//     the key (KeyError, KeyOf).
package idemclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/idem-dev/idem/idemhttp"
)

// Headers idem uses.
const (
	HeaderKey       = "Idempotency-Key"
	HeaderReplayed  = "Idempotent-Replayed"
	HeaderRetention = "Idempotency-Retention"
)

// Defaults of Transport.
const (
	DefaultBudget      = 2 * time.Minute
	DefaultMaxAttempts = 10
	DefaultBaseDelay   = 100 * time.Millisecond
	DefaultMaxDelay    = 10 * time.Second
)

// MaxBufferedBody is the largest request body the Transport reads into
// memory to resend; a request with GetBody set is not read.
const MaxBufferedBody = 16 << 20

// MaxBufferedResponse is the largest response body the Transport reads
// before it returns the response; a larger one is returned as it streams,
// and an error reading it is a *KeyError naming the key.
const MaxBufferedResponse = 16 << 20

// ErrBudget is returned (in a *KeyError, with the last error) when the
// retries of an operation ran out of attempts or time after a network
// error. Its outcome is unknown: retry it later with the same key
// (KeyError.Key, Report.Key) inside the retention, or reconcile.
var ErrBudget = errors.New("idemclient: retry budget spent; the outcome is unknown")

// KeyError is every error the Transport returns for a request it gave a key
// (http.Client wraps it in a *url.Error; errors.As finds it): it names the
// key, so that the caller can retry the same operation with it rather than
// start a new one.
type KeyError struct {
	Key      string
	Attempts int
	Err      error
}

func (e *KeyError) Error() string {
	return fmt.Sprintf("idemclient: key %s (%d attempts): %v", e.Key, e.Attempts, e.Err)
}

func (e *KeyError) Unwrap() error { return e.Err }

// KeyOf returns the idempotency key an error of the Transport names: retry
// the operation with it.
func KeyOf(err error) (string, bool) {
	var e *KeyError
	if errors.As(err, &e) {
		return e.Key, true
	}
	return "", false
}

// Transport is an http.RoundTripper that makes requests of the methods it
// covers idempotent by key and retries them. Its zero value is usable.
type Transport struct {
	// Base sends each attempt (default http.DefaultTransport).
	Base http.RoundTripper
	// Methods are the methods given keys and retried (default POST and
	// PATCH). Others go through Base once.
	Methods []string
	// MaxAttempts bounds the attempts of one operation (default 10).
	MaxAttempts int
	// Budget bounds the time from the first attempt to the start of the
	// last (default 2 minutes), capped at a quarter of the server's
	// advertised retention.
	Budget time.Duration
	// BaseDelay and MaxDelay shape the backoff: attempt n waits a random
	// time in [0, min(MaxDelay, BaseDelay*2^n)), or Retry-After when the
	// server sends one (defaults 100 ms and 10 s).
	BaseDelay, MaxDelay time.Duration
	// OnRetry, when set, is told of every retry before its wait.
	OnRetry func(RetryInfo)

	keyless bool // the worker API's calls: keys are in their bodies
}

// RetryInfo describes one retry, for logging.
type RetryInfo struct {
	Key     string
	Attempt int           // the attempt that failed, from 1
	Status  int           // its status, 0 after a network error
	Err     error         // the network error
	Wait    time.Duration // before the next attempt
}

// Report says what happened to one operation: its key, how many attempts
// it took and whether its answer was replayed (its work ran earlier, under
// an earlier attempt or an earlier call with this key).
type Report struct {
	Key      string
	Attempts int
	Replayed bool
}

type keyCtx struct{}
type reportCtx struct{}

// WithKey returns a context whose request uses key as its idempotency key
// (one the caller persisted with the operation, such as an order id).
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// WithReport returns a context whose request fills r when it ends.
func WithReport(ctx context.Context, r *Report) context.Context {
	return context.WithValue(ctx, reportCtx{}, r)
}

// NewKey returns a fresh key (a random UUID).
func NewKey() string { return uuid.NewString() }

// Replayed reports whether a response was replayed by idem.
func Replayed(resp *http.Response) bool {
	return resp != nil && resp.Header.Get(HeaderReplayed) == "true"
}

// RoundTrip sends req, and retries it with the same key as the package
// documentation says.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	methods := t.Methods
	if methods == nil {
		methods = []string{http.MethodPost, http.MethodPatch}
	}
	if t.keyless {
		methods = []string{http.MethodPost, http.MethodGet}
	}
	if !slices.Contains(methods, req.Method) {
		return base.RoundTrip(req)
	}
	ctx := req.Context()
	key := req.Header.Get(HeaderKey)
	if key == "" {
		key, _ = ctx.Value(keyCtx{}).(string)
	}
	if key == "" && !t.keyless {
		key = NewKey()
	}
	// fail is the error of a call: it names the key, for a caller's retry
	// of the same operation (the worker API's calls send none: their keys
	// are in their bodies).
	fail := func(attempt int, err error) error {
		if t.keyless {
			return fmt.Errorf("idemclient: %d attempts: %w", attempt, err)
		}
		return &KeyError{Key: key, Attempts: attempt, Err: err}
	}
	// Every attempt sends a fresh copy of the body; the caller's is closed
	// here, as a RoundTripper must.
	getBody := req.GetBody
	if req.Body != nil && req.Body != http.NoBody {
		if getBody == nil {
			b, err := io.ReadAll(io.LimitReader(req.Body, MaxBufferedBody+1))
			if err == nil && len(b) > MaxBufferedBody {
				err = fmt.Errorf("over %d bytes: set Request.GetBody to send larger bodies", MaxBufferedBody)
			}
			if err != nil {
				req.Body.Close()
				return nil, fail(0, fmt.Errorf("reading the request body (nothing was sent): %w", err))
			}
			getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
		}
		req.Body.Close()
	}
	rep, _ := ctx.Value(reportCtx{}).(*Report)
	if rep == nil {
		rep = &Report{}
	}
	*rep = Report{Key: key}

	maxAttempts, budget := or(t.MaxAttempts, DefaultMaxAttempts), or(t.Budget, DefaultBudget)
	baseDelay, maxDelay := or(t.BaseDelay, DefaultBaseDelay), or(t.MaxDelay, DefaultMaxDelay)
	start := time.Now()
	for attempt := 1; ; attempt++ {
		r := req.Clone(ctx)
		if !t.keyless {
			r.Header.Set(HeaderKey, key)
		}
		if getBody != nil {
			body, err := getBody()
			if err != nil {
				return nil, fail(attempt, fmt.Errorf("rewinding the request body: %w", err))
			}
			r.Body = body
		}
		rep.Attempts = attempt
		resp, err := base.RoundTrip(r)
		if resp != nil {
			if ret, perr := strconv.Atoi(resp.Header.Get(HeaderRetention)); perr == nil && ret > 0 {
				budget = min(budget, time.Duration(ret)*time.Second/4)
			}
			rep.Replayed = Replayed(resp)
		}
		if err == nil && !t.retryable(resp) {
			// An answer, or a refusal a retry would get again: its body is
			// part of it. One cut off is retried as a network error (the
			// retry gets the saved answer).
			if err = readBody(resp, key, attempt); err == nil {
				return resp, nil
			}
			resp = nil
		}
		if ctx.Err() != nil {
			if resp != nil {
				return resp, nil
			}
			return nil, fail(attempt, err)
		}
		wait := backoff(attempt, baseDelay, maxDelay)
		status := 0
		if resp != nil {
			status = resp.StatusCode
			if ra, ok := retryAfter(resp.Header.Get("Retry-After")); ok {
				wait = ra
			}
		}
		if attempt >= maxAttempts || time.Since(start)+wait > budget {
			if resp != nil {
				if rerr := readBody(resp, key, attempt); rerr == nil {
					return resp, nil // the caller sees the last answer: 409 or 503, and its Retry-After
				} else {
					err = rerr
				}
			}
			return nil, fail(attempt, fmt.Errorf("%w: %d attempts in %v: %w", ErrBudget, attempt, time.Since(start).Round(time.Millisecond), err))
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
		}
		if t.OnRetry != nil {
			t.OnRetry(RetryInfo{Key: key, Attempt: attempt, Status: status, Err: err, Wait: wait})
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, fail(attempt, fmt.Errorf("waiting to retry: %w", ctx.Err()))
		case <-timer.C:
		}
	}
}

// readBody reads resp's body into memory, up to MaxBufferedResponse; a
// larger one is left to stream, its read errors naming the key. An error
// reading it is returned (the body closed).
func readBody(resp *http.Response, key string, attempt int) error {
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxBufferedResponse+1))
	if err != nil {
		resp.Body.Close()
		return fmt.Errorf("reading the response body (status %d): %w", resp.StatusCode, err)
	}
	if len(b) <= MaxBufferedResponse {
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return nil
	}
	resp.Body = &keyedBody{r: io.MultiReader(bytes.NewReader(b), resp.Body), c: resp.Body, key: key, attempts: attempt}
	return nil
}

// keyedBody is a response body too large to buffer: a read error names
// the operation's key.
type keyedBody struct {
	r        io.Reader
	c        io.Closer
	key      string
	attempts int
}

func (b *keyedBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err != nil && err != io.EOF {
		err = fmt.Errorf("reading the response body: %w (the operation ran or may have: retry with the same key to get its saved answer)", err)
		if b.key != "" {
			err = &KeyError{Key: b.key, Attempts: b.attempts, Err: err}
		}
	}
	return n, err
}

func (b *keyedBody) Close() error { return b.c.Close() }

// retryable reports whether a response is one a retry with the same key
// may change (the package documentation lists them). Its body, read to
// tell, is put back.
func (t *Transport) retryable(resp *http.Response) bool {
	if Replayed(resp) {
		return false
	}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/problem+json") {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(b), resp.Body), resp.Body}
		var p struct{ Type string }
		if json.Unmarshal(b, &p) == nil && strings.HasPrefix(p.Type, idemhttp.ProblemTypePrefix) {
			switch problemKind(p.Type) {
			case idemhttp.KindConflict, idemhttp.KindRateLimited, idemhttp.KindUpstreamUnavailable, idemhttp.KindUnavailable, idemhttp.KindStoreFull:
				return true
			case idemhttp.KindFenced:
				// Through the proxy, another owner took the key over: the
				// retry gets its answer. Through the worker API, this
				// claim's handle is lost for good.
				return !t.keyless
			}
			return false
		}
	}
	// Not idem's own answer. Through idem's claim (it says its retention)
	// it is the upstream's, final; otherwise a gateway in front of idem
	// answered, and the key makes a resend safe.
	if resp.Header.Get(HeaderRetention) != "" {
		return false
	}
	switch resp.StatusCode {
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// backoff is "full jitter": a random wait below an exponentially growing
// cap (AWS Architecture Blog, "Exponential Backoff and Jitter").
func backoff(attempt int, base, maxDelay time.Duration) time.Duration {
	c := maxDelay
	if attempt < 30 && base<<attempt < maxDelay && base<<attempt > 0 {
		c = base << attempt
	}
	return time.Duration(rand.Int64N(int64(c)) + 1)
}

// retryAfter parses Retry-After: delta seconds or an HTTP date.
func retryAfter(v string) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if s, err := strconv.Atoi(v); err == nil && s >= 0 {
		return time.Duration(s) * time.Second, true
	}
	if at, err := http.ParseTime(v); err == nil {
		return max(time.Until(at), 0), true
	}
	return 0, false
}

func or[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// problemKind is the kind of an idem problem type ("urn:idem:problem:fenced"
// is "fenced").
func problemKind(typ string) string { return typ[strings.LastIndexAny(typ, ":/#")+1:] }
