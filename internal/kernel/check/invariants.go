package check

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/idem-dev/idem/internal/kernel"
)

// The invariants, named as the explorer's (docs/TESTING.md) where they
// are the same promise:
//
//	I1  no key's work has two live owners: a claim is granted only once
//	    every other claim of the key still held has lost its right (its
//	    session ended in etcd, its deadline or its record's expiry passed
//	    by the granting process's clock);
//	I2  an effect (a key's step, at a sink that refuses lower tokens) is
//	    applied again only by a claim that took the key over, with a
//	    greater token;
//	I3  a replay is the key's one saved outcome;
//	I4  a write is told the truth: a Complete told it was not saved did
//	    not save (ever, even from a Txn still in the network), one told it
//	    landed did;
//	I5  checkpoints never go backwards along an operation's history;
//	I11 a record is deleted only by its rule: the sweeper and EvictIf
//	    delete only records past their retention, a release only its own;
//	    a done record is replaced only past its retention;
//	I12 tokens never go backwards: every record a key holds carries a
//	    token at least the highest before it;
//	W   a record is written only by the claim that holds it: a claim's
//	    write (checkpoint, complete, abandon, release) lands only on a
//	    record of its own token, never brings back a record past its
//	    expiry (others took it for forgotten), and a claim is written
//	    only under a session that lives;
//	I16 "not sent" is the truth: an operation that fails saying its last
//	    try was not sent (and not that an earlier one may have landed) had
//	    no try that may have landed;
//	I14 the reaper never abandons a claim a client holds with its right;
//	L   liveness, where nothing more can happen: every key is done,
//	    absent, or free to claim by the rules, and a claim of a key the
//	    rules call free is granted (the probe).

// violation is an invariant broken.
type violation struct{ name, what string }

func (v violation) Error() string { return v.name + ": " + v.what }

func broke(name, format string, args ...any) violation {
	return violation{name, fmt.Sprintf(format, args...)}
}

// granted checks a claim won by p on cluster cl (I1): the claim whose
// record it replaced, if any, no longer has its right by p's clock (its
// session ended in etcd, or its deadline or its record's expiry passed);
// nor does any claim of the key on another cluster (a key is never live
// on two shards).
func (x *explorer) granted(w *world, p *proc, cl int, key, attempt string, a kernel.Answer) error {
	now := at(w.clockOf(p))
	for _, q := range w.procs {
		for _, h := range q.holding() {
			replaced := h.cl == cl && a.Previous != nil && h.Token == a.Previous.Token
			if h.Key != key || h.Attempt == attempt || !replaced && h.cl == cl {
				continue
			}
			_, alive := w.db(h.cl).Get(keys.Owner(h.Owner))
			if alive && (h.Deadline.IsZero() || now.Before(h.Deadline)) && now.Before(h.Expires) {
				return broke("I1", "p%d's claim (attempt %s, token %d) took the key over while p%d's claim (attempt %s, token %d) still had its right",
					p.id, attempt, a.Record.Token, q.id, h.Attempt, h.Token)
			}
		}
	}
	return nil
}

// heldAt is a claim held, on its cluster.
type heldAt struct {
	kernel.Held
	cl int
}

// holding is the claims p holds: its client's, while it may still act or
// saves its outcome, and those whose outcome it saves in the background.
// A claim being abandoned is given up: its holder acts no more.
func (p *proc) holding() []heldAt {
	var out []heldAt
	for _, c := range p.clients {
		if c.pc == cHold || c.pc == cHung || c.pc == cWrite && c.wkind != kernel.Abandon {
			out = append(out, heldAt{c.held, c.cl})
		}
	}
	for _, t := range p.bg {
		if t.kind == tFinal && t.req.Kind == kernel.Complete {
			out = append(out, heldAt{t.held, t.cl})
		}
	}
	return out
}

