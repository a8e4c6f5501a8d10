package main

import (
	"bytes"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// collector is an OTLP/HTTP trace receiver: the spans idem exports.
type collector struct {
	*httptest.Server
	mu    sync.Mutex
	spans []*tracepb.Span
	res   []string // service.name of each batch
	got   chan struct{}
}

func newCollector(t *testing.T) *collector {
	c := &collector{got: make(chan struct{}, 1000)}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if r.URL.Path != "/v1/traces" || proto.Unmarshal(body, &req) != nil {
			http.Error(w, "bad export", http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		for _, rs := range req.ResourceSpans {
			for _, a := range rs.GetResource().GetAttributes() {
				if a.Key == "service.name" {
					c.res = append(c.res, a.Value.GetStringValue())
				}
			}
			for _, ss := range rs.ScopeSpans {
				c.spans = append(c.spans, ss.Spans...)
			}
		}
		c.mu.Unlock()
		c.got <- struct{}{}
		w.Header().Set("Content-Type", "application/x-protobuf")
		b, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Write(b)
	}))
	t.Cleanup(c.Close)
	return c
}

// waitFor waits for exports until have says the spans are all there.
func (c *collector) waitFor(t *testing.T, have func([]*tracepb.Span) bool) []*tracepb.Span {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		c.mu.Lock()
		spans := append([]*tracepb.Span(nil), c.spans...)
		c.mu.Unlock()
		if have(spans) {
			return spans
		}
		select {
		case <-c.got:
		case <-timeout:
			var names []string
			for _, s := range spans {
				names = append(names, s.Name)
			}
			t.Fatalf("the spans exported within 30 s: %v", names)
		}
	}
}

// idem serve with OTEL_EXPORTER_OTLP_ENDPOINT set exports its spans over
// OTLP: a server span that continues the caller's trace, idem's claim,
// complete and replay spans under it, the upstream call (whose traceparent
// continues the trace) and the etcd client's calls. Keys appear as a
// digest only.
func TestTracingExportsOTLP(t *testing.T) {
	col := newCollector(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.URL)
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	t.Setenv("OTEL_SERVICE_NAME", "idem-under-test")
	var mu sync.Mutex
	var upstreamParents []string
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		upstreamParents = append(upstreamParents, r.Header.Get("Traceparent"))
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"charged":true}`)
	}))
	t.Cleanup(up.Close)
	dir := tempDir(t)
	idem := startIdem(t, dir, append(embeddedFlags(t, filepath.Join(dir, "data")), "--upstream", up.URL)...)

	const traceID, callerSpan, key = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "order-secret-7"
	for range 2 {
		req, _ := http.NewRequest("POST", idem.listen+"/charges", strings.NewReader(`{"amount":1}`))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Traceparent", "00-"+traceID+"-"+callerSpan+"-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	mu.Lock()
	if len(upstreamParents) != 1 || !strings.HasPrefix(upstreamParents[0], "00-"+traceID+"-") || strings.Contains(upstreamParents[0], callerSpan) {
		t.Fatalf("the upstream got traceparent %q: want the caller's trace, with idem's span as parent", upstreamParents)
	}
	mu.Unlock()

	hexID := func(b []byte) string { return hex.EncodeToString(b) }
	spans := col.waitFor(t, func(spans []*tracepb.Span) bool {
		n := map[string]int{}
		servers := 0
		for _, s := range spans {
			n[s.Name]++
			if s.Kind == tracepb.Span_SPAN_KIND_SERVER && hex.EncodeToString(s.TraceId) == traceID {
				servers++
			}
		}
		// The server span of the replay ends after its response is
		// written, and may be exported after the replay's own span.
		return n["idem.claim"] == 1 && n["idem.complete"] == 1 && n["idem.replay"] == 1 && servers >= 2
	})
	var servers []*tracepb.Span
	byID := map[string]*tracepb.Span{}
	etcdCalls, upstreamCalls := 0, 0
	for _, s := range spans {
		byID[hexID(s.SpanId)] = s
		if bytes.Contains([]byte(s.String()), []byte(key)) {
			t.Errorf("span %s carries the raw key", s.Name)
		}
		switch {
		case s.Kind == tracepb.Span_SPAN_KIND_SERVER && hexID(s.TraceId) == traceID:
			servers = append(servers, s)
		case s.Kind == tracepb.Span_SPAN_KIND_CLIENT && strings.HasPrefix(s.Name, "etcdserverpb."):
			etcdCalls++
		case s.Kind == tracepb.Span_SPAN_KIND_CLIENT && hexID(s.TraceId) == traceID:
			upstreamCalls++
			if "00-"+traceID+"-"+hexID(s.SpanId)+"-01" != upstreamParents[0] {
				t.Errorf("the upstream's traceparent %s is not the client span %s", upstreamParents[0], hexID(s.SpanId))
			}
		}
	}
	if len(servers) != 2 || upstreamCalls != 1 || etcdCalls == 0 {
		t.Fatalf("%d server spans in the caller's trace (want 2), %d upstream calls (want 1), %d etcd calls (want some)", len(servers), upstreamCalls, etcdCalls)
	}
	for _, s := range servers {
		if hexID(s.ParentSpanId) != callerSpan {
			t.Errorf("server span %s: parent %s, want the caller's %s", s.Name, hexID(s.ParentSpanId), callerSpan)
		}
	}
	for _, s := range spans {
		if !strings.HasPrefix(s.Name, "idem.") {
			continue
		}
		p := byID[hexID(s.ParentSpanId)]
		if p == nil || p.Kind != tracepb.Span_SPAN_KIND_SERVER || hexID(s.TraceId) != traceID {
			t.Errorf("%s is not a child of a request's server span", s.Name)
		}
		if !strings.Contains(s.String(), "idem.outcome") || !strings.Contains(s.String(), "idem.fencing_token") || !strings.Contains(s.String(), "idem.key.digest") {
			t.Errorf("%s lacks idem's attributes: %v", s.Name, s.Attributes)
		}
	}
	col.mu.Lock()
	defer col.mu.Unlock()
	if len(col.res) == 0 || col.res[0] != "idem-under-test" {
		t.Errorf("service.name %v, want OTEL_SERVICE_NAME's", col.res)
	}
}
