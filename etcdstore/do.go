package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"

	"github.com/idem-dev/idem/internal/storeext"
)

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
func (s *Store) Do(ctx context.Context, key Key, params []byte, work Work, opts ...RunOption) (Result, error) {
	var cfg claimConfig
	for _, o := range opts {
		if err := o.applyRun(&cfg); err != nil {
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
		case ctx.Err() != nil || c.Err() != nil:
			return Outcome{}, EndAbandon
		case cfg.onError != EndSave:
			return Outcome{}, cfg.onError
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
//     even if ctx has ended (bounded by WithEndTimeout).
//
// If work panics, the work may have had effects before it did: the claim
// ends as OnError says (by default the panic's message is saved, as an
// error outcome, and replayed), then the panic continues.
//
// Every claim Run makes ends on every path. When the end cannot be written,
// Run returns the work's Outcome with an error wrapping ErrFenced (another
// owner took over: the saved outcome, if any, is theirs) or ErrUnavailable
// (the store keeps trying in the background, the key stays claimed by this
// process meanwhile, and Close waits for it). An outcome too large to save
// is replaced by a saved error saying so: the work ran, and a retry must
// learn that rather than run it again.
func (s *Store) Run(ctx context.Context, key Key, fp Fingerprint, work RunWork, opts ...RunOption) (Result, error) {
	var cfg claimConfig
	for _, o := range opts {
		if err := o.applyRun(&cfg); err != nil {
			return Result{}, fmt.Errorf("run %s: %w", key, err)
		}
	}
	cfg.run = true
	c, done, err := s.claim(ctx, key, fp, &cfg)
	if err != nil {
		return Result{}, err
	}
	if done != nil {
		return Result{Outcome: *done.Outcome, Replayed: true, Token: done.Token}, nil
	}
	out, end, panicked := s.run(ctx, c, work, cfg.onError)
	if end == EndSave {
		// The outcome exists only here until it is saved: the claim stays
		// registered, past its deadline or its session, while the save is
		// tried (and retried in the background), so that this process
		// never runs the key again meanwhile.
		c.pending.Store(true)
	}
	// Save even when the caller has gone: the work is done either way.
	endCtx, cancel := s.clock.WithTimeout(context.WithoutCancel(ctx), s.endTimeout)
	defer cancel()
	err = s.end(endCtx, c, end, out)
	if panicked != nil {
		panic(panicked)
	}
	return Result{Outcome: out, Token: c.Token()}, err
}

// run calls work with the claim's context. A panic is recovered and
// returned, with the end that policy gives a failed work; the outcome then
// saves the panic's message.
func (s *Store) run(ctx context.Context, c *Claim, work RunWork, onError End) (out Outcome, end End, panicked any) {
	wctx, cancel := c.Context(ctx)
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			panicked = r
			out, end = Outcome{Err: fmt.Sprintf("the work panicked: %v", r)}, onError
		}
	}()
	out, end = work(wctx, c)
	return out, end, nil
}

// end writes the end of a claim whose work ran, and makes sure the claim
// ends on every path: a write etcd did not acknowledge is retried in the
// background (finishLater); an outcome too large to save is replaced by a
// saved error saying so; any other failure to end as asked abandons the
// claim, and if even that is refused, the claim is given up here (logged)
// rather than held by this process.
func (s *Store) end(ctx context.Context, c *Claim, end End, out Outcome) error {
	finish, op := func(ctx context.Context) error { return c.Complete(ctx, out) }, "complete"
	switch end {
	case EndRelease:
		finish, op = c.Release, "release"
	case EndAbandon:
		finish, op = c.Abandon, "abandon"
	}
	err := finish(ctx)
	switch {
	case err == nil, errors.Is(err, ErrFenced), errors.Is(err, ErrClaimEnded):
		return err
	case errors.Is(err, ErrUnavailable):
		s.finishLater(c, op, finish)
		return err
	case errors.Is(err, ErrTooLarge) && end == EndSave:
		// The work ran but its outcome cannot be saved: save that fact, so
		// a retry learns it instead of running the work again.
		tooLarge := Outcome{Err: storeext.OutcomeNotSaved + truncate(err.Error(), 512)}
		if e := s.end(ctx, c, EndSave, tooLarge); e != nil {
			return fmt.Errorf("%w (and: %w)", err, e)
		}
		return err
	}
	if end != EndAbandon {
		// The claim could not end as asked; never leave it held: the next
		// request resumes it.
		e := c.Abandon(ctx)
		switch {
		case e == nil, errors.Is(e, ErrFenced), errors.Is(e, ErrClaimEnded):
			return err
		case errors.Is(e, ErrUnavailable):
			s.finishLater(c, "abandon", c.Abandon)
			return err
		}
	}
	s.log.Error("idem: a claim could not be ended; giving it up in this process", "key", c.key.Digest(), "err", c.key.redact(err))
	c.giveUp(err)
	return err
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// finishLater retries a claim's final write in the background until it
// lands or is refused. The claim stays registered all along (pending), so
// this process keeps answering ErrConflict for its key, across a lost
// session and past the claim's deadline; Close waits for it. Fencing makes
// every try safe, even after the session is lost: the write lands only if
// nobody took the key over.
func (s *Store) finishLater(c *Claim, op string, finish func(context.Context) error) {
	c.pending.Store(true)
	ok := s.bg.start(fmt.Sprintf("%s %s %d", op, c.key, c.token), 100*time.Millisecond, func(ctx context.Context) bool {
		tctx, cancel := s.clock.WithTimeout(ctx, s.endTimeout)
		err := finish(tctx)
		cancel()
		if errors.Is(err, ErrUnavailable) && ctx.Err() == nil {
			return false
		}
		if errors.Is(err, ErrUnavailable) {
			s.log.Error("idem: gave up a final write at close; the key will be taken over", "key", c.key.Digest(), "err", c.key.redact(err))
		} else {
			s.log.Info("idem: ended a claim after retries", "key", c.key.Digest(), "err", c.key.redact(err))
		}
		c.pending.Store(false)
		c.giveUp(ErrClaimEnded) // settled either way: no longer held here
		return true
	})
	if !ok {
		c.pending.Store(false)
		c.giveUp(ErrClosed)
		s.log.Error("idem: a final write failed after close; the key will be taken over", "key", c.key.Digest())
	}
}

// reap gives up, in the background, a claim of this process's session
// whose claim write had an unknown outcome: that write may have landed, or
// may still land (a request that has left this process can be applied
// after its caller stopped waiting), as an in-flight record under a live
// session that nobody here runs; other processes would answer ErrConflict
// until this process dies. seen is the highest revision the claim saw
// etcd at: each of its writes compared the record's absence, or a state of
// it at or before seen.
//
// The reaper reads the record. Its own claim (the lost write landed) it
// abandons: the next claimant anywhere takes the key over at once, with a
// greater token. A record written after seen, not its own, needs nothing:
// no lost write can land on it, ever. Otherwise (absent, or a state the
// claim saw, which a lost write may have compared) it fences the key: it
// claims it again with the same attempt id, writing the record abandoned.
// That write is conditioned on that very state, so once it lands the lost
// one can never land after it (etcd revisions only grow). A record past
// its retention is fenced too (the sweeper may delete it next, and a lost
// create land on the empty key); the fence lives a retention. A record
// held by another live owner, done or moved needs nothing. While
// it works it holds the attempt id in this process, so a retry with the
// same attempt id waits for it instead of racing it.
//
// Only claims under this process's session are reaped. A claim made
// WithoutSession may be recognised by its attempt id through another
// process, which then runs it: reaping it from here would hand the key to a
// second owner while the first still runs. Such a claim is left to its
// deadline, and no reaper starts for it (reapOnce's session check would
// end one at once; a background task per lost claim would only pile up,
// counted as a pending final write).
func (s *Store) reap(l lostClaim) {
	if l.owner == deadlineOwner {
		return
	}
	l.until = s.now().Add(s.landWindow())
	s.bg.start("reap "+l.key.String(), 50*time.Millisecond, func(ctx context.Context) bool {
		return s.reapOnce(ctx, l)
	})
}

// lostClaim is a claim whose claim write had an unknown outcome, as the
// reaper needs it: its key, fingerprint, owner and attempt, the highest
// revision it saw, until when its lost writes may land, and whether it
// replaced Moved records (ReplaceMoved: its fence must too, under the
// shard set the claim compared).
type lostClaim struct {
	key            Key
	fp             Fingerprint
	owner, attempt string
	seen           int64
	until          time.Time
	overMoved      bool
	setRev         int64
}

// fenceSet is the shard set the reaper's fence compares (kernel.FenceSet);
// the store's own set is 0 (the one it holds when the fence is sent).
func (l lostClaim) fenceSet() int64 { return kernel.FenceSet(l.overMoved, l.setRev, 0) }

// landWindow is how long after it was sent a write may still be applied by
// etcd, for the reaper: twice the request timeout (a request that left is
// applied within its timeouts and an election, or never), or a minute
// without one. A write etcd applies later than that is beyond what the
// reaper guards against, but for a key it fenced: a fence lives a
// retention.
func (s *Store) landWindow() time.Duration {
	if s.timeout <= 0 {
		return time.Minute
	}
	return 2 * s.timeout
}

// reapOnce makes one attempt; it reports whether there is nothing left to
// do.
func (s *Store) reapOnce(ctx context.Context, l lostClaim) bool {
	k, fp, owner, attempt, seen := l.key, l.fp, l.owner, l.attempt, l.seen
	sess, err := s.session()
	switch {
	case errors.Is(err, ErrClosed):
		return true
	case err != nil:
		return false // reconnecting: the old session may still be alive in etcd
	case sess.Owner() != owner:
		// The session the lost write was made under has ended (a claim
		// compares that its owner key exists): it can no longer land, and
		// if it did, its record is stale to everyone.
		return true
	}
	hold := s.newClaim(k, fp, attempt, owner)
	if err := s.register(hold); err != nil {
		hold.cancel(ErrClaimEnded)
		// ErrConflict: a retry with this attempt id is running here: let
		// it decide. Otherwise our session ended or the store closed.
		return !errors.Is(err, ErrConflict) && !errors.Is(err, ErrUnavailable)
	}
	defer func() {
		s.unregister(hold)
		hold.cancel(ErrClaimEnded)
	}()
	ctx, cancel := s.clock.WithTimeout(ctx, s.endTimeout)
	defer cancel()
	rec, _, err := s.get(ctx, k)
	if err != nil {
		return false
	}
	step := kernel.Reap(kernelRecord(rec), owner, attempt, seen, s.now(), l.until)
	if step == kernel.ReapAbandon {
		hold.won(rec, nil) // the lost write landed
	}
	if step == kernel.ReapFence {
		var left attempted
		a, err := s.runClaim(ctx, hold, &claimConfig{attempt: attempt, fence: true, overMoved: l.overMoved, setRev: l.fenceSet()}, &left)
		if err != nil {
			return false
		}
		if a.Verdict == kernel.Won {
			hold.won(storeRecord(k, a.Record), nil)
		}
		if step = kernel.ReapFenced(a, owner, seen, l.until); step == kernel.ReapDone && a.Verdict == kernel.Won {
			s.reaped.Add(1)
			s.log.Info("idem: fenced a claim whose write had an unknown outcome", "key", k.Digest())
		}
		if step == kernel.ReapCheck {
			if rec, _, err = s.get(ctx, k); err != nil {
				return false
			}
			if step = kernel.ReapChecked(kernelRecord(rec), owner, attempt); step == kernel.ReapAbandon {
				hold.won(rec, nil)
			}
		}
	}
	if step != kernel.ReapAbandon {
		return step == kernel.ReapDone
	}
	if err := hold.Abandon(ctx); errors.Is(err, ErrUnavailable) {
		return false
	}
	s.reaped.Add(1)
	s.log.Info("idem: abandoned a claim whose write had an unknown outcome", "key", k.Digest(), "token", int64(hold.token))
	return true
}
