package check

import (
	"fmt"
	"slices"
	"time"

	"github.com/idem-dev/idem/internal/kernel"
)

// A client retries one key through its process, as a service calling
// idem's Run does: claim; on a claim, two effects downstream (with a
// recovery point between them in scopes that checkpoint), checking the
// claim before each, then save the outcome; on a replay, done; on a
// conflict or an error, claim again later (a few times).

type cpc uint8

const (
	cIdle  cpc = iota // claims next (if it has tries left)
	cClaim            // a claim machine runs
	cHold             // holds a claim: its next step is due
	cWrite            // a claim's write machine runs
	cDone
	cHung  // stopped for good while it holds a claim: its worker is stuck
	cRoute // on a shard set: its key is handed over to its new shard first
)

type client struct {
	id      int
	cl      int // the cluster of its current claim (a shard set's)
	fwd     *kernel.Forward
	above   int64 // the epoch the key's new shard must be above
	key     int
	pc      cpc
	tries   int
	attempt string
	claim   *kernel.Claim
	write   *kernel.Write
	wkind   kernel.WriteKind
	held    kernel.Held
	step    int  // 0 effect 1, 1 checkpoint, 2 effect 2, 3 end
	lost    bool // its process told it the claim ended (its session was lost)
	maybe   bool // a try of its current operation may have landed (the model knows)
}

func (c client) clone() client {
	if c.claim != nil {
		c.claim = c.claim.Clone()
	}
	if c.write != nil {
		c.write = c.write.Clone()
	}
	if c.fwd != nil {
		c.fwd = c.fwd.Clone()
	}
	return c
}

func (c client) appendState(b []byte) []byte {
	b = appendInts(b, int64(c.id), int64(c.cl), c.above, int64(c.key), int64(c.pc), int64(c.tries), int64(c.wkind), int64(c.step))
	if c.fwd != nil {
		b = c.fwd.AppendState(append(b, 3))
	}
	b = append(b, boolByte(c.lost), boolByte(c.maybe))
	b = appendStr(b, c.attempt)
	if c.claim != nil {
		b = c.claim.AppendState(append(b, 1))
	}
	if c.write != nil {
		b = c.write.AppendState(append(b, 2))
	}
	if c.pc == cHold || c.pc == cWrite {
		b = c.held.AppendState(b)
	}
	return b
}

// view is process p's view for a decision on key, on cluster cl.
func (x *explorer) view(w *world, p *proc, cl, key int) kernel.View {
	return kernel.View{Now: at(w.clockOf(p)), Epoch: p.epoch[cl], SetRev: p.setRev[cl],
		HeldHere: func(a string) bool { return p.holds(key, a, w.clockOf(p)) }}
}

func (x *explorer) cfg() kernel.Config {
	return kernel.Config{Keys: keys, Retention: time.Duration(x.scope.Retention) * Step, Epochs: x.scope.Epochs || x.scope.Shards}
}

// clientReady reports whether client c has a step to take.
func (x *explorer) clientReady(c *client) bool {
	return c.pc != cDone && c.pc != cHung && !(c.pc == cIdle && c.tries > x.scope.Retries)
}

// clientSends reports whether the client's next step sends a Txn (and so
// may meet a fault).
func (x *explorer) clientSends(w *world, p *proc, c *client) bool {
	switch c.pc {
	case cIdle:
		// A new claim's first step is its create, after a read that may
		// replay instead.
		rec, _ := x.read(w, 0, recordKey(c.key))
		return !x.scope.ReadFirst || kernel.ReadDone(rec, fingerprint(c.key), at(w.clockOf(p))) == 0
	case cClaim:
		return peek(c.claim, x.view(w, p, c.cl, c.key)) == kernel.ActSend
	case cWrite:
		return peek(c.write, x.view(w, p, c.cl, c.key)) == kernel.ActSend
	case cRoute:
		return c.fwd != nil && peek(c.fwd, x.view(w, p, 0, c.key)) == kernel.ActSend
	case cHold:
		return c.step == 1 || c.step == 3 || x.claimOver(w, p, c)
	}
	return false
}

