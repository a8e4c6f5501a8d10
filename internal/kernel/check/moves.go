package check

import (
	"fmt"
	"slices"
	"strings"

	"github.com/idem-dev/idem/internal/etcdmodel"
	"github.com/idem-dev/idem/internal/kernel"
)

// fate is what becomes of a Txn a process sends.
type fate uint8

const (
	fateDeliver fate = iota // applied (or refused), and its answer comes back
	fateLost                // applied, and its answer lost
	fateHeld                // held in the network (it may land later, or never); the try fails
	fateNotSent             // it never left the process: its caller's context ended in the queue
	fateGiveUp              // held in the network, and the caller's context ends: no retry
)

var fateNames = [...]string{"", " (answer lost)", " (held in the network)", " (not sent)", " (held, caller gives up)"}

type mkind uint8

const (
	mClient mkind = iota
	mTask
	mNotice
	mCrash
	mExpire
	mExpireDead
	mLand
	mDrop
	mTick
	mRaise
	mSweepList
	mSweepDelete
	mEvictRead
	mEvictDo
	mHang
	mWait
	mChangeSet
)

// move is one transition of a world.
type move struct {
	kind      mkind
	proc, idx int
	fate      fate
}

func (m move) String() string {
	f := fateNames[m.fate]
	switch m.kind {
	case mClient:
		return fmt.Sprintf("p%d client %d step%s", m.proc, m.idx, f)
	case mTask:
		return fmt.Sprintf("p%d background task %d step%s", m.proc, m.idx, f)
	case mNotice:
		return fmt.Sprintf("p%d notices its session ended, starts a new one", m.proc)
	case mCrash:
		return fmt.Sprintf("p%d crashes (kill -9) and restarts", m.proc)
	case mExpire:
		return fmt.Sprintf("p%d's session lease expires in etcd", m.proc)
	case mExpireDead:
		return fmt.Sprintf("p%d's dead incarnation's session expires", m.proc)
	case mLand:
		return fmt.Sprintf("held Txn %d lands", m.idx)
	case mDrop:
		return fmt.Sprintf("held Txn %d is lost for good", m.idx)
	case mTick:
		return "the clock moves a second"
	case mRaise:
		return "the shard epoch is raised"
	case mSweepList:
		return fmt.Sprintf("the sweeper lists retention bucket %d", m.idx)
	case mSweepDelete:
		return "the sweeper deletes what it listed (Lease == bucket)"
	case mEvictRead:
		return fmt.Sprintf("an operator reads key %d past its retention", m.idx)
	case mEvictDo:
		return "the operator deletes it if still as read (EvictIf)"
	case mHang:
		return fmt.Sprintf("p%d client %d hangs, its claim held (a stuck handler)", m.proc, m.idx)
	case mWait:
		return "a second passes while only background work waits"
	case mChangeSet:
		return "the second shard set is installed on cluster 0 (the arbiter)"

	}
	return "?"
}

// moves lists every transition enabled in w, in a fixed order.
func (x *explorer) moves(w *world) []move {
	var out []move
	faults := w.used.faults < x.scope.Faults
	withFates := func(m move, sends bool) {
		out = append(out, m)
		if sends && faults {
			for f := fateLost; f <= fateGiveUp; f++ {
				m.fate = f
				out = append(out, m)
			}
		}
	}
	for i, p := range w.procs {
		for j := range p.clients {
			if c := &p.clients[j]; x.clientReady(c) {
				withFates(move{kind: mClient, proc: i, idx: j}, x.clientSends(w, p, c))
				if c.pc == cHold && w.used.hangs < x.scope.Hangs {
					out = append(out, move{kind: mHang, proc: i, idx: j})
				}
			}
		}
		for j, t := range p.bg {
			withFates(move{kind: mTask, proc: i, idx: j}, x.taskSends(w, p, t))
		}
		if !p.noticed && !w.alive(0, p.sess[0]) {
			out = append(out, move{kind: mNotice, proc: i})
		}
		if w.used.crashes < x.scope.Crashes {
			out = append(out, move{kind: mCrash, proc: i})
		}
		if w.used.expiries < x.scope.Expiries && w.alive(0, p.sess[0]) {
			out = append(out, move{kind: mExpire, proc: i})
		}
	}
	for i := range w.net {
		out = append(out, move{kind: mLand, idx: i}, move{kind: mDrop, idx: i})
	}
	if w.used.ticks < x.scope.Ticks {
		out = append(out, move{kind: mTick})
	} else if len(out) > 0 && w.now < int64(x.scope.Ticks+MaxDelay+2) && !slices.ContainsFunc(out, func(m move) bool { return m.kind != mTask }) {
		// Only background work is left, waiting: time passes for it, as
		// its backoff does, up to the landing window past the last tick.
		out = append(out, move{kind: mWait})
	}
	if (x.scope.Epochs || x.scope.Shards) && w.used.raises < x.scope.Raises {
		out = append(out, move{kind: mRaise})
	}
	if x.scope.Shards {
		if gen, _ := w.setOn(0); gen == 1 {
			out = append(out, move{kind: mChangeSet})
		}
	}

	out = append(out, x.envMoves(w)...)
	return out
}

// alive reports whether a lease exists in cluster cl.
func (w *world) alive(cl int, lease int64) bool {
	_, err := w.db(cl).Keys(lease)
	return err == nil
}

