package check

import (
	"github.com/idem-dev/idem/internal/kernel"
)

// A process's background writes, as etcdstore runs them: the reaper of a
// claim whose claim write had an unknown outcome, and a final write
// (complete, abandon) whose outcome was unknown, retried until it lands
// or is refused.

type tkind uint8

const (
	tReap  tkind = iota
	tFinal       // a final write retried
)

type task struct {
	kind    tkind
	cl      int // the cluster of its claim
	key     int
	attempt string
	owner   string // reap: the session the lost write was made under
	seen    int64  // reap: the highest revision the claim saw
	until   int64  // reap: until when (seconds, its clock) the claim's lost writes may land
	phase   uint8  // reap: 0 read, 1 fencing claim, 2 abandon, 3 read once more (ReapCheck)
	over    bool   // reap: the claim replaced Moved records (OverMoved): so does its fence,
	setRev  int64  // under the shard set the claim compared
	claim   *kernel.Claim
	write   *kernel.Write
	held    kernel.Held
	req     kernel.WriteRequest
}

func (t *task) clone() *task {
	c := *t
	if t.claim != nil {
		c.claim = t.claim.Clone()
	}
	if t.write != nil {
		c.write = t.write.Clone()
	}
	return &c
}

func (t *task) appendState(b []byte) []byte {
	b = appendInts(b, int64(t.kind), int64(t.cl), int64(t.key), t.seen, t.until, int64(t.phase), int64(t.req.Kind), t.setRev)
	b = appendStr(appendStr(append(b, boolByte(t.over)), t.attempt), t.owner)
	b = t.held.AppendState(b)
	if t.claim != nil {
		b = t.claim.AppendState(append(b, 1))
	}
	if t.write != nil {
		b = t.write.AppendState(append(b, 2))
	}
	return b
}

// reapFence is the reaper's fencing claim, a step at a time; it reports
// whether the reaper is over.
func (x *explorer) reapFence(w *world, p *proc, t *task, f fate) (bool, error) {
	wr := writer{cl: t.cl, proc: p.id, owner: p.owner(), kind: wReap, attempt: t.attempt, now: w.clockOf(p)}
	if err := x.drive(w, p, t.key, t.claim, wr, f); err != nil {
		return false, err
	}
	if !done(t.claim, x.view(w, p, t.cl, t.key)) {
		return false, nil
	}
	a := t.claim.Answer()
	t.claim = nil
	if a.Verdict == kernel.Won {
		if err := x.granted(w, p, t.cl, recordKey(t.key), t.attempt, a); err != nil {
			return false, err // the fence took a claim over
		}
	}
	switch kernel.ReapFenced(a, t.owner, t.seen, at(t.until)) {
	case kernel.ReapAbandon:
		t.held, t.phase = kernel.HeldBy(recordKey(t.key), a.Record), 2
		t.write = kernel.NewWrite(x.cfg(), t.held, kernel.WriteRequest{Kind: kernel.Abandon})
		return false, nil
	case kernel.ReapRetry:
		t.phase = 0
		p.release(t.key, t.attempt)
		return false, nil
	case kernel.ReapCheck:
		t.phase = 3 // read once more, at the next step
		return false, nil
	}
	return true, nil
}

// fenceSet is the shard set a reaper's fence compares (kernel.FenceSet).
func (t *task) fenceSet(p *proc) int64 { return kernel.FenceSet(t.over, t.setRev, p.setRev[t.cl]) }

// taskSends reports whether the task's next step sends a Txn.
func (x *explorer) taskSends(w *world, p *proc, t *task) bool {
	switch {
	case t.claim != nil:
		return peek(t.claim, x.view(w, p, t.cl, t.key)) == kernel.ActSend
	case t.write != nil:
		return peek(t.write, x.view(w, p, t.cl, t.key)) == kernel.ActSend
	}
	return t.kind == tFinal
}

