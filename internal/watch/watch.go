// Package watch receives etcd watch responses through a clock.Clock. A
// watch's channel is read by a goroutine that only moves what arrives into
// a queue; the reader waits for the queue through the clock, as every wait
// in idem does, so that a simulated clock resumes the reader when (and
// only when) a response is there.
package watch

import (
	"context"
	"sync"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
)

// Stream merges the responses of one or more watches.
type Stream struct {
	clk clock.Clock

	mu      sync.Mutex
	watches int
	q       []Response
	ready   chan struct{} // closed while q is not empty
}

// Response is one response of one of a Stream's watches.
type Response struct {
	// Watch is the index Add returned for the watch.
	Watch int
	clientv3.WatchResponse
	// Closed is set, with no response, when the watch's channel closed
	// (its context ended, or the client closed).
	Closed bool
}

// New returns an empty Stream that waits through clk.
func New(clk clock.Clock) *Stream {
	return &Stream{clk: clk, ready: make(chan struct{})}
}

// Add starts reading wch, and returns the index its responses carry. The
// watch ends with its own context.
func (s *Stream) Add(wch clientv3.WatchChan) int {
	s.mu.Lock()
	n := s.watches
	s.watches++
	s.mu.Unlock()
	go func() {
		for wr := range wch {
			if empty(wr) {
				continue
			}
			s.push(Response{Watch: n, WatchResponse: wr})
		}
		s.push(Response{Watch: n, Closed: true})
	}()
	return n
}

// empty reports whether wr carries nothing at all, not even a revision:
// etcd never sends such a response (a progress notification has one).
func empty(wr clientv3.WatchResponse) bool {
	return wr.Header.GetRevision() == 0 && len(wr.Events) == 0 && !wr.Canceled && !wr.Created && wr.CompactRevision == 0 && wr.Err() == nil
}

func (s *Stream) push(r Response) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.q) == 0 {
		close(s.ready)
	}
	s.q = append(s.q, r)
}

// Interrupt makes the next Next return a response of no watch (Watch -1)
// that says Closed: for a reader that gives its watches up (it cancels
// their context) and must learn it at once, not once their channels close.
func (s *Stream) Interrupt() { s.push(Response{Watch: -1, Closed: true}) }

// Next returns the oldest response not returned yet, waiting through the
// clock for one, or ctx's cause when ctx ends first.
func (s *Stream) Next(ctx context.Context) (Response, error) {
	for {
		s.mu.Lock()
		if len(s.q) > 0 {
			r := s.q[0]
			s.q[0] = Response{}
			s.q = s.q[1:]
			if len(s.q) == 0 {
				s.ready = make(chan struct{})
			}
			s.mu.Unlock()
			return r, nil
		}
		ready := s.ready
		s.mu.Unlock()
		if err := s.clk.Wait(ctx, ready); err != nil {
			return Response{}, err
		}
	}
}
