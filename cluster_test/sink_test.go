package cluster_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/idem-dev/idem/fencing"
)

// sink is the downstream "payment provider" the work calls. It charges once
// per order (a charge carries the caller's own key, charge:<order>, and a
// repeated key gets the first charge back), and captures with a fenced write
// that refuses a token lower than the highest seen for the order.
type sink struct {
	*httptest.Server
	mu       sync.Mutex
	charges  map[string]string // order -> charge id
	effects  map[string]int    // order -> charges made (must stay <= 1)
	captured map[string]fencing.Token
	fence    fencing.Checker
	stale    int // captures refused as stale
	calls    int
	dedupe   bool // false: a non-idempotent provider that charges per call (the lab)
}

func newSink(t testing.TB, dedupe bool) *sink {
	s := &sink{charges: map[string]string{}, effects: map[string]int{}, captured: map[string]fencing.Token{}, dedupe: dedupe}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charge/{order}", s.charge)
	mux.HandleFunc("POST /capture/{order}", s.capture)
	s.Server = httptest.NewServer(mux)
	t.Cleanup(s.Close)
	return s
}

func (s *sink) charge(w http.ResponseWriter, r *http.Request) {
	order := r.PathValue("order")
	tok, _, _ := fencing.FromHeader(r.Header)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if tok > 0 {
		if err := s.fence.Check(order, tok); err != nil {
			s.stale++
			http.Error(w, err.Error(), http.StatusConflict)
			return
		}
	}
	id, ok := s.charges[order]
	if !ok || !s.dedupe {
		s.effects[order]++
		id = fmt.Sprintf("ch_%s_%d", order, s.effects[order])
		s.charges[order] = id
	}
	json.NewEncoder(w).Encode(map[string]string{"charge": id})
}

func (s *sink) capture(w http.ResponseWriter, r *http.Request) {
	order := r.PathValue("order")
	tok, _, err := fencing.FromHeader(r.Header)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if err != nil || tok == 0 {
		http.Error(w, "capture needs a fencing token", http.StatusBadRequest)
		return
	}
	if err := s.fence.Check(order, tok); err != nil {
		s.stale++
		http.Error(w, err.Error(), http.StatusConflict)
		return
	}
	s.captured[order] = tok
	w.WriteHeader(http.StatusNoContent)
}

// errStale is what the work sees when the sink refused its token.
var errStale = errors.New("sink: stale fencing token")

// snapshot returns the sink's counters.
func (s *sink) snapshot() (effects map[string]int, stale int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	effects = make(map[string]int, len(s.effects))
	for k, v := range s.effects {
		effects[k] = v
	}
	return effects, s.stale
}
