// Package idemhttp is idem's HTTP edge: a net/http middleware that makes
// keyed requests idempotent, a reverse proxy built on it (idem as a
// sidecar), and a JSON API for workers in any language.
//
// The middleware (New, Wrap) claims a POST or PATCH request that carries an
// Idempotency-Key header, runs the wrapped handler once with the request's
// fencing token in the Idempotency-Fence header and its context, saves the
// response (status, headers except hop-by-hop ones, body) and replays it to
// every retry with Idempotent-Replayed: true. It answers for itself:
//
//	400  a missing (where required), malformed or repeated key; a bad tenant;
//	     a JSON body with no canonical form; a client-sent Idempotency-Fence
//	401  authentication is on and the request proves no identity
//	403  a tenant header from an untrusted source
//	409  the key is in flight (conflict, with Retry-After), unless the client
//	     sent "Prefer: wait=N", which waits on an etcd Watch instead; or the
//	     request's claim was taken over while it ran (fenced)
//	413  a request body over the limit
//	422  the key was first used with other parameters
//	500  the first response could not be saved (response-not-saved); any
//	     other failure (internal)
//	502  the request never reached the handler's upstream (released), or
//	     reached it and its answer was lost (saved: upstream-outcome-unknown)
//	503  etcd cannot be reached, or the response is not saved yet (with
//	     Retry-After)
//	504  the upstream did not answer in time (saved: upstream-outcome-unknown)
//
// Every error body is application/problem+json (RFC 9457) with a type of
// urn:idem:problem:<kind>. The fingerprint covers method, path, query, body
// (canonical JSON when the content type is JSON), its media type and chosen
// headers.
//
// What it guarantees, and what it does not, is etcdstore's: the handler runs
// at most once per key while a live claim exists, a response once saved is
// what every retry gets, and a handler whose claim was taken over cannot save
// its response (its client gets the saved one, or 409). A handler that was
// only slow when its claim was taken over may still have had its effect:
// pass the fencing token downstream. A response is sent only once it is
// saved; when etcd cannot save it, the client gets 503 and its retry gets
// the saved response.
package idemhttp
