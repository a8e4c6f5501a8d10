package idemgrpc

import (
	"context"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

type keyCtx struct{}

// WithKey returns a context whose calls carry key as their idempotency
// key, for an operation the caller names itself (an order id it
// persisted). Every call made with the context (or one derived from it)
// carries it: use the context for the one logical operation, and its
// retries, only.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// NewKey returns a fresh key (a random UUID).
func NewKey() string { return uuid.NewString() }

// Replayed reports whether a call's response header (grpc.Header) says the
// response was replayed from an earlier call with the same key.
func Replayed(header metadata.MD) bool {
	v := header.Get(MetadataReplayed)
	return len(v) > 0 && v[0] == "true"
}

// ClientOption configures UnaryClientInterceptor.
type ClientOption func(*clientConfig)

type clientConfig struct {
	methods func(string) bool
	field   protoreflect.Name
}

// ForMethods limits the interceptor to the methods for which keep returns
// true (default: every unary method).
func ForMethods(keep func(fullMethod string) bool) ClientOption {
	return func(c *clientConfig) { c.methods = keep }
}

// RequestIDField names the request field that carries the key (AIP-155;
// default "request_id", "-": never use a field). When the request has the
// field, a key goes there: an empty field is set (in a copy of the request)
// to the call's key, as AIP-155 asks client libraries to do, and a set one
// is left as it is.
func RequestIDField(name protoreflect.Name) ClientOption {
	return func(c *clientConfig) { c.field = name }
}

// UnaryClientInterceptor gives every unary call one idempotency key for
// all of its retries: the one WithKey put in the context, or the request's
// request_id field, or a fresh one; sent as "idempotency-key" metadata, and
// in the request_id field of a copy of the request when that field is empty
// (the caller's message is never changed). A call that already carries the
// metadata is left alone.
//
// It must run once per logical call, outside any retrying: grpc-go's own
// retry policy (service config) runs under every interceptor and resends
// the same metadata, so any position works with it; go-grpc-middleware's
// retry interceptor re-runs the interceptors chained after it on each
// attempt, so put this one before it:
//
//	grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(), retry.UnaryClientInterceptor(...))
//
// Retry UNAVAILABLE and ABORTED (a call with the same key in flight).
func UnaryClientInterceptor(opts ...ClientOption) grpc.UnaryClientInterceptor {
	cfg := clientConfig{field: "request_id"}
	for _, o := range opts {
		o(&cfg)
	}
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if cfg.methods != nil && !cfg.methods(method) {
			return invoker(ctx, method, req, reply, cc, callOpts...)
		}
		if md, _ := metadata.FromOutgoingContext(ctx); len(md.Get(MetadataKey)) > 0 {
			return invoker(ctx, method, req, reply, cc, callOpts...)
		}
		key, _ := ctx.Value(keyCtx{}).(string)
		if msg, ok := req.(proto.Message); ok {
			if f := requestIDField(msg, cfg.field); f != nil {
				// The key goes in the field and in the metadata both, so
				// that a server reading either finds it. The field is set
				// on a copy: the caller's message is never changed (it may
				// be reused for the next operation, which needs its own
				// key).
				switch cur := msg.ProtoReflect().Get(f).String(); {
				case cur != "" && key == "":
					key = cur
				case cur == "":
					if key == "" {
						key = NewKey()
					}
					c := proto.Clone(msg)
					c.ProtoReflect().Set(f, protoreflect.ValueOfString(key))
					req = c
				}
				// A field set to another key than WithKey's: both are sent,
				// and the server refuses the contradiction.
			}
		}
		if key == "" {
			key = NewKey()
		}
		return invoker(metadata.AppendToOutgoingContext(ctx, MetadataKey, key), method, req, reply, cc, callOpts...)
	}
}