// apply returns the world after m, or the invariant m broke.
func (x *explorer) apply(w *world, m move) (*world, error) {
	w = w.clone()
	if m.fate != fateDeliver {
		w.used.faults++
	}
	p := (*proc)(nil)
	if m.kind <= mExpireDead || m.kind == mHang {
		p = w.own(m.proc)
	}
	switch m.kind {
	case mClient:
		return w, x.clientStep(w, p, &p.clients[m.idx], m.fate)
	case mTask:
		done, err := x.taskStep(w, p, p.bg[m.idx], m.fate)
		if done {
			p.bg = slices.Delete(p.bg, m.idx, m.idx+1)
		}
		return w, err
	case mNotice:
		x.lose(w, p)
	case mCrash:
		w.used.crashes++
		x.crash(w, p)
	case mExpire:
		w.used.expiries++
		for cl, l := range p.sess {
			_ = w.db(cl).Expire(l)
		}
	case mLand:
		h := w.net[m.idx]
		w.net = slices.Delete(w.net, m.idx, m.idx+1)
		_, err := x.apply1(w, h.txn, h.writer)
		return w, only(err)
	case mDrop:
		w.net = slices.Delete(w.net, m.idx, m.idx+1)
	case mHang:
		w.used.hangs++
		p.clients[m.idx].pc = cHung
	case mWait:
		w.now++
		w.net = slices.DeleteFunc(w.net, func(h held) bool { return w.now > h.sent+MaxDelay })
	case mTick:
		w.used.ticks++
		w.now++
		// The network forgets what it held too long: it never lands.
		w.net = slices.DeleteFunc(w.net, func(h held) bool { return w.now > h.sent+MaxDelay })
	case mRaise:
		w.used.raises++
		x.raise(w, w.own(0))
	case mChangeSet:
		x.changeSet(w)

	default:
		return w, x.envApply(w, m)
	}
	return w, nil
}

// crash kills p: its client forgets what it was doing (and asks again),
// its background writes and the attempts it held are gone; it restarts
// with a new session. Its old session lives on in etcd until it expires.
func (x *explorer) crash(w *world, p *proc) {
	for cl, l := range p.sess {
		if w.alive(cl, l) {
			w.dead = append(w.dead, deadLease{cl, l})
		}
	}
	p.bg, p.hold = nil, nil
	for i := range p.clients {
		if c := &p.clients[i]; c.pc != cDone {
			c.pc, c.claim, c.write, c.lost = cIdle, nil, nil, false
		}
	}
	p.inc++
	x.newSession(w, p)
	w.learnSets(p) // a store reads its shard's epoch and set when it starts
}

// raise moves the shard epoch up by one, as p's RaiseEpoch does (a key
// moving to this shard): p believes in the new epoch from then on.
// On a shard set, the epoch raised is the second cluster's (another key
// moving there, or a restore's bump).
func (x *explorer) raise(w *world, p *proc) {
	cl := 0
	if x.scope.Shards {
		cl = 1
	}
	e := w.epoch(cl)
	_, _ = x.apply1(w, keys.RaiseEpoch(e, e+1), writer{cl: cl, kind: wRaise})
	p.epoch[cl] = e + 1
}

// epoch is the shard epoch cluster cl holds.
func (w *world) epoch(cl int) int64 {
	e := int64(0)
	if kv, ok := w.db(cl).Get(keys.Epoch()); ok {
		e, _ = kernel.ParseEpoch(kv.Value)
	}
	return e
}

// send sends p's Txn t, as fate f says.
func (x *explorer) send(w *world, p *proc, t *kernel.Txn, wr writer, f fate) (kernel.Reply, error) {
	l := x.lower(w, p, wr.cl, t)
	if x.log != nil {
		x.note("p%d sends %s%s", p.id, t, fateNames[f])
	}
	lost := kernel.Reply{Delivery: kernel.Failed, MayHaveLanded: true, Retry: true, Err: errLost}
	switch f {
	case fateDeliver:
		resp, err := x.apply1(w, l, wr)
		if v := only(err); v != nil {
			return kernel.Reply{}, v
		}
		r := x.reply(l, resp, err)
		if x.log != nil {
			x.note("answered %v (rev %d, cur %s)", [...]string{"applied", "refused", "full", "failed"}[r.Delivery], r.Rev, describe(r.Cur))
		}
		return r, nil
	case fateLost:
		if _, err := x.apply1(w, l, wr); only(err) != nil {
			return kernel.Reply{}, only(err)
		}
		return lost, nil
	case fateHeld, fateGiveUp:
		w.net = append(w.net, held{sent: w.now, txn: l, writer: wr})
		lost.Retry = f == fateHeld
		return lost, nil
	}
	// Never sent: the caller's context ended while it waited in the queue,
	// so it is not tried again either.
	return kernel.Reply{Delivery: kernel.Failed, NotSent: true, Err: errNotSent}, nil
}

// apply1 runs a lowered Txn on the writer's cluster and checks what it
// wrote.
func (x *explorer) apply1(w *world, t *kernel.Txn, wr writer) (*etcdmodel.Response, error) {
	before := x.records(w, wr.cl)
	resp, err := w.db(wr.cl).Txn(t)
	if err != nil {
		return nil, err
	}
	return resp, x.landed(w, before, x.records(w, wr.cl), wr)
}

// records reads every key's record on cluster cl.
func (x *explorer) records(w *world, cl int) []*kernel.Record {
	out := make([]*kernel.Record, x.scope.Keys)
	for i := range out {
		out[i], _ = x.read(w, cl, recordKey(i))
	}
	return out
}

// trace writes a path of moves.
func trace(ms []move) string {
	var b strings.Builder
	for i, m := range ms {
		fmt.Fprintf(&b, "  %3d. %s\n", i+1, m)
	}
	return b.String()
}
