package idemhttp

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/idem-dev/idem/etcdstore"
)

// StatusPolicy decides how a keyed request's claim ends once its handler
// answered with status (and header h): saved and replayed to every retry,
// released (the retry runs the handler again), or abandoned.
type StatusPolicy func(r *http.Request, status int, h http.Header) etcdstore.End

// DefaultStatusPolicy saves and replays every answer (Stripe's API v1
// saves even 500s: the handler may have acted before failing), except two
// that say the request was not processed and should be tried again later:
// 429 Too Many Requests, and 503 Service Unavailable with a Retry-After.
// Saving those would freeze "try later" for the whole retention: the
// client obeys Retry-After and gets the same saved 429 for a day. They are
// released, and the client gets the upstream's answer.
func DefaultStatusPolicy(_ *http.Request, status int, h http.Header) etcdstore.End {
	switch {
	case status == http.StatusTooManyRequests:
		return etcdstore.EndRelease
	case status == http.StatusServiceUnavailable && h.Get("Retry-After") != "":
		return etcdstore.EndRelease
	}
	return etcdstore.EndSave
}

// StatusRule is one rule of a status policy: answers whose status matches
// Status (a code such as "503", or a class such as "5xx"), and that carry
// Retry-After when RetryAfter is set, end as End.
type StatusRule struct {
	Status     string
	RetryAfter bool
	End        etcdstore.End
}

// ParseStatusRule reads a rule written STATUS[:retry-after]=END, where
// STATUS is a code (429) or a class (5xx) and END is save, release or
// abandon: "429=save", "503:retry-after=release", "5xx=release".
func ParseStatusRule(s string) (StatusRule, error) {
	match, end, ok := strings.Cut(s, "=")
	if !ok {
		return StatusRule{}, fmt.Errorf("status rule %q: want STATUS[:retry-after]=save|release|abandon", s)
	}
	var r StatusRule
	status, cond, hasCond := strings.Cut(match, ":")
	switch {
	case hasCond && cond == "retry-after":
		r.RetryAfter = true
	case hasCond:
		return StatusRule{}, fmt.Errorf("status rule %q: the only condition is retry-after", s)
	}
	if !validStatus(status) {
		return StatusRule{}, fmt.Errorf("status rule %q: %q is not a status (200-599) or a class (2xx-5xx)", s, status)
	}
	r.Status = strings.ToLower(status)
	switch end {
	case "save":
		r.End = etcdstore.EndSave
	case "release":
		r.End = etcdstore.EndRelease
	case "abandon":
		r.End = etcdstore.EndAbandon
	default:
		return StatusRule{}, fmt.Errorf("status rule %q: %q must be save, release or abandon", s, end)
	}
	return r, nil
}

func validStatus(s string) bool {
	if len(s) != 3 {
		return false
	}
	if strings.HasSuffix(strings.ToLower(s), "xx") {
		return s[0] >= '2' && s[0] <= '5'
	}
	n, err := strconv.Atoi(s)
	return err == nil && n >= 200 && n <= 599
}

func (r StatusRule) matches(status int, h http.Header) bool {
	code := strconv.Itoa(status)
	ok := r.Status == code || strings.HasSuffix(r.Status, "xx") && r.Status[0] == code[0]
	return ok && (!r.RetryAfter || h.Get("Retry-After") != "")
}

// Rules returns a policy that applies rules in order, the first that
// matches deciding, and then, when none does, next (DefaultStatusPolicy
// when nil).
func Rules(next StatusPolicy, rules ...StatusRule) StatusPolicy {
	if next == nil {
		next = DefaultStatusPolicy
	}
	return func(r *http.Request, status int, h http.Header) etcdstore.End {
		for _, rule := range rules {
			if rule.matches(status, h) {
				return rule.End
			}
		}
		return next(r, status, h)
	}
}
