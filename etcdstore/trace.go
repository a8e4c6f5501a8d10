package etcdstore

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

const tracerName = "github.com/idem-dev/idem/etcdstore"

// Span attributes (see WithTracerProvider).
const (
	AttrTenant    = attribute.Key("idem.tenant")
	AttrKey       = attribute.Key("idem.key")
	AttrKeyDigest = attribute.Key("idem.key.digest")
	AttrOutcome   = attribute.Key("idem.outcome")
	AttrToken     = attribute.Key("idem.fencing_token")
	AttrTakeovers = attribute.Key("idem.takeovers")
)

// startSpan starts a span for key, or returns a nil span when the store
// has no tracer: callers check nothing, the end functions do.
func (s *Store) startSpan(ctx context.Context, name string, key Key) (context.Context, trace.Span) {
	if s.tracer == nil {
		return ctx, nil
	}
	k := AttrKeyDigest.String(key.Digest())
	if s.traceKeys {
		k = AttrKey.String(key.ID)
	}
	return s.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(AttrTenant.String(key.Tenant), k))
}

// endClaimSpan names and ends a claim's span by what the claim found.
func (s *Store) endClaimSpan(sp trace.Span, key Key, c *Claim, done *Record, err error) {
	if sp == nil {
		return
	}
	var ce *ConflictError
	switch {
	case done != nil:
		sp.SetName("idem.replay")
		sp.SetAttributes(AttrOutcome.String("replayed"), AttrToken.Int64(int64(done.Token)), AttrTakeovers.Int(done.Takeovers))
	case c != nil && c.TookOver():
		sp.SetName("idem.takeover")
		sp.SetAttributes(AttrOutcome.String("takeover"), AttrToken.Int64(int64(c.Token())), AttrTakeovers.Int(c.Takeovers()))
	case c != nil:
		sp.SetAttributes(AttrOutcome.String("claimed"), AttrToken.Int64(int64(c.Token())), AttrTakeovers.Int(c.Takeovers()))
	case errors.As(err, &ce):
		sp.SetAttributes(AttrOutcome.String("conflict"), AttrToken.Int64(int64(ce.Token)))
	case errors.Is(err, ErrMismatch):
		sp.SetAttributes(AttrOutcome.String("mismatch"))
	default:
		s.endSpanErr(sp, err, key)
		return
	}
	sp.End()
}

// endWriteSpan ends the span of a claim's write.
func (s *Store) endWriteSpan(sp trace.Span, c *Claim, err error) {
	if sp == nil {
		return
	}
	sp.SetAttributes(AttrToken.Int64(int64(c.token)), AttrTakeovers.Int(c.takeovers))
	switch {
	case err == nil:
		sp.SetAttributes(AttrOutcome.String("written"))
	case errors.Is(err, ErrFenced), errors.Is(err, ErrClaimEnded):
		sp.SetAttributes(AttrOutcome.String("fenced"))
	default:
		s.endSpanErr(sp, err, c.key)
		return
	}
	sp.End()
}

// endSpanErr ends a span with an error. Errors name their key, which the
// span records as its digest unless the store traces keys.
func (s *Store) endSpanErr(sp trace.Span, err error, key Key) {
	outcome := "error"
	if errors.Is(err, ErrUnavailable) {
		outcome = "unavailable"
	}
	sp.SetAttributes(AttrOutcome.String(outcome))
	msg := err.Error()
	if !s.traceKeys {
		msg = key.redact(err)
	}
	sp.AddEvent("exception", trace.WithAttributes(attribute.String("exception.message", msg)))
	sp.SetStatus(codes.Error, msg)
	sp.End()
}
