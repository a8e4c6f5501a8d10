package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idem-dev/idem/fencing"
)

// ErrorPolicy says what Do does when the work returns an error. There is no
// choice that is right for every work; pick one deliberately (the seed's
// "design note").
type ErrorPolicy int

const (
	// SaveError (the default) saves the error's message as the key's outcome,
	// as Stripe's API v1 saves 500s: every retry gets the same error back and
	// the work never runs again for this key. It is the only policy that is
	// safe when the work is not idempotent downstream and may have had an
	// effect before failing. The client needs a new key to try again.
	SaveError ErrorPolicy = iota

	// ReleaseOnError deletes the claim, so a retry with the same key runs the
	// work again. Safe only when the work failed before any effect, or is
	// idempotent downstream (it passes its own key on, like the seed's
	// charge:<orderId>); otherwise it re-creates the double charge.
	ReleaseOnError

	// KeepOnError abandons the claim with its last checkpoint: the next
	// request with the key takes it over at once and resumes from the
	// checkpoint, with a greater fencing token. For multi-step work that
	// saves recovery points with Claim.Checkpoint.
	KeepOnError
)

// OnError sets Do's error policy (default SaveError). Claim and Run ignore it.
//
// Whatever the policy, a work whose context was cancelled (the caller gave
// up, the claim was lost) is abandoned, not saved: "context canceled" is not
// the operation's outcome, and the next request resumes it.
func OnError(p ErrorPolicy) ClaimOption {
	return func(c *claimConfig) error {
		if p < SaveError || p > KeepOnError {
			return fmt.Errorf("%w: unknown error policy %d", ErrInvalidArgument, p)
		}
		c.onError = p
		return nil
	}
}

// Work is the non-idempotent operation behind a key, for Do. ctx is
// cancelled when the caller's context ends or the claim is lost, and
// carries the fencing token (fencing.FromContext); c gives the token, the
// last checkpoint on a takeover, and Checkpoint. The returned bytes are saved
// and replayed.
type Work func(ctx context.Context, c *Claim) ([]byte, error)

// Result is what Do and Run return.
type Result struct {
	// Outcome is the work's outcome, or the replayed one.
	Outcome
	// Replayed is true when Outcome was saved by an earlier call.
	Replayed bool
	// Token is the fencing token of the claim that produced Outcome.
	Token fencing.Token
}

// Do runs work at most once to a saved outcome per key (while the key is
// retained) and returns the outcome to this and every later call with the
// same key and params:
//
//   - a new key: work runs under a claim and its result is saved, fenced;
//   - a done key with the same params: the saved result, Replayed, and
//     work does not run;
//   - different params: a *MismatchError; work does not run;
//   - in flight under a live owner: a *ConflictError, or with WithWait the
//     outcome once the owner finishes;
//   - in flight under a dead owner (or past its WithDeadline): taken over,
//     and work runs with the last checkpoint and a greater token.
//
// params are fingerprinted by FingerprintOf. When the work fails, OnError
// decides what is saved; the first call returns the work's own error, and
// replays of a saved error return a *SavedError with its message.
//
// If the outcome cannot be saved, Do returns the work's result together with
// an error: ErrFenced when another owner took over (this run's effects must
// have been fenced downstream), ErrUnavailable when etcd did not answer; the
// store then keeps trying to save it in the background while the key stays
// claimed.
func (s *Store) Do(ctx context.Context, key Key, params []byte, work Work, opts ...ClaimOption) (Result, error) {
	var cfg claimConfig
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return Result{}, fmt.Errorf("do %s: %w", key, err)
		}
	}
	fp, err := FingerprintOf(params)
	if err != nil {
		return Result{}, fmt.Errorf("do %s: %w", key, err)
	}
	var werr error
	res, err := s.Run(ctx, key, fp, func(wctx context.Context, c *Claim) (Outcome, End) {
		var body []byte
		body, werr = work(wctx, c)
		switch {
		case werr == nil:
			return Outcome{Body: body}, EndSave
		case ctx.Err() != nil || c.Err() != nil || cfg.onError == KeepOnError:
			return Outcome{}, EndAbandon
		case cfg.onError == ReleaseOnError:
			return Outcome{}, EndRelease
		}
		return Outcome{Err: werr.Error()}, EndSave
	}, opts...)
	switch {
	case res.Replayed && res.Err != "":
		return res, &SavedError{Message: res.Err}
	case werr != nil && err != nil:
		return res, fmt.Errorf("%w (and: %w)", werr, err)
	case werr != nil:
		return res, werr
	}
	return res, err
}

// End says how Run ends a work's claim.
type End int

const (
	// EndSave completes the claim with the work's Outcome, to be replayed.
	EndSave End = iota
	// EndRelease deletes the claim: a retry runs the work again.
	EndRelease
	// EndAbandon leaves the claim, with its checkpoint, to the next request.
	EndAbandon
)

// RunWork is the general form of a work, for Run: it returns the outcome
// and how its claim must end.
type RunWork func(ctx context.Context, c *Claim) (Outcome, End)