// clientStep takes client c's next step, the Txn it sends (if any)
// meeting fate f.
func (x *explorer) clientStep(w *world, p *proc, c *client, f fate) error {
	switch c.pc {
	case cIdle:
		c.tries++
		// Random attempt ids of one client share a long prefix.
		c.attempt = fmt.Sprintf("attempt-00000000-p%d.c%d.%d", p.id, c.id, c.tries)
		if x.scope.ReadFirst {
			if done, err := x.readFirst(w, p, c); done || err != nil {
				return err
			}
		}
		if x.scope.Shards {
			return x.route(w, p, c, f)
		}
		x.startClaim(p, c, 0, false)
		return x.claimStep(w, p, c, f)
	case cRoute:
		return x.routeStep(w, p, c, f)
	case cClaim:
		return x.claimStep(w, p, c, f)
	case cHold:
		return x.holdStep(w, p, c, f)
	case cWrite:
		return x.writeStep(w, p, c, f)
	}
	return nil
}

// startClaim begins the client's claim on cluster cl (existing: only a
// live record there, WithoutCreate; else, on a shard set, the claim of the
// key's home by the set the process routes by, which replaces a Moved
// record there, ReplaceMoved, as shard's route does: a Moved record may be
// what an older set's change left, taken back since. Only the home's
// guards then stop a process that routes by an older set from replacing
// the Moved record of a key that lives on its new home.)
func (x *explorer) startClaim(p *proc, c *client, cl int, existing bool) {
	p.hold = append(p.hold, attemptRef{key: c.key, attempt: c.attempt})
	c.maybe, c.cl, c.pc = false, cl, cClaim
	c.claim = kernel.NewClaim(x.cfg(), kernel.ClaimRequest{Key: recordKey(c.key), Fingerprint: fingerprint(c.key),
		Owner: p.owner(), Attempt: c.attempt, Deadline: time.Duration(x.scope.Deadline) * Step,
		Existing: existing, OverMoved: x.scope.Shards && !existing, SetRev: p.setRev[cl]})
}

// readFirst looks for the key's done record without a write, as a claim
// that reads first does (a serializable read, or the replay cache): the
// kernel's ReadDone says whether to replay it. It reports whether the
// client is done.
func (x *explorer) readFirst(w *world, p *proc, c *client) (bool, error) {
	rec, _ := x.read(w, 0, recordKey(c.key))
	switch kernel.ReadDone(rec, fingerprint(c.key), at(w.clockOf(p))) {
	case kernel.Replay:
		c.pc = cDone
		return true, x.replayed(w, p, c.key, rec)
	case kernel.Mismatch:
		c.pc = cDone
		return true, nil
	}
	return false, nil
}

// claimStep drives the client's claim machine one action.
func (x *explorer) claimStep(w *world, p *proc, c *client, f fate) error {
	wr := writer{cl: c.cl, proc: p.id, owner: p.owner(), kind: wClaim, attempt: c.attempt, now: w.clockOf(p)}
	if err := x.drive(w, p, c.key, c.claim, wr, f); err != nil {
		return err
	}
	c.maybe = c.maybe || f == fateLost || f == fateHeld || f == fateGiveUp
	if !done(c.claim, x.view(w, p, c.cl, c.key)) {
		return nil
	}
	a := c.claim.Answer()
	unc, seen := c.claim.Uncertain()
	over, setRev := c.claim.Request().OverMoved, c.claim.Request().SetRev
	if err := notSent(a, c.maybe); err != nil {
		return err
	}
	if x.log != nil {
		x.note("p%d's claim (attempt %s) answered %v %s (uncertain %v, seen %d)", p.id, c.attempt, a.Verdict, describe(a.Record), unc, seen)
	}
	c.claim = nil
	// A claim lost while its Txn was on its way (its process noticed its
	// session ended: a new owner now) is never handed out.
	if a.Verdict == kernel.Won && a.Record.Owner == p.owner() {
		c.held, c.pc, c.step, c.lost = kernel.HeldBy(recordKey(c.key), a.Record), cHold, 0, false
		p.holdUntil(c.key, c.attempt, c.held)
		return x.granted(w, p, c.cl, recordKey(c.key), c.attempt, a)
	}
	p.release(c.key, c.attempt)
	if unc && a.Verdict != kernel.Won {
		p.bg = append(p.bg, &task{kind: tReap, cl: c.cl, key: c.key, attempt: c.attempt, owner: p.owner(), seen: seen,
			until: w.clockOf(p) + MaxDelay + 1, over: over, setRev: setRev})
	}
	if a.Verdict == kernel.Replay {
		if err := x.replayed(w, p, c.key, a.Record); err != nil {
			return err
		}
		c.pc = cDone
		return nil
	}
	c.pc = cIdle
	return nil
}

