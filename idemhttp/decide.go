package idemhttp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"

	"github.com/idem-dev/idem/etcdstore"
)

// answer is how one run of the handler ends: the claim's end and outcome,
// and what the client is told when that is not the outcome itself.
type answer struct {
	out     etcdstore.Outcome
	end     etcdstore.End
	problem *Problem // answered instead of out (a released or abandoned key)
	label   string   // the metrics outcome, when not claimed/takeover
	unknown string   // why the outcome is unknown, for the log
	abort   bool     // a streamed response was cut off: break the client's connection
	// live are the headers the handler's own answer is sent with to this
	// request's client: out's, and those never saved (Set-Cookie).
	live http.Header
}

// serveCatchingAbort runs next, and reports whether it aborted with
// http.ErrAbortHandler, which httputil.ReverseProxy raises when the
// upstream's body breaks off after its status was sent (or the client
// went away while a response streamed to it).
func serveCatchingAbort(next http.Handler, w http.ResponseWriter, r *http.Request) (aborted bool) {
	defer func() {
		if v := recover(); v != nil {
			if v != http.ErrAbortHandler { //nolint:errorlint // a sentinel panic value
				panic(v)
			}
			aborted = true
		}
	}()
	next.ServeHTTP(w, r)
	return false
}

// decide turns what the handler did into how its claim ends. The rule:
// an outcome that may have happened is treated as having happened; only a
// request that provably never reached the upstream is released.
func (m *Middleware) decide(rec *recorder, aborted bool) answer {
	switch {
	case rec.overflow:
		// The response went to the client as it streamed: it cannot be
		// replayed. Save that fact, so a retry does not run it again.
		detail := fmt.Sprintf("the request ran once, but its response was over the %d-byte limit and cannot be replayed; do not retry it with a new key", m.cfg.MaxResponseBody)
		if aborted {
			detail = fmt.Sprintf("the request ran once, but its response (over the %d-byte limit, streamed as it came) was cut off and cannot be replayed; the upstream may have acted: reconcile before using a new key", m.cfg.MaxResponseBody)
		}
		p := NewProblem(http.StatusInternalServerError, KindResponseNotSaved, detail)
		return answer{out: m.problemOutcome(p), end: etcdstore.EndSave, abort: aborted}
	case aborted:
		why := "the handler aborted before it answered"
		if rec.status != 0 {
			why = fmt.Sprintf("the upstream's response was cut off after its status (%d)", rec.status)
		}
		return m.unknownOutcome(http.StatusBadGateway, why)
	case rec.noResp != nil && neverSent(rec.noResp):
		p := NewProblem(http.StatusBadGateway, KindUpstreamUnavailable,
			"the request did not reach the upstream: "+rec.noResp.Error()+"; retry with the same key")
		return answer{end: etcdstore.EndRelease, problem: &p, label: labelUpstream}
	case rec.noResp != nil:
		status := http.StatusBadGateway
		if isTimeout(rec.noResp) {
			status = http.StatusGatewayTimeout
		}
		return m.unknownOutcome(status, "no response from the upstream after the request was sent: "+rec.noResp.Error())
	}
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	live := liveHeaders(rec.header)
	out := etcdstore.Outcome{Status: rec.status, Header: m.savedHeaders(live), Body: rec.body.Bytes()}
	return answer{out: out, live: live, end: m.cfg.OnStatus(rec.req, rec.status, rec.header)}
}

// unknownOutcome is the answer to a request whose upstream may have acted
// without a whole answer coming back: by default a saved problem saying so.
func (m *Middleware) unknownOutcome(status int, why string) answer {
	end := m.cfg.OnUnknownOutcome
	detail := why + "; the upstream may have acted: reconcile before using a new key (retrying this key replays this answer)"
	if end != etcdstore.EndSave {
		detail = why + "; the upstream may have acted; the key was not kept, so a retry with it reaches the upstream again"
	}
	p := NewProblem(status, KindUpstreamUnknown, detail)
	a := answer{out: m.problemOutcome(p), end: end, label: labelUpstreamUnknown, unknown: why}
	if end != etcdstore.EndSave {
		a.problem = &p
	}
	return a
}

// problemOutcome is p as an outcome to save.
func (m *Middleware) problemOutcome(p Problem) etcdstore.Outcome {
	h := map[string][]string{"Content-Type": {"application/problem+json"}}
	p.Docs = m.cfg.ProblemDocs
	if l := p.link(); l != "" {
		h["Link"] = []string{l}
	}
	return etcdstore.Outcome{Status: p.Status, Header: h, Body: p.Body()}
}

// neverSent reports whether err, from a proxy's transport, proves that the
// request never reached the upstream: the connection could not be made
// (refused, no route, a DNS failure, a dial timeout) or its TLS handshake
// failed. Every other error may come after the request was written.
func neverSent(err error) bool {
	var op *net.OpError
	var dns *net.DNSError
	var rh tls.RecordHeaderError
	var cv *tls.CertificateVerificationError
	switch {
	case errors.As(err, &op) && op.Op == "dial",
		errors.As(err, &dns), errors.As(err, &rh), errors.As(err, &cv):
		return true
	}
	return strings.Contains(err.Error(), "TLS handshake timeout") // net/http's unexported tlsHandshakeTimeoutError
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() ||
		strings.Contains(err.Error(), "timeout awaiting response headers")
}
