package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
)

// Metadata keys (gRPC metadata keys are lower case).
const (
	// MetadataKey carries the idempotency key of a call.
	MetadataKey = "idempotency-key"
	// MetadataFencing carries the fencing token of the claim a call runs
	// under, to the services the handler calls (outgoing metadata).
	MetadataFencing = "fencing"
	// MetadataReplayed is set to "true" in the response header of every
	// replayed call, a replayed error status included. A response header
	// commits a call in grpc-go, so its retry policy never resends a
	// replay (nor a handler's saved status: idem sends headers with it).
	MetadataReplayed = "idempotent-replayed"
	// MetadataRetention is set in every keyed call's response trailer
	// (not its header: a refusal must stay a trailers-only response, the
	// only kind grpc-go's retry policy retries): the seconds a key is
	// kept, inside which a client must stop retrying.
	MetadataRetention = "idempotency-retention"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo details idem sets.
const ErrorDomain = "idem.dev"

// ErrorInfo reasons, in the details of the statuses idem answers with.
const (
	ReasonInFlight         = "IDEMPOTENCY_KEY_IN_FLIGHT"
	ReasonKeyReused        = "IDEMPOTENCY_KEY_REUSED"
	ReasonInvalidKey       = "IDEMPOTENCY_KEY_INVALID"
	ReasonMissingKey       = "IDEMPOTENCY_KEY_MISSING"
	ReasonStoreUnavailable = "IDEMPOTENCY_STORE_UNAVAILABLE"
	ReasonNotSaved         = "IDEMPOTENT_RESPONSE_NOT_SAVED"
	// ReasonOutcomeUnknown marks the status saved by a takeover of an
	// attempt that may have run (Config.OnUnknownOutcome): the handler was
	// not called again.
	ReasonOutcomeUnknown = "IDEMPOTENT_OUTCOME_UNKNOWN"
	// ReasonNotExecuted marks a status by which a handler says it did
	// nothing: the key is released and a retry runs the handler again
	// (NotExecuted makes one).
	ReasonNotExecuted = "NOT_EXECUTED"
)

// Store is what the interceptor needs of idem's store: a part of the store
// contract (idem.Store), which *etcdstore.Store and *shard.Store keep.
type Store interface {
	Run(ctx context.Context, key etcdstore.Key, fp etcdstore.Fingerprint, work etcdstore.RunWork, opts ...etcdstore.RunOption) (etcdstore.Result, error)
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	Retention() time.Duration
	MaxRecordSize() int
}

var _ Store = idem.Store(nil) // the edge needs nothing beyond the contract

// Config configures the server interceptors. Store is required.
type Config struct {
	Store Store

	// Methods reports whether calls of a full method name
	// ("/pkg.Service/Method") are claimed when they carry a key (default:
	// every unary method). Others pass through untouched.
	Methods func(fullMethod string) bool
	// RequireKey reports whether a claimed method must carry a key; a call
	// without one gets InvalidArgument. Nil: never required.
	RequireKey func(fullMethod string) bool
	// RequestIDField names the request message's field that carries the
	// key (AIP-155), used when the metadata has no idempotency-key (default
	// "request_id"; "-": metadata only). A call with both must send the
	// same value in both.
	RequestIDField protoreflect.Name
	// Tenant scopes keys (default: FixedTenant(etcdstore.DefaultTenant),
	// one tenant for every caller: two callers that send the same key and
	// request share one outcome). A multi-tenant service gives each caller
	// its own: CertTenant (mTLS), BearerTenant (tokens), chained to
	// Unauthenticated. An error refuses the call: UNAUTHENTICATED for
	// ErrUnauthenticated, PERMISSION_DENIED otherwise. It is asked only for
	// the calls idem claims (keyed): calls without a key pass through, so
	// authenticate every call with an interceptor of your own before idem's.
	Tenant TenantFunc
	// OnUnknownOutcome says what a takeover does when the attempt it
	// replaces was cut short after its handler may have run (its process
	// was killed, or lost its session or its deadline). EndSave, the
	// default: the handler is not called; an UNKNOWN status saying so is
	// saved and answered to every retry (reconcile, then use a new key).
	// EndRelease or EndAbandon: the handler runs again, with a greater
	// fencing token, for handlers that are idempotent downstream.
	OnUnknownOutcome etcdstore.End
	// OnStatus decides from a handler's status how its claim ends (default
	// DefaultStatusPolicy).
	OnStatus func(*status.Status) etcdstore.End
	// ClaimDeadline, when set, gives every claim a deadline
	// (etcdstore.WithDeadline): past it another call may take the key over
	// and run the handler again. It must exceed HandlerTimeout (New
	// refuses it otherwise). Whether or not it is set, a handler's context
	// ends a fifth of the time left before its claim stops being held (the
	// deadline, or the in-flight record's expiry a retention on),
	// whatever the caller's deadline (etcdstore.Claim.BeforeEnd), leaving
	// that time to save its answer: a handler that honours its context
	// has returned before its claim can be taken over.
	ClaimDeadline time.Duration
	// HandlerTimeout bounds a handler's run (default 30 s): its context
	// ends then, as the caller's deadline would have ended it (the later
	// of the two, unless ClaimDeadline is set), but not sooner, even if
	// the caller goes away. A handler that ignores its context holds its
	// key until it returns; ClaimDeadline bounds that, and then the
	// handler can run twice (the fencing token tells its writes apart).
	HandlerTimeout time.Duration
	// Logger gets a line per refused or unsaved call (default: none). Keys
	// are logged as a digest.
	Logger *slog.Logger
}

// DefaultStatusPolicy saves every status a handler returns (replayed to
// every retry), because a handler that failed may have acted first, except
// one made by NotExecuted: with it a handler says it did nothing, so the
// key is released and a retry runs the handler again. Codes alone do not
// say it: an UNAVAILABLE or RESOURCE_EXHAUSTED a handler passes on from a
// service it called may come after that service acted.
func DefaultStatusPolicy(st *status.Status) etcdstore.End {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.Domain == ErrorDomain && ei.Reason == ReasonNotExecuted {
			return etcdstore.EndRelease
		}
	}
	return etcdstore.EndSave
}