// claimOver reports whether the client's claim has ended as far as its
// process knows: its session was lost, or its deadline or its record's
// expiry passed by its clock. A client checks before each effect.
func (x *explorer) claimOver(w *world, p *proc, c *client) bool {
	now := at(w.clockOf(p))
	return c.lost || !c.held.Deadline.IsZero() && !now.Before(c.held.Deadline) || !now.Before(c.held.Expires)
}

// holdStep takes the next step of a held claim.
func (x *explorer) holdStep(w *world, p *proc, c *client, f fate) error {
	if x.claimOver(w, p, c) {
		return x.startWrite(w, p, c, kernel.WriteRequest{Kind: kernel.Abandon}, f) // the work's context ended: EndAbandon
	}
	switch c.step {
	case 0, 2:
		n := c.step/2 + 1
		c.step++
		if !x.scope.Checkpoint && c.step == 1 {
			c.step = 3
		}
		return x.effect(w, p, c, n)
	case 1:
		return x.startWrite(w, p, c, kernel.WriteRequest{Kind: kernel.Checkpoint, Checkpoint: []byte("1")}, f)
	}
	return x.startWrite(w, p, c, kernel.WriteRequest{Kind: kernel.Complete, Outcome: outcomeOf(c.attempt)}, f)
}

// outcomeOf is the outcome a client saves: with a header of no values, as
// an HTTP response may carry, which a record does not keep.
func outcomeOf(attempt string) *kernel.Outcome {
	return &kernel.Outcome{Status: 201, Header: map[string][]string{"Location": {}}, Body: []byte("by " + attempt)}
}

func (x *explorer) startWrite(w *world, p *proc, c *client, req kernel.WriteRequest, f fate) error {
	c.write, c.wkind, c.pc, c.maybe = kernel.NewWrite(x.cfg(), c.held, req), req.Kind, cWrite, false
	return x.writeStep(w, p, c, f)
}

// writeStep drives the client's write machine one action, and takes its
// answer as Run does: a final write whose outcome is unknown is retried
// in the background, the claim held meanwhile.
func (x *explorer) writeStep(w *world, p *proc, c *client, f fate) error {
	wr := writer{cl: c.cl, proc: p.id, owner: p.owner(), kind: wWrite, attempt: c.attempt, token: c.held.Token, now: w.clockOf(p)}
	if err := x.drive(w, p, c.key, c.write, wr, f); err != nil {
		return err
	}
	c.maybe = c.maybe || f == fateLost || f == fateHeld || f == fateGiveUp
	if !done(c.write, x.view(w, p, c.cl, c.key)) {
		return nil
	}
	a, ends, h := c.write.Answer(), c.write.Ends(), c.write.Held()
	if err := notSent(a, c.maybe); err != nil {
		return err
	}
	if x.log != nil {
		x.note("p%d's %v answered %v %s (ends %v)", p.id, c.wkind, a.Verdict, a.Why, ends)
	}
	req := kernel.WriteRequest{Kind: c.wkind}
	if c.wkind == kernel.Complete {
		req.Outcome = outcomeOf(c.attempt)
	}
	c.write, c.held = nil, h
	if err := x.told(w, c.cl, c.key, c.wkind, h, a); err != nil {
		return err
	}
	switch {
	case a.Verdict == kernel.Error && c.wkind.Final():
		// Unknown: retried in the background; this process holds the key.
		p.bg = append(p.bg, &task{kind: tFinal, cl: c.cl, key: c.key, attempt: c.attempt, held: h, req: req})
		c.pc = cDone
	case a.Verdict == kernel.Landed && !ends:
		c.pc, c.step = cHold, c.step+1 // a checkpoint landed: the next effect
	case a.Verdict == kernel.Error:
		return x.startWrite(w, p, c, kernel.WriteRequest{Kind: kernel.Abandon}, fateDeliver) // a checkpoint failed: the work ends, abandoned
	default:
		p.release(c.key, c.attempt)
		c.pc = cDone
		if c.wkind == kernel.Abandon {
			c.pc = cIdle // the client claims again (a takeover resumes it)
		}
	}
	return nil
}