// taskStep takes task i of p one step, a Txn it sends meeting fate f; it
// reports whether the task is over.
func (x *explorer) taskStep(w *world, p *proc, t *task, f fate) (bool, error) {
	if t.kind == tFinal {
		return x.finalStep(w, p, t, f)
	}
	return x.reapStep(w, p, t, f)
}

// finalStep retries a final write until it lands or is refused; the
// process holds the claim's attempt meanwhile.
func (x *explorer) finalStep(w *world, p *proc, t *task, f fate) (bool, error) {
	if t.write == nil {
		t.write = kernel.NewWrite(x.cfg(), t.held, t.req)
	}
	wr := writer{cl: t.cl, proc: p.id, owner: p.owner(), kind: wFinal, attempt: t.attempt, token: t.held.Token, now: w.clockOf(p)}
	if err := x.drive(w, p, t.key, t.write, wr, f); err != nil {
		return false, err
	}
	if !done(t.write, x.view(w, p, t.cl, t.key)) {
		return false, nil
	}
	a, h := t.write.Answer(), t.write.Held()
	t.write, t.held = nil, h
	if err := x.told(w, t.cl, t.key, t.req.Kind, h, a); err != nil {
		return false, err
	}
	if a.Verdict == kernel.Error {
		return false, nil // tried again
	}
	p.release(t.key, t.attempt)
	return true, nil
}

// reapStep is the reaper's reapOnce, a step at a time: it reads the
// record, and abandons its own claim or fences the key, as the kernel's
// Reap and ReapFenced say.
func (x *explorer) reapStep(w *world, p *proc, t *task, f fate) (bool, error) {
	if p.owner() != t.owner {
		return true, nil // the session ended: the lost write can no longer land
	}
	switch t.phase {
	case 0:
		rec, _ := x.read(w, t.cl, recordKey(t.key))
		switch kernel.Reap(rec, t.owner, t.attempt, t.seen, at(w.clockOf(p)), at(t.until)) {
		case kernel.ReapRetry:
			return false, nil
		case kernel.ReapDone:
			return true, nil
		case kernel.ReapAbandon:
			t.held, t.phase = kernel.HeldBy(recordKey(t.key), rec), 2
			t.write = kernel.NewWrite(x.cfg(), t.held, kernel.WriteRequest{Kind: kernel.Abandon})
		default:
			t.phase = 1
			t.claim = kernel.NewClaim(x.cfg(), kernel.ClaimRequest{Key: recordKey(t.key), Fingerprint: fingerprint(t.key),
				Owner: t.owner, Attempt: t.attempt, Fence: true, OverMoved: t.over, SetRev: t.fenceSet(p)})
		}
		p.hold = append(p.hold, attemptRef{key: t.key, attempt: t.attempt})
		return false, nil
	case 1:
		if over, err := x.reapFence(w, p, t, f); !over || err != nil {
			return false, err
		}
	case 3:
		rec, _ := x.read(w, t.cl, recordKey(t.key))
		if kernel.ReapChecked(rec, t.owner, t.attempt) == kernel.ReapAbandon {
			t.held, t.phase = kernel.HeldBy(recordKey(t.key), rec), 2
			t.write = kernel.NewWrite(x.cfg(), t.held, kernel.WriteRequest{Kind: kernel.Abandon})
			return false, nil
		}
	case 2:
		wr := writer{cl: t.cl, proc: p.id, owner: p.owner(), kind: wReap, attempt: t.attempt, token: t.held.Token, now: w.clockOf(p)}
		if err := x.abandonsHeld(w, p, t); err != nil {
			return false, err
		}
		if err := x.drive(w, p, t.key, t.write, wr, f); err != nil {
			return false, err
		}
		if !done(t.write, x.view(w, p, t.cl, t.key)) {
			return false, nil
		}
		if t.write.Answer().Verdict == kernel.Error {
			t.write, t.phase = nil, 0
			p.release(t.key, t.attempt)
			return false, nil
		}
	}
	p.release(t.key, t.attempt)
	return true, nil
}
