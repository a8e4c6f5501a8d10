package idemhttp

import (
	"github.com/prometheus/client_golang/prometheus"
)

// The values of the "outcome" label of the edge's metrics: what happened to
// a request. docs/CLI.md lists them.
const (
	labelClaimed         = "claimed"          // a new key: the handler ran
	labelTakeover        = "takeover"         // a stale claim was taken over: the handler ran
	labelReplayed        = "replayed"         // a saved response was replayed
	labelConflict        = "conflict"         // 409: in flight elsewhere
	labelMismatch        = "mismatch"         // 422
	labelFenced          = "fenced"           // the handler ran but its claim was taken over
	labelInvalid         = "invalid"          // 400/403/413 before any claim
	labelUnavailable     = "unavailable"      // 503: etcd unreachable
	labelStoreFull       = "store_full"       // 503: etcd out of space (NOSPACE)
	labelRateLimited     = "rate_limited"     // 429: over the tenant's limits
	labelUpstream        = "upstream_err"     // 502: the request never reached the upstream (released)
	labelUpstreamUnknown = "upstream_unknown" // 502/504: the upstream may have acted; its answer was lost
	labelPassthrough     = "passthrough"      // no key, or a method that is not claimed
	labelError           = "error"            // anything else
)

// Metrics are the edge's Prometheus metrics. Labels never include keys,
// tenants or paths: their cardinality is unbounded.
type Metrics struct {
	Requests *prometheus.CounterVec
	Duration *prometheus.HistogramVec
	Waits    prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg (none when reg
// is nil).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_requests_total",
			Help: "Requests at the idempotency edge, by outcome.",
		}, []string{"outcome"}),
		Duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_request_duration_seconds",
			Help:    "Time to answer a request at the idempotency edge, by outcome (including the handler or upstream).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"outcome"}),
		Waits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_waits_total",
			Help: "Requests that waited (Prefer: wait) for an in-flight key.",
		}),
	}
	// Every outcome's series exists from the start, at 0: an alert on
	// increase() sees the first rare event (a mismatch, a fenced request)
	// only if the series was there before it.
	for _, o := range []string{labelClaimed, labelTakeover, labelReplayed, labelConflict, labelMismatch, labelFenced,
		labelInvalid, labelUnavailable, labelStoreFull, labelRateLimited, labelUpstream, labelUpstreamUnknown, labelPassthrough, labelError} {
		m.Requests.WithLabelValues(o)
	}
	if reg != nil {
		reg.MustRegister(m.Requests, m.Duration, m.Waits)
	}
	return m
}

// labelOf is the metrics label of a request answered with problem p.
func labelOf(p Problem) string {
	switch p.Type {
	case ProblemTypePrefix + KindConflict:
		return labelConflict
	case ProblemTypePrefix + KindMismatch:
		return labelMismatch
	case ProblemTypePrefix + KindFenced:
		return labelFenced
	case ProblemTypePrefix + KindUnavailable:
		return labelUnavailable
	case ProblemTypePrefix + KindStoreFull:
		return labelStoreFull
	case ProblemTypePrefix + KindRateLimited:
		return labelRateLimited
	}
	if p.Status < 500 {
		return labelInvalid
	}
	return labelError
}