// NotExecuted returns a status error by which a handler says that it did
// nothing (it refused before any effect: rate-limited, a dependency down
// before the first write): the claim is released, and a retry with the same
// key runs the handler again. Never return it after an effect.
func NotExecuted(c codes.Code, msg string, retryAfter time.Duration) error {
	details := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: ReasonNotExecuted, Domain: ErrorDomain}}
	if retryAfter > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
	}
	st, err := status.New(c, msg).WithDetails(details...)
	if err != nil {
		return status.Error(c, msg)
	}
	return st.Err()
}

// Interceptor makes the unary calls of a gRPC server idempotent by key.
type Interceptor struct {
	cfg Config
}

// New validates cfg and returns an Interceptor.
func New(cfg Config) (*Interceptor, error) {
	if cfg.Store == nil {
		return nil, fmt.Errorf("idemgrpc: %w: Config.Store is required", etcdstore.ErrInvalidArgument)
	}
	if cfg.RequestIDField == "" {
		cfg.RequestIDField = "request_id"
	}
	if cfg.RequestIDField != "-" && !cfg.RequestIDField.IsValid() {
		return nil, fmt.Errorf("idemgrpc: %w: RequestIDField %q is not a protobuf field name", etcdstore.ErrInvalidArgument, cfg.RequestIDField)
	}
	if cfg.Tenant == nil {
		cfg.Tenant = func(context.Context, string) (string, error) { return etcdstore.DefaultTenant, nil }
	}
	if cfg.OnStatus == nil {
		cfg.OnStatus = DefaultStatusPolicy
	}
	if cfg.HandlerTimeout == 0 {
		cfg.HandlerTimeout = 30 * time.Second
	}
	if cfg.HandlerTimeout < 0 {
		return nil, fmt.Errorf("idemgrpc: %w: HandlerTimeout %v is negative", etcdstore.ErrInvalidArgument, cfg.HandlerTimeout)
	}
	if cfg.ClaimDeadline < 0 {
		return nil, fmt.Errorf("idemgrpc: %w: ClaimDeadline %v is negative", etcdstore.ErrInvalidArgument, cfg.ClaimDeadline)
	}
	if cfg.ClaimDeadline > 0 && cfg.ClaimDeadline-cfg.ClaimDeadline/5 < cfg.HandlerTimeout {
		// A claim past its deadline is taken over by the next retry while
		// its handler may still run: two runs of one operation.
		return nil, fmt.Errorf("idemgrpc: %w: ClaimDeadline %v leaves a handler less than its HandlerTimeout %v (a handler gets ClaimDeadline less a fifth, %v, to answer): a retry could take the key over while the handler still runs; raise ClaimDeadline above %v or lower HandlerTimeout",
			etcdstore.ErrInvalidArgument, cfg.ClaimDeadline, cfg.HandlerTimeout, cfg.ClaimDeadline-cfg.ClaimDeadline/5, cfg.HandlerTimeout*5/4)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Interceptor{cfg: cfg}, nil
}

// Unary returns the unary server interceptor. Chain it after
// authentication (the tenant comes from the caller's identity) and before
// the handler's own interceptors: it runs the rest of the chain once per key.
func (i *Interceptor) Unary() grpc.UnaryServerInterceptor {
	return i.unary
}

// Stream returns the stream server interceptor: a streaming call that
// carries an idempotency key, in its metadata or in the request_id field
// (RequestIDField) of any message it sends, is refused with UNIMPLEMENTED
// (a stream's messages cannot be saved and replayed as one answer: make
// the non-idempotent part a unary call); one without a key passes through.
// A key in a message is found when the handler receives that message: a
// server-streaming handler receives its request before it runs, so it is
// refused before it acts; a client- or bidi-streaming handler is told by
// its Recv, and must not act on what it received before.
func (i *Interceptor) Stream() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if i.cfg.Methods != nil && !i.cfg.Methods(info.FullMethod) {
			return handler(srv, ss)
		}
		md, _ := metadata.FromIncomingContext(ss.Context())
		if len(md.Get(MetadataKey)) > 0 {
			return streamRefusal(info.FullMethod, MetadataKey+" metadata")
		}
		return handler(srv, &keyedStream{ServerStream: ss, method: info.FullMethod, field: i.cfg.RequestIDField})
	}
}

