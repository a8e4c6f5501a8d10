package check

import (
	"fmt"
	"strconv"

	"github.com/idem-dev/idem/internal/kernel"
)

// A shard set of two clusters (Scope.Shards), as package shard builds
// one: each cluster records the shard set in force (the value
// kernel.ShardSetValue); the first set ("g1") places every key on cluster
// 0; the second ("g2") on cluster 1, handing them over from cluster 0 (its
// previous placement). A nemesis installs the second on cluster 0 (the
// arbiter); processes learn it when a guarded write of theirs is refused
// there, or when they restart, and write it on cluster 1 before they
// claim there (shard's ensure). Every claim, enqueue and hand-over
// compares its cluster's epoch and set (the kernel's guards).

// genOf reads a shard set's generation ("g2": 2).
func genOf(v []byte) int64 {
	if len(v) < 2 || v[0] != 'g' {
		return 0
	}
	n, _ := strconv.ParseInt(string(v[1:]), 10, 64)
	return n
}

func setValue(gen int64) []byte { return []byte(fmt.Sprint("g", gen)) }

// setOn returns the set cluster cl records: its generation and revision.
func (w *world) setOn(cl int) (int64, int64) {
	kv, ok := w.db(cl).Get(keys.Set())
	if !ok {
		return 0, 0
	}
	return genOf(kv.Value), kv.ModRev
}

// learnSets is a process reading the set and epoch every cluster records,
// as a store does when it starts (loadEpoch).
func (w *world) learnSets(p *proc) {
	p.epoch, p.setRev = make([]int64, len(w.etcds)), make([]int64, len(w.etcds))
	for cl := range w.etcds {
		gen, rev := w.setOn(cl)
		p.epoch[cl], p.setRev[cl] = w.epoch(cl), rev
		p.gen = max(p.gen, gen)
	}
}

// route begins a client's claim on a shard set, as shard.Store.route
// does: under the first set, on cluster 0; under the second, the key is
// first handed over from cluster 0 (Forward, guarded by the set the
// process knows there).
func (x *explorer) route(w *world, p *proc, c *client, f fate) error {
	if p.gen < 2 {
		x.startClaim(p, c, 0, false)
		return x.claimStep(w, p, c, f)
	}
	c.fwd = kernel.NewForward(x.cfg(), kernel.ForwardRequest{Key: recordKey(c.key), To: "b", SetRev: p.setRev[0]})
	c.pc = cRoute
	return x.routeStep(w, p, c, f)
}

// routeStep drives the hand-over one action. A live record on cluster 0
// keeps the key there (claimed only while it lives: WithoutCreate); once
// Moved, cluster 1 records the second set (ensure), its epoch is raised
// above the Moved record's, and the key is claimed there (ReplaceMoved).
// A set that changed (learnt) or an error routes again.
func (x *explorer) routeStep(w *world, p *proc, c *client, f fate) error {
	wr := writer{cl: 0, proc: p.id, owner: p.owner(), kind: wMove, attempt: c.attempt, now: w.clockOf(p)}
	if err := x.drive(w, p, c.key, c.fwd, wr, f); err != nil {
		return err
	}
	if !done(c.fwd, x.view(w, p, 0, c.key)) {
		return nil
	}
	a := c.fwd.Answer()
	c.fwd = nil
	switch {
	case a.Verdict == kernel.Found && a.Record.State != kernel.Moved:
		x.startClaim(p, c, 0, true)
	case a.Verdict == kernel.Landed || a.Verdict == kernel.Found:
		x.ensure(w, p, 1)
		x.raiseAbove(w, p, 1, a.Record.Epoch)
		x.startClaim(p, c, 1, false)
	default:
		c.pc = cIdle
	}
	return nil
}

// ensure writes the set p routes by on cluster cl if it records an older
// one (a compare-and-set, only ever forward), and notes its revision.
func (x *explorer) ensure(w *world, p *proc, cl int) {
	gen, rev := w.setOn(cl)
	if gen < p.gen {
		if _, err := w.db(cl).Txn(keys.SetValue(keys.Set(), setValue(p.gen), rev, kernel.NoLease, 0)); err == nil {
			gen, rev = w.setOn(cl)
		}
	}
	p.setRev[cl] = rev
	p.gen = max(p.gen, gen)
}

// raiseAbove makes cluster cl's epoch greater than above, as the route
// does before a key is claimed on its home: only when the epoch p believes
// in is not above already (RaiseEpoch reads the epoch, then moves it).
func (x *explorer) raiseAbove(w *world, p *proc, cl int, above int64) {
	if p.epoch[cl] > above {
		return
	}
	e := w.epoch(cl)
	if e <= above {
		if _, err := w.db(cl).Txn(keys.RaiseEpoch(e, above+1)); err == nil {
			e = above + 1
		}
	}
	p.epoch[cl] = e
}

// changeSet installs the second set on cluster 0, the arbiter (a
// compare-and-set from the first).
func (x *explorer) changeSet(w *world) {
	gen, rev := w.setOn(0)
	if gen == 1 {
		_, _ = w.db(0).Txn(keys.SetValue(keys.Set(), setValue(2), rev, kernel.NoLease, 0))
	}
}