// machine is what drive needs of a kernel machine.
type machine interface {
	Next(kernel.View) kernel.Action
}

// peek returns the kind of m's next action, decided on a copy: the machine
// itself decides when its step is taken, at that step's time.
func peek(m machine, v kernel.View) kernel.ActionKind {
	switch m := m.(type) {
	case *kernel.Claim:
		return m.Clone().Next(v).Kind
	case *kernel.Write:
		return m.Clone().Next(v).Kind
	case *kernel.Forward:
		return m.Clone().Next(v).Kind
	}
	panic("check: a machine that cannot be copied")
}

// done reports whether m has its answer now (deciding it, if so).
func done(m machine, v kernel.View) bool {
	if peek(m, v) != kernel.ActDone {
		return false
	}
	m.Next(v)
	return true
}

// drive performs a machine's next action on the model, on the writer's
// cluster: a read, an owner read, or a Txn that meets fate f.
func (x *explorer) drive(w *world, p *proc, key int, m machine, wr writer, f fate) error {
	a := m.Next(x.view(w, p, wr.cl, key))
	switch a.Kind {
	case kernel.ActRead:
		rec, rev := x.read(w, wr.cl, recordKey(key))
		switch m := m.(type) {
		case *kernel.Claim:
			m.Read(rec, rev)
		case *kernel.Write:
			m.Read(rec, nil)
		case *kernel.Forward:
			m.Read(rec)
		}
	case kernel.ActOwner:
		_, alive := w.db(wr.cl).Get(keys.Owner(a.Owner))
		m.(*kernel.Claim).Owner(alive, w.db(wr.cl).Rev(), nil)
	case kernel.ActAwait:
		return fmt.Errorf("model: a claim waits (WithWait is not modelled)")
	case kernel.ActSend:
		r, err := x.send(w, p, a.Txn, wr, f)
		if err != nil {
			return err
		}
		switch m := m.(type) {
		case *kernel.Claim:
			p.learn(wr.cl, m.Sent(r))
		case *kernel.Write:
			m.Sent(r)
		case *kernel.Forward:
			p.learn(wr.cl, m.Sent(r))
		}
	}
	return nil
}

// learn takes what a refused guarded write on cluster cl taught of its
// shard: its epoch, or its shard set (and the set's generation).
func (p *proc) learn(cl int, n kernel.Notes) {
	if n.NewEpoch {
		p.epoch[cl] = n.Epoch
	}
	if n.NewSet {
		p.setRev[cl] = n.Set.Rev
		p.gen = max(p.gen, genOf(n.Set.Value))
	}
}

// lose is p noticing that its session ended: its claims are cancelled
// (a client running one ends it, abandoned), the attempts it holds
// forgotten but those whose outcome it holds, pending in the background
// (and the one its client still runs), and it starts a new session.
func (x *explorer) lose(w *world, p *proc) {
	old := p.owner()
	for i := range p.clients {
		if c := &p.clients[i]; (c.pc == cHold || c.pc == cWrite) && c.held.Owner == old {
			c.lost = true
		}
	}
	p.hold = slices.DeleteFunc(p.hold, func(a attemptRef) bool {
		running := slices.ContainsFunc(p.clients, func(c client) bool {
			return (c.pc == cClaim || c.pc == cHold || c.pc == cWrite) && a.key == c.key && a.attempt == c.attempt
		})
		pending := slices.ContainsFunc(p.bg, func(t *task) bool { return t.kind == tFinal && t.attempt == a.attempt })
		return !running && !pending
	})
	p.inc++
	x.newSession(w, p)
}

// newSession starts p's session (its incarnation's): a lease, and its
// owner key on it, on every cluster (a shard's store has a session of its
// own, on its cluster; they end together, with the process).
func (x *explorer) newSession(w *world, p *proc) {
	p.noticed = false
	p.ownerID = fmt.Sprintf("p%d.%d", p.id, p.inc)
	p.sess = make([]int64, len(w.etcds))
	for cl, db := range w.etcds {
		p.sess[cl] = db.Grant(10)
		_, _ = db.Txn(&kernel.Txn{Then: []kernel.Op{{Kind: kernel.Put, Key: keys.Owner(p.owner()), Value: []byte("x"), Lease: kernel.LeaseID, ID: p.sess[cl]}}})
	}
}