// only returns err if it is an invariant broken: etcd refusing a Txn
// (a lease gone, say) is no violation.
func only(err error) error {
	if v, ok := err.(violation); ok {
		return v
	}
	return nil
}

// effect applies step n of client c's claim at the sink (I2).
func (x *explorer) effect(w *world, p *proc, c *client, n int) error {
	e := effect{key: c.key, step: n, token: c.held.Token, takeovers: c.held.Takeovers, created: c.held.Created.UnixNano()}
	for _, o := range w.sink {
		if o.key == e.key && e.token < o.token {
			return nil // refused downstream: a greater token acted
		}
	}
	for _, o := range w.sink {
		if o.key == e.key && o.step == e.step && o.created == e.created && !(e.token > o.token && e.takeovers > o.takeovers) {
			return broke("I2", "step %d of key %d applied again by token %d (takeovers %d) after token %d (takeovers %d)",
				n, c.key, e.token, e.takeovers, o.token, o.takeovers)
		}
	}
	w.sink = append(w.sink, e)
	return nil
}

// replayed checks a replay (I3): it is the saved outcome of a record that
// a linearizable read would return now, retained by the reader's clock.
func (x *explorer) replayed(w *world, p *proc, key int, rec *kernel.Record) error {
	k := &w.keys[key]
	if rec.Expired(at(w.clockOf(p))) {
		return broke("I3", "key %d replayed from a record past its retention (expired %v)", key, rec.Expires.Sub(epoch0))
	}
	if k.savedFor == rec.Created.UnixNano() && !bytes.Equal(k.saved, rec.Outcome.Body) {
		return broke("I3", "key %d replayed %q, its saved outcome is %q", key, rec.Outcome.Body, k.saved)
	}
	return nil
}

// told checks what a claim's write on cluster cl was told against etcd
// (I4).
func (x *explorer) told(w *world, cl, key int, kind kernel.WriteKind, h kernel.Held, a kernel.Answer) error {
	rec, _ := x.read(w, cl, recordKey(key))
	k := &w.keys[key]
	switch {
	case kind == kernel.Complete && (a.Verdict == kernel.Fenced || a.Verdict == kernel.Ended || a.Verdict == kernel.Expired):
		if rec != nil && rec.State == kernel.Done && rec.Token == h.Token {
			return broke("I4", "a Complete (token %d) told %v saved its outcome", h.Token, a.Verdict)
		}
		k.toldLost = append(k.toldLost, h.Token)
	case kind == kernel.Complete && a.Verdict == kernel.Landed:
		if rec == nil || rec.State != kernel.Done || rec.Token != h.Token {
			return broke("I4", "a Complete (token %d) told it landed, but the record is %v", h.Token, rec)
		}
	case kind == kernel.Checkpoint && a.Verdict == kernel.Landed:
		if rec == nil || rec.Token != h.Token || rec.State != kernel.InFlight && rec.State != kernel.Done {
			return broke("I4", "a Checkpoint (token %d) told it landed, but the record is %v", h.Token, rec)
		}
	}
	return nil
}

// abandonsHeld checks a reaper about to abandon a claim (I14).
func (x *explorer) abandonsHeld(w *world, p *proc, t *task) error {
	now := at(w.clockOf(p))
	for _, q := range w.procs {
		for _, h := range q.holding() {
			if h.Key != recordKey(t.key) || h.cl != t.cl || h.Attempt != t.attempt || h.Token != t.held.Token {
				continue
			}
			_, alive := w.db(h.cl).Get(keys.Owner(h.Owner))
			if alive && (h.Deadline.IsZero() || now.Before(h.Deadline)) {
				return broke("I14", "p%d's reaper abandons the claim p%d holds with its right (attempt %s)", p.id, q.id, h.Attempt)
			}
		}
	}
	return nil
}