// streamRefusal is the status of a keyed streaming call.
func streamRefusal(method, where string) error {
	return withInfo(codes.Unimplemented, ReasonInvalidKey,
		"idempotency keys are not supported on streaming methods ("+method+", key in the "+where+"): make the non-idempotent operation a unary call")
}

// keyedStream refuses a received message that carries a key.
type keyedStream struct {
	grpc.ServerStream
	method string
	field  protoreflect.Name
}

func (k *keyedStream) RecvMsg(m any) error {
	if err := k.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if msg, ok := m.(proto.Message); ok {
		if f := requestIDField(msg, k.field); f != nil && msg.ProtoReflect().Get(f).String() != "" {
			return streamRefusal(k.method, "request's "+string(k.field)+" field")
		}
	}
	return nil
}

func (i *Interceptor) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if i.cfg.Methods != nil && !i.cfg.Methods(info.FullMethod) {
		return handler(ctx, req)
	}
	md, _ := metadata.FromIncomingContext(ctx)
	msg, _ := req.(proto.Message)
	id, present, err := i.keyOf(md, msg)
	if err != nil {
		return nil, err
	}
	if !present {
		if i.cfg.RequireKey != nil && i.cfg.RequireKey(info.FullMethod) {
			return nil, withInfo(codes.InvalidArgument, ReasonMissingKey,
				info.FullMethod+" requires an idempotency key (metadata "+MetadataKey+" or the request's "+string(i.cfg.RequestIDField)+" field): generate one per operation and send it on every retry")
		}
		return handler(ctx, req)
	}
	if msg == nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: %s: the request is not a protobuf message", info.FullMethod)
	}
	tenant, err := i.cfg.Tenant(ctx, info.FullMethod)
	if err != nil {
		if errors.Is(err, ErrUnauthenticated) {
			return nil, status.Error(codes.Unauthenticated, err.Error())
		}
		return nil, status.Error(codes.PermissionDenied, err.Error())
	}
	key := etcdstore.Key{Tenant: tenant, ID: id}
	if err := key.Validate(); err != nil {
		return nil, withInfo(codes.InvalidArgument, ReasonInvalidKey, err.Error())
	}
	fp, err := Fingerprint(info.FullMethod, withoutKey(msg, i.cfg.RequestIDField))
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	// In the trailer, not the header: a refusal must stay a
	// trailers-only response, the only kind grpc-go's retry policy retries.
	_ = grpc.SetTrailer(ctx, metadata.Pairs(MetadataRetention, strconv.Itoa(int(i.cfg.Store.Retention().Seconds()))))
	return i.run(ctx, req, info, handler, key, fp)
}

