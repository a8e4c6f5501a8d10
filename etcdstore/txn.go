package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/send"
)

// notApplied is the error of a write that etcd answered it did not apply
// (its Else branch ran) but whose answer the store could not read.
type notApplied struct{ err error }

func (e notApplied) Error() string { return e.err.Error() }
func (e notApplied) Unwrap() error { return e.err }

// retryable reports whether an etcd error may be retried by the store with
// the same attempt: the request may or may not have been applied, and
// trying again is safe because every write is conditional and the attempt id
// lets the store recognise its own earlier write.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil || err == nil || errors.Is(err, ErrInvalidArgument) {
		return false
	}
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return true // definitely not applied; the caller refreshes the lease
	}
	// etcd's own errors carry their gRPC code; others may be transport
	// errors. A request timeout (not the caller's) surfaces as
	// DeadlineExceeded while ctx is still alive: the outcome is unknown.
	switch etcdCode(err) {
	case codes.Unavailable, codes.Unknown, codes.Internal, codes.Aborted, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

// etcdCode returns the gRPC code of an error from etcd.
func etcdCode(err error) codes.Code {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code()
	}
	return status.Code(err)
}

// mayHaveLanded reports whether a write that failed with err may have been
// applied all the same (send.MayHaveLanded), except that an answer etcd
// gave but the store could not read (ErrCorrupt, or a dictionary it could
// not fetch: the Else branch ran) says it did not.
func mayHaveLanded(err error) bool {
	return send.MayHaveLanded(err) && !errors.Is(err, ErrCorrupt) && !errors.As(err, new(notApplied))
}

// landing follows the tries of one write: once a try may have landed, the
// write as a whole may have, and a later try that was never sent
// (ErrNotSent) no longer speaks for it. Every loop that retries a write
// passes each try's error through it.
type landing struct{ maybe bool }

// failed notes a try's error and returns the error the write reports.
func (l *landing) failed(err error) error {
	switch {
	case mayHaveLanded(err):
		l.maybe = true
	case l.maybe && errors.Is(err, ErrNotSent):
		// This try never left, but an earlier one may have landed.
		return fmt.Errorf("an earlier try may have landed; the last was not sent (%v)", err)
	}
	return err
}

// backoff sleeps, on the store's clock, before retry try (0-based), or
// returns false when ctx ends first.
func (a *Admin) backoff(ctx context.Context, try int) bool {
	return clock.Sleep(a.clock, ctx, time.Duration(25<<min(try, 5))*time.Millisecond) == nil
}

// maxTries bounds the store's own retries of one etcd write.
const maxTries = 4