// Run is the general form of Do, for callers that produce a whole Outcome
// (an HTTP response: status, headers, body) and decide themselves how each
// run ends. It claims key for fingerprint fp and then:
//
//   - replays a done key's Outcome (Result.Replayed) without running work;
//   - returns a *MismatchError or *ConflictError as Claim does;
//   - otherwise runs work and ends the claim as it says. The end is written
//     even if ctx has ended (bounded by WithEndTimeout). If work panics, the
//     claim is abandoned and the panic continues.
//
// When the end cannot be written, Run returns the work's Outcome with an
// error wrapping ErrFenced (another owner took over: the saved outcome, if
// any, is theirs) or ErrUnavailable (the store keeps trying in the
// background, and the key stays claimed by this process meanwhile).
func (s *Store) Run(ctx context.Context, key Key, fp Fingerprint, work RunWork, opts ...ClaimOption) (Result, error) {
	c, done, err := s.Claim(ctx, key, fp, opts...)
	if err != nil {
		return Result{}, err
	}
	if done != nil {
		return Result{Outcome: *done.Outcome, Replayed: true, Token: done.Token}, nil
	}
	out, end := s.run(ctx, c, work)
	var finish func(context.Context) error
	switch end {
	case EndRelease:
		finish = c.Release
	case EndAbandon:
		finish = c.Abandon
	default:
		finish = func(ctx context.Context) error { return c.Complete(ctx, out) }
	}
	// Save even when the caller has gone: the work is done either way.
	endCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.endTimeout)
	defer cancel()
	res := Result{Outcome: out, Token: c.Token()}
	err = finish(endCtx)
	switch {
	case err == nil, errors.Is(err, ErrFenced), errors.Is(err, ErrClaimEnded):
	case errors.Is(err, ErrUnavailable):
		s.finishLater(c, finish)
	case errors.Is(err, ErrTooLarge) && end == EndSave:
		// The work ran but its outcome cannot be saved: save that fact, so
		// a retry learns it instead of running the work again.
		tooLarge := Outcome{Err: "the outcome could not be saved: " + err.Error()}
		if e := c.Complete(endCtx, tooLarge); errors.Is(e, ErrUnavailable) {
			s.finishLater(c, func(ctx context.Context) error { return c.Complete(ctx, tooLarge) })
		}
	default:
		// The claim could not end as asked; never leave it held: the next
		// request resumes it.
		if e := c.Abandon(endCtx); errors.Is(e, ErrUnavailable) {
			s.finishLater(c, c.Abandon)
		}
	}
	return res, err
}

// run calls work with the claim's context. A panic abandons the claim, so
// the next request resumes it, then continues unwinding.
func (s *Store) run(ctx context.Context, c *Claim, work RunWork) (Outcome, End) {
	wctx, cancel := c.Context(ctx)
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			end, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.endTimeout)
			defer cancel()
			if err := c.Abandon(end); errors.Is(err, ErrUnavailable) {
				s.finishLater(c, c.Abandon)
			}
			panic(r)
		}
	}()
	return work(wctx, c)
}

// finishLater retries a claim's final write in the background until it
// lands, is refused, or the store closes. The claim stays registered all
// along, so this process keeps answering ErrConflict for its key.
func (s *Store) finishLater(c *Claim, finish func(context.Context) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		// Fencing makes every try safe, even after the session is lost: the
		// write lands only if nobody took the key over. It stops when it
		// lands, is fenced out, or the store closes.
		for try := 0; ; try++ {
			wait := time.NewTimer(time.Duration(100<<min(try, 6)) * time.Millisecond)
			select {
			case <-s.closing:
				wait.Stop()
				return
			case <-wait.C:
			}
			attempt, cancelAttempt := context.WithTimeout(context.Background(), s.endTimeout)
			err := finish(attempt)
			cancelAttempt()
			if !errors.Is(err, ErrUnavailable) {
				s.log.Info("idem: ended a claim after retries", "key", c.key.String(), "err", err)
				return
			}
		}
	}()
}

// abandonIfOurs gives up, in the background, a claim of ours whose write
// had an unknown outcome: if the record is in flight under owner and
// attempt, it is abandoned (owner cleared), so the next claimant anywhere
// takes it over at once. While it works it holds attempt in this process,
// so a retry with the same attempt id gets ErrConflict instead of racing it.
func (s *Store) abandonIfOurs(k Key, owner, attempt string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		hold := &Claim{s: s, key: k, attempt: attempt, owner: owner}
		hold.ctx, hold.cancel = context.WithCancelCause(context.Background())
		for try := 0; ; try++ {
			wait := time.NewTimer(time.Duration(50<<min(try, 6)) * time.Millisecond)
			select {
			case <-s.closing:
				wait.Stop()
				return // our session is revoked on close: the claim goes stale anyway
			case <-wait.C:
			}
			if err := s.register(hold); err != nil {
				if errors.Is(err, ErrConflict) {
					continue // a retry with this attempt id is running: let it decide
				}
				return // our session ended: its claims are stale to everyone now
			}
			done := s.abandonOnce(k, owner, attempt)
			s.unregister(hold)
			if done {
				return
			}
		}
	}()
}

// abandonOnce makes one attempt; it reports whether there is nothing left
// to do.
func (s *Store) abandonOnce(k Key, owner, attempt string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), s.endTimeout)
	defer cancel()
	rec, _, err := s.get(ctx, k)
	if err != nil {
		return false
	}
	if rec == nil || rec.State != InFlight || rec.Owner != owner || rec.Attempt != attempt {
		return true // never written, or not ours any more
	}
	c := &Claim{s: s, key: k, fp: rec.Fingerprint, attempt: attempt, owner: owner}
	c.ctx, c.cancel = context.WithCancelCause(context.Background())
	c.won(rec, nil)
	err = c.Abandon(ctx)
	if err == nil {
		s.log.Info("idem: abandoned a claim whose write had an unknown outcome", "key", k.String())
	}
	return !errors.Is(err, ErrUnavailable)
}