// keyOf finds the call's key in the metadata or the request's field.
func (i *Interceptor) keyOf(md metadata.MD, msg proto.Message) (string, bool, error) {
	var fromMD, fromField string
	if v := md.Get(MetadataKey); len(v) > 1 {
		return "", false, withInfo(codes.InvalidArgument, ReasonInvalidKey, "more than one "+MetadataKey+" in the metadata")
	} else if len(v) == 1 {
		fromMD = v[0]
		if fromMD == "" {
			return "", false, withInfo(codes.InvalidArgument, ReasonInvalidKey, MetadataKey+" is empty")
		}
	}
	if f := requestIDField(msg, i.cfg.RequestIDField); f != nil {
		fromField = msg.ProtoReflect().Get(f).String()
	}
	switch {
	case fromMD != "" && fromField != "" && fromMD != fromField:
		return "", false, withInfo(codes.InvalidArgument, ReasonInvalidKey,
			"the "+MetadataKey+" metadata and the request's "+string(i.cfg.RequestIDField)+" differ: send one key per operation")
	case fromMD != "":
		return fromMD, true, nil
	case fromField != "":
		return fromField, true, nil
	}
	return "", false, nil
}

// withoutKey returns msg with its key field (name) empty: a copy when the
// field is set, msg itself otherwise. The key names the operation; it is
// not part of what the operation is, and a caller may send it in the
// metadata once and in the field the next time.
func withoutKey(msg proto.Message, name protoreflect.Name) proto.Message {
	f := requestIDField(msg, name)
	if f == nil || !msg.ProtoReflect().Has(f) {
		return msg
	}
	c := proto.Clone(msg)
	c.ProtoReflect().Clear(f)
	return c
}

// Fingerprint is the fingerprint of a call: its full method name and its
// request message in protobuf's deterministic encoding. The interceptor
// fingerprints the request with its key field (RequestIDField) cleared, so
// one operation has one fingerprint wherever its key travels. Deterministic
// encoding is stable for one binary (map entries sorted, fields in number
// order) but not across every protobuf version and language: clients that
// retry through different stacks should send byte-identical requests, or
// the retry is refused as a mismatch, never run twice.
func Fingerprint(fullMethod string, msg proto.Message) (etcdstore.Fingerprint, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return etcdstore.Fingerprint{}, fmt.Errorf("idemgrpc: encoding the request: %w", err)
	}
	return etcdstore.FingerprintOf(append(append([]byte("grpc "+fullMethod), 0), b...))
}

