package idemhttp

import (
	"bytes"
	"net/http"
)

// recorder captures a handler's response so it can be saved before it is
// sent. Past limit bytes of body it gives up capturing and streams the
// response to the client instead (overflow): such a response cannot be
// replayed.
type recorder struct {
	w      http.ResponseWriter
	req    *http.Request // the request as the handler got it
	header http.Header
	status int
	body   bytes.Buffer
	limit  int

	overflow bool  // streaming to w: nothing more is captured
	noResp   error // the handler reported that no response exists (NoResponse)
}

func newRecorder(w http.ResponseWriter, limit int) *recorder {
	return &recorder{w: w, header: make(http.Header), limit: limit}
}

func (r *recorder) Header() http.Header {
	if r.overflow {
		return r.w.Header()
	}
	return r.header
}

func (r *recorder) WriteHeader(status int) {
	if r.status != 0 || status < 200 && status != http.StatusSwitchingProtocols {
		return // informational responses are not captured; repeats are ignored
	}
	r.status = status
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	if r.overflow {
		return r.w.Write(p)
	}
	if r.body.Len()+len(p) <= r.limit {
		return r.body.Write(p)
	}
	// Too large to save: send what we have and stream the rest.
	r.overflow = true
	dst := r.w.Header()
	for k, vs := range r.header {
		dst[k] = vs
	}
	r.w.WriteHeader(r.status)
	if _, err := r.w.Write(r.body.Bytes()); err != nil {
		return 0, err
	}
	r.body.Reset()
	return r.w.Write(p)
}

// Flush is a no-op while capturing (the response is sent whole once saved)
// and flushes while streaming an overflow.
func (r *recorder) Flush() {
	if f, ok := r.w.(http.Flusher); ok && r.overflow {
		f.Flush()
	}
}

// NoResponse tells idem's middleware that the handler has no response to
// save, because err stopped it from getting one (a proxy whose upstream
// could not be reached, broke the connection, or timed out). The middleware
// answers itself: when err proves the request never reached the upstream
// (a refused connection, a DNS failure) it releases the claim and answers
// 502; otherwise the upstream may have acted, and it ends the claim as
// Config.OnUnknownOutcome says (by default it saves a 502 or 504 problem).
// It returns false when w is not the middleware's, and the handler must
// answer.
func NoResponse(w http.ResponseWriter, err error) bool {
	r, ok := w.(*recorder)
	if !ok || r.status != 0 {
		return false
	}
	r.noResp = err
	return true
}