// landed checks every record a Txn changed (I4, I5, I11, I12, W).
func (x *explorer) landed(w *world, before, after []*kernel.Record, wr writer) error {
	for i := range before {
		b, a := before[i], after[i]
		if a != nil && b != nil && a.Revision == b.Revision {
			continue
		}
		if a == nil && b == nil {
			continue
		}
		if err := x.write1(w, i, b, a, wr); err != nil {
			return err
		}
	}
	return nil
}

// write1 checks one record's change from b to a by wr.
func (x *explorer) write1(w *world, key int, b, a *kernel.Record, wr writer) error {
	k := &w.keys[key]
	now := at(wr.now)
	claimWrite := wr.kind == wWrite || wr.kind == wFinal || wr.kind == wReap && wr.token != 0
	_, sessionLive := w.db(wr.cl).Get(keys.Owner(wr.owner))
	switch {
	case wr.kind == wClaim && a != nil && a.Owner != "" && a.Owner != kernel.DeadlineOwner && !sessionLive:
		return broke("W", "a claim (attempt %s) was written under session %s, which has ended", wr.attempt, a.Owner)
	case claimWrite && a != nil && a.State == kernel.InFlight && b != nil && b.State == kernel.InFlight && b.Expired(now):
		return broke("W", "a write of the claim with token %d brought its record back past its expiry (%v, now %v)", wr.token, b.Expires.Sub(epoch0), now.Sub(epoch0))
	case claimWrite && (b == nil || b.Token != wr.token || b.State == kernel.InFlight && !kernel.SameAttempt(b.Attempt, wr.attempt)):
		return broke("W", "a write of the claim with token %d (attempt %s) landed on %v", wr.token, wr.attempt, b)
	case a == nil && (wr.kind == wSweep || wr.kind == wEvict) && now.Before(b.Expires):
		return broke("I11", "a live record (expires %v, now %v) was deleted by the %s", b.Expires, now, [...]string{wSweep: "sweeper", wEvict: "EvictIf"}[wr.kind])
	case a != nil && b != nil && b.State == kernel.Done && !b.Expired(now) && !claimWrite:
		return broke("I11", "a done record (token %d) was replaced before its expiry by %v", b.Token, a)
	case a == nil:
		return nil
	case a.Token < k.maxToken:
		return broke("I12", "key %d's token went back from %d to %d", key, k.maxToken, a.Token)
	case a.State == kernel.Done && slices.Contains(k.toldLost, a.Token):
		return broke("I4", "a Complete told its outcome was not saved (token %d) saved it", a.Token)
	case a.State == kernel.Done && k.savedFor == a.Created.UnixNano() && !bytes.Equal(k.saved, a.Outcome.Body):
		return broke("I3", "a second outcome %q saved for key %d, after %q", a.Outcome.Body, key, k.saved)
	case a.State == kernel.InFlight && k.ckptFor == a.Created.UnixNano() && string(a.Checkpoint) < k.checkpoint:
		return broke("I5", "key %d's checkpoint went back from %q to %q", key, k.checkpoint, a.Checkpoint)
	}
	k.maxToken = max(k.maxToken, a.Token)
	switch a.State {
	case kernel.Done:
		k.saved, k.savedFor = a.Outcome.Body, a.Created.UnixNano()
	case kernel.InFlight:
		k.checkpoint, k.ckptFor = string(a.Checkpoint), a.Created.UnixNano()
	}
	return nil
}

// notSent checks an operation's answer against what the model knows of
// its tries (I16): a failure that says its last try was not sent, without
// saying an earlier one may have landed, comes from an operation none of
// whose tries may have landed.
func notSent(a kernel.Answer, maybe bool) error {
	if a.Verdict != kernel.Error || !errors.Is(a.Err, errNotSent) || !maybe {
		return nil
	}
	if a.EarlierMayHaveLanded && strings.HasPrefix(a.Err.Error(), "an earlier try may have landed") {
		return nil
	}
	return broke("I16", "an operation failed with %q (earlier may have landed: %v), but a try of it may have landed", a.Err, a.EarlierMayHaveLanded)
}