// outcomes are saved as a google.rpc.Status: its code, message and details,
// and for an OK call the response in Details[0] as an Any. Outcome.Status
// holds the gRPC code plus statusBase, so that a record says what made it.
const statusBase = 1000

func (i *Interceptor) run(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler, key etcdstore.Key, fp etcdstore.Fingerprint) (any, error) {
	var opts []etcdstore.RunOption
	if i.cfg.ClaimDeadline > 0 {
		opts = append(opts, etcdstore.WithDeadline(i.cfg.ClaimDeadline))
	}
	ran := false
	var live any      // the handler's response, for the first caller
	var liveErr error // the handler's error, for the first caller
	var panicked any
	replaced := false    // the answer could not be saved; a status saying so was
	savedStatus := false // the handler's error status is saved as its outcome
	res, err := i.cfg.Store.Run(ctx, key, fp, func(_ context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		ran = true
		if c.TookOver() && c.CutShort() && i.cfg.OnUnknownOutcome == etcdstore.EndSave {
			// The attempt it replaces may have run the handler: its
			// outcome is unknown, and an outcome that may have happened
			// is never run again under the default policy.
			replaced = true
			return saved(statusWithInfo(codes.Unknown, ReasonOutcomeUnknown, fmt.Sprintf(
				"an earlier attempt at this call was cut short, its process gone or its claim past its deadline, after its handler may have run (this claim's token is %d): reconcile before using a new key", c.Token()))), etcdstore.EndSave
		}
		// Once the handler starts it runs to its end, even if the caller
		// goes away or the claim is lost: cutting it short turns a definite
		// answer into an unknown outcome. Its answer is saved if the claim
		// still holds (the write is fenced).
		// Its deadline is the caller's or HandlerTimeout, whichever is later.
		deadline := time.Now().Add(i.cfg.HandlerTimeout)
		if d, ok := ctx.Deadline(); ok && d.After(deadline) {
			deadline = d
		}
		hctx, cancel := context.WithDeadline(fencing.NewContext(context.WithoutCancel(ctx), c.Token()), deadline)
		defer cancel()
		// Past the claim's deadline a retry may take the key over: the
		// handler's context ends first, with time left to save its answer.
		hctx, cancelClaim := c.BeforeEnd(hctx)
		defer cancelClaim()
		// The token goes to the services the handler calls, and replaces
		// whatever the caller sent under the same name.
		hctx = metadata.AppendToOutgoingContext(hctx, MetadataFencing, c.Token().String())
		if md, ok := metadata.FromIncomingContext(hctx); ok {
			md = md.Copy()
			md.Set(MetadataFencing, c.Token().String())
			hctx = metadata.NewIncomingContext(hctx, md)
		}
		func() {
			defer func() {
				if v := recover(); v != nil {
					panicked = v
				}
			}()
			live, liveErr = handler(hctx, req)
		}()
		// notSaved saves st in place of the answer, and says so to the
		// first caller too.
		notSaved := func(st *status.Status) (etcdstore.Outcome, etcdstore.End) {
			replaced = true
			return saved(st), etcdstore.EndSave
		}
		if panicked != nil {
			// It may have acted before it panicked.
			return notSaved(status.New(codes.Internal, "the handler failed while running this call; it may have acted: reconcile before using a new key"))
		}
		if liveErr != nil {
			st := status.Convert(liveErr)
			body := mustMarshal(st.Proto())
			if limit := i.cfg.Store.MaxRecordSize() - 4096; len(body) > limit {
				return notSaved(statusWithInfo(codes.Internal, ReasonNotSaved, fmt.Sprintf(
					"the call ran once and failed with %s, but its status (%d bytes) is over the %d-byte limit and cannot be replayed; do not retry it with a new key", st.Code(), len(body), limit)))
			}
			end := i.cfg.OnStatus(st)
			savedStatus = end == etcdstore.EndSave
			return saved(st), end
		}
		resp, ok := live.(proto.Message)
		if !ok {
			return notSaved(status.New(codes.Internal, "the handler's response is not a protobuf message and cannot be saved"))
		}
		a, err := anypb.New(resp)
		if err != nil {
			return notSaved(status.New(codes.Internal, "the handler's response cannot be encoded: "+err.Error()))
		}
		body := mustMarshal(&spb.Status{Code: int32(codes.OK), Details: []*anypb.Any{a}})
		if limit := i.cfg.Store.MaxRecordSize() - 4096; len(body) > limit {
			// It ran; say so to every retry, since it cannot be replayed.
			return notSaved(statusWithInfo(codes.Internal, ReasonNotSaved, fmt.Sprintf(
				"the call ran once, but its response (%d bytes) is over the %d-byte limit and cannot be replayed; do not retry it with a new key", len(body), limit)))
		}
		return etcdstore.Outcome{Status: statusBase, Body: body}, etcdstore.EndSave
	}, opts...)
	if panicked != nil {
		panic(panicked)
	}

	if !ran {
		if err != nil {
			return nil, i.refusal(ctx, key, err)
		}
		return replayed(ctx, res.Outcome)
	}
	switch {
	case errors.Is(err, etcdstore.ErrFenced) || errors.Is(err, etcdstore.ErrClaimEnded):
		// Another owner took the key over while this handler ran: the first
		// saved outcome is theirs, and every caller must see that one.
		if cur, gerr := i.cfg.Store.Get(ctx, key); gerr == nil && cur.State == etcdstore.Done && cur.Fingerprint == fp && cur.Outcome != nil {
			return replayed(ctx, *cur.Outcome)
		}
		return nil, withRetry(codes.Aborted, ReasonInFlight, "another owner took this key over while the call ran; retry with the same key to get its outcome", time.Second)
	case errors.Is(err, etcdstore.ErrUnavailable):
		// The handler answered, but its answer is not saved yet (the store
		// keeps trying in the background): acknowledging it could let a
		// crash replace it with another answer to a retry.
		i.cfg.Logger.Warn("idem: a call ran but its outcome is not saved yet", "key", key.Digest(), "err", key.Redact(err))
		return nil, withRetry(codes.Unavailable, ReasonStoreUnavailable, "the call ran but its response could not be saved yet; retry with the same key to get it", time.Second)
	case err != nil:
		// The outcome could not be saved as it was (too large: the store
		// saved that fact instead), or the claim was abandoned for the next
		// request to resume. Either way this caller gets the live answer,
		// as the HTTP middleware gives it.
		i.cfg.Logger.Error("idem: ending a claim", "key", key.Digest(), "err", key.Redact(err))
	}
	if replaced {
		return replay(res.Outcome) // the answer was not saved: say so to this caller too
	}
	if err == nil && savedStatus {
		// A saved status is the call's outcome, replayed to every retry:
		// response headers commit the call, so that grpc-go's retry policy
		// does not resend it for a replay (it retries only trailers-only
		// answers).
		_ = grpc.SendHeader(ctx, metadata.MD{})
	}
	return live, liveErr
}

