package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// tracingEnabled reports whether the standard OpenTelemetry environment
// asks for traces to be exported: an OTLP endpoint is set (or
// OTEL_TRACES_EXPORTER=otlp), and neither OTEL_SDK_DISABLED=true nor
// OTEL_TRACES_EXPORTER=none says otherwise. Without it, idem runs no
// tracing code: no spans are started, no headers parsed.
func tracingEnabled() bool {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	switch exp := os.Getenv("OTEL_TRACES_EXPORTER"); exp {
	case "none":
		return false
	case "otlp":
		return true
	case "":
	default:
		return true // setupTracing refuses what it cannot export to, rather than export nothing silently
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// setupTracing builds the tracer provider that exports idem's spans over
// OTLP, configured by the standard variables (OTEL_EXPORTER_OTLP_*,
// OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER,
// OTEL_BSP_*), and installs W3C trace context and baggage as the
// propagators. It returns nil when tracing is not enabled.
func setupTracing(ctx context.Context) (*sdktrace.TracerProvider, error) {
	if !tracingEnabled() {
		return nil, nil
	}
	if exp := os.Getenv("OTEL_TRACES_EXPORTER"); exp != "" && exp != "otlp" && exp != "none" {
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER=%s: idem exports traces over OTLP only (otlp or none)", exp)
	}
	protocol := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	var exp sdktrace.SpanExporter
	var err error
	switch protocol {
	case "", "http/protobuf":
		exp, err = otlptracehttp.New(ctx)
	case "grpc":
		exp, err = otlptracegrpc.New(ctx)
	default:
		return nil, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%s: want http/protobuf or grpc", protocol)
	}
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", "idem"), attribute.String("service.version", version())),
		resource.WithFromEnv(), resource.WithTelemetrySDK(), resource.WithHost())
	if err != nil {
		return nil, fmt.Errorf("OpenTelemetry resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp, nil
}
