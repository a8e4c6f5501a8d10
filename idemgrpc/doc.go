// Package idemgrpc makes the unary calls of a gRPC service idempotent by
// key, on idem's etcd store, and gives clients one key per logical call.
//
// # Server
//
//	idem, err := idemgrpc.New(idemgrpc.Config{Store: store})
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, idem.Unary()), grpc.ChainStreamInterceptor(idem.Stream()))
//
// A call's key is its "idempotency-key" metadata, or its request's
// request_id field (AIP-155; Config.RequestIDField names another). The
// request is fingerprinted (the full method name and the message in
// protobuf's deterministic encoding), the key claimed, the handler run once,
// and its response message (as an Any) or its status saved and replayed to
// every retry, with "idempotent-replayed: true" in the response header.
// The handler's context carries the claim's fencing token
// (fencing.FromContext) and outgoing metadata "fencing" with it, so the
// services it calls with that context can refuse stale tokens
// (TokenFromIncoming, fencing.Checker). Once started, a handler runs to its
// end even if its caller goes away (its context is not cancelled with the
// call; its deadline is the caller's or Config.HandlerTimeout, whichever is
// later): cutting it short would turn an answer into an unknown outcome.
//
// How idem answers, and whether a client retries (AIP-194: retry
// UNAVAILABLE; ABORTED is a conflict to retry at a higher level, which for
// a call with an idempotency key is the same call with the same key):
//
//	in flight (the same key runs)   ABORTED + RetryInfo, ErrorInfo IDEMPOTENCY_KEY_IN_FLIGHT     retry, same key
//	key reused, other request       FAILED_PRECONDITION, ErrorInfo IDEMPOTENCY_KEY_REUSED        never retry; new key for a new operation
//	bad or missing key              INVALID_ARGUMENT, ErrorInfo IDEMPOTENCY_KEY_INVALID/_MISSING never retry
//	store unavailable, not saved    UNAVAILABLE + RetryInfo, ErrorInfo IDEMPOTENCY_STORE_UNAVAILABLE retry, same key
//	keyed streaming call            UNIMPLEMENTED                                               never retry
//	tenant refused                  PERMISSION_DENIED                                           never retry
//	answer too large to save        INTERNAL, ErrorInfo IDEMPOTENT_RESPONSE_NOT_SAVED           never retry: it ran
//
// A handler's own status is saved and replayed like a response
// (DefaultStatusPolicy), except one made by NotExecuted, by which a handler
// says it did nothing: that releases the key.
//
// Streaming calls are not claimed: a stream's messages cannot be saved and
// replayed as one answer. A streaming call with a key is refused; make the
// non-idempotent operation a unary call.
//
// # Client
//
// UnaryClientInterceptor gives each call one key for all its retries (the
// caller's, via WithKey, or a fresh one) and works with grpc-go's retry
// policy and go-grpc-middleware's retry interceptor (chained after it).
package idemgrpc