// replayed answers a replay: the saved response or status, marked in the
// response header (which also keeps a retry policy from resending it).
func replayed(ctx context.Context, o etcdstore.Outcome) (any, error) {
	_ = grpc.SetHeader(ctx, metadata.Pairs(MetadataReplayed, "true"))
	return replay(o)
}

// replay turns a saved outcome back into the response or status.
func replay(o etcdstore.Outcome) (any, error) {
	var st spb.Status
	switch {
	case o.Status == 0 && o.Err != "":
		// What the store saved when the call's own outcome could not be
		// saved (or the work panicked): the call ran.
		return nil, withInfo(codes.Internal, ReasonNotSaved, "the call ran once, but its outcome could not be saved ("+o.Err+"); do not retry it with a new key: reconcile")
	case o.Status < statusBase || proto.Unmarshal(o.Body, &st) != nil:
		return nil, status.Error(codes.FailedPrecondition, "this idempotency key holds the outcome of an HTTP request, not of a gRPC call: use a new key")
	}
	if codes.Code(st.Code) != codes.OK {
		return nil, status.FromProto(&st).Err()
	}
	if len(st.Details) != 1 {
		return nil, status.Error(codes.Internal, "idemgrpc: a saved response without its message")
	}
	m, err := st.Details[0].UnmarshalNew()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: decoding the saved response (%s): %v", st.Details[0].GetTypeUrl(), err)
	}
	return m, nil
}

// refusal maps a claim that did not run the handler to a status.
func (i *Interceptor) refusal(ctx context.Context, key etcdstore.Key, err error) error {
	var ce *etcdstore.ConflictError
	switch {
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case errors.As(err, &ce):
		return withRetry(codes.Aborted, ReasonInFlight,
			"a call with this idempotency key is in flight; retry with the same key", max(ce.RetryAfter, 100*time.Millisecond))
	case errors.Is(err, etcdstore.ErrMismatch):
		return withInfo(codes.FailedPrecondition, ReasonKeyReused,
			"this idempotency key was used with a different request: a key names one operation; use a new key for a new operation")
	case errors.Is(err, etcdstore.ErrInvalidKey), errors.Is(err, etcdstore.ErrInvalidTenant), errors.Is(err, etcdstore.ErrInvalidArgument), errors.Is(err, etcdstore.ErrTooLarge):
		return withInfo(codes.InvalidArgument, ReasonInvalidKey, err.Error())
	case errors.Is(err, etcdstore.ErrStoreFull):
		return withRetry(codes.Unavailable, ReasonStoreUnavailable, "the idempotency store is out of space (NOSPACE); retry with the same key once an operator frees space", 30*time.Second)
	default:
		i.cfg.Logger.Warn("idem: claim failed", "key", key.Digest(), "err", key.Redact(err))
		return withRetry(codes.Unavailable, ReasonStoreUnavailable, "the idempotency store is unavailable; retry with the same key", time.Second)
	}
}

func withInfo(c codes.Code, reason, msg string) error {
	return statusWithInfo(c, reason, msg).Err()
}

func statusWithInfo(c codes.Code, reason, msg string) *status.Status {
	st, err := status.New(c, msg).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain})
	if err != nil {
		return status.New(c, msg)
	}
	return st
}

func withRetry(c codes.Code, reason, msg string, after time.Duration) error {
	st, err := status.New(c, msg).WithDetails(
		&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(after)})
	if err != nil {
		return status.Error(c, msg)
	}
	return st.Err()
}

// saved is the outcome that saves st.
func saved(st *status.Status) etcdstore.Outcome {
	return etcdstore.Outcome{Status: statusBase + int(st.Code()), Body: mustMarshal(st.Proto())}
}

func mustMarshal(m proto.Message) []byte {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("idemgrpc: encoding %T: %v", m, err)) // a status proto always encodes
	}
	return b
}

// TokenFromIncoming returns the fencing token an upstream idem sent in the
// incoming metadata of a call, for a downstream service that refuses stale
// tokens (fencing.Checker).
func TokenFromIncoming(ctx context.Context) (fencing.Token, bool, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get(MetadataFencing)
	if len(v) == 0 {
		return 0, false, nil
	}
	t, err := fencing.Parse(v[0])
	return t, err == nil, err
}

// requestIDField is msg's string field named name (AIP-155's request_id),
// or nil when it has none or name is "-".
func requestIDField(msg proto.Message, name protoreflect.Name) protoreflect.FieldDescriptor {
	if msg == nil || name == "-" {
		return nil
	}
	f := msg.ProtoReflect().Descriptor().Fields().ByName(name)
	if f == nil || f.Kind() != protoreflect.StringKind || f.IsList() || f.IsMap() {
		return nil
	}
	return f
}
