package check

import (
	"fmt"
	"hash/maphash"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idem-dev/idem/internal/etcdmodel"
	"github.com/idem-dev/idem/internal/kernel"
)

// Result is what an exploration found.
type Result struct {
	Scope     string
	States    int           // distinct states explored
	Terminal  int           // states where nothing more can happen
	Complete  bool          // every reachable state was explored
	Took      time.Duration // how long it took
	Violation error         // the first invariant broken, with the path to it
}

func (r Result) String() string {
	s := fmt.Sprintf("%s: %d distinct states (%d terminal) in %v", r.Scope, r.States, r.Terminal, r.Took.Round(time.Millisecond))
	if !r.Complete {
		s += ", stopped at its bound"
	} else {
		s += ", exhaustive"
	}
	return s
}

type explorer struct {
	stop   *atomic.Bool
	log    []string // while a violation's path is replayed: what each step did
	scope  Scope
	codec  *codec
	seed   maphash.Seed
	seen   map[uint64]struct{}
	buf    []byte
	result Result
}

// Explore explores every world of scope, depth first, until every
// reachable state was seen, an invariant breaks, maxStates were explored
// or the deadline passes.
func Explore(scope Scope, maxStates int, deadline time.Time) Result {
	return ExploreUntil(scope, maxStates, deadline, nil)
}

// ExploreUntil is Explore that also stops once stop is set (another
// exploration found a violation, say), and sets it when it finds one.
func ExploreUntil(scope Scope, maxStates int, deadline time.Time, stop *atomic.Bool) Result {
	if stop == nil {
		stop = new(atomic.Bool)
	}
	x := &explorer{scope: scope, codec: newCodec(), seed: maphash.MakeSeed(), seen: map[uint64]struct{}{}, stop: stop}
	x.result.Scope = scope.Name
	start := time.Now()
	err := x.dfs(maxStates, deadline)
	x.result.Took = time.Since(start)
	x.result.Violation = err
	if err != nil {
		stop.Store(true)
	}
	return x.result
}

// frame is a state on the depth-first path, and the moves left to try.
type frame struct {
	w     *world
	hash  uint64
	moves []move
	next  int
	loops int // moves that changed nothing
	via   move
}

// dfs explores depth first from the first state; it returns the first
// invariant broken, with the path to it (nil: none), and marks the result
// complete when every reachable state was seen.
func (x *explorer) dfs(maxStates int, deadline time.Time) error {
	w := x.initial()
	h, _ := x.visit(w)
	stack := []frame{{w: w, hash: h, moves: x.moves(w)}}
	path := func(m ...move) []move {
		var ms []move
		for _, f := range stack[1:] {
			ms = append(ms, f.via)
		}
		return append(ms, m...)
	}
	for len(stack) > 0 {
		top := &stack[len(stack)-1]
		if top.next == len(top.moves) {
			if top.loops == len(top.moves) && top.loops > 0 {
				// Only background work that changes nothing is left, and
				// time cannot pass: it never ends (L).
				return fmt.Errorf("L: background work retries forever, changing nothing, after:\n%s", x.replay(path()))
			}
			stack = stack[:len(stack)-1]
			continue
		}
		if x.result.States >= maxStates || x.result.States%1024 == 0 && (time.Now().After(deadline) || x.stop.Load()) {
			return nil
		}
		m := top.moves[top.next]
		top.next++
		next, err := x.apply(top.w, m)
		if err != nil {
			return fmt.Errorf("%s, after:\n%s", err, x.replay(path(m)))
		}
		h, fresh := x.visit(next)
		if h == top.hash {
			top.loops++
		}
		if !fresh {
			continue
		}
		ms := x.moves(next)
		if len(ms) == 0 {
			x.result.Terminal++
			if err := x.terminal(next); err != nil {
				return fmt.Errorf("%s, after:\n%s", err, x.replay(path(m)))
			}
		}
		stack = append(stack, frame{w: next, hash: h, moves: ms, via: m})
	}
	x.result.Complete = true
	return nil
}

// visit records w, and returns its hash and whether it is new.
func (x *explorer) visit(w *world) (uint64, bool) {
	x.buf = w.appendState(x.buf[:0])
	h := maphash.Bytes(x.seed, x.buf)
	if _, ok := x.seen[h]; ok {
		return h, false
	}
	x.seen[h] = struct{}{}
	x.result.States++
	return h, true
}

// initial is a world's first state: every process with its session,
// its client before its first claim.
func (x *explorer) initial() *world {
	w := &world{etcds: []*etcdmodel.Store{etcdmodel.New()}, keys: make([]keyHist, x.scope.Keys)}
	if x.scope.Shards {
		// A shard set of two clusters, each recording the first set.
		w.etcds = append(w.etcds, etcdmodel.New())
		for _, db := range w.etcds {
			_, _ = db.Txn(keys.SetValue(keys.Set(), setValue(1), 0, kernel.NoLease, 0))
		}
	}
	for i := range x.scope.Procs {
		p := &proc{id: i}
		for j := range max(1, x.scope.Clients) {
			p.clients = append(p.clients, client{id: j, key: (i + j) % x.scope.Keys})
		}
		if i < len(x.scope.Skew) {
			p.skew = x.scope.Skew[i]
		}
		x.newSession(w, p)
		w.learnSets(p)
		w.procs = append(w.procs, p)
	}
	return w
}

// terminal checks a world where nothing more can happen (L): every key
// is done, absent, or free by the rules, and a claim of a free key is
// granted. On a shard set, the key's record is the live one of either
// cluster (a Moved record says where it is not).
func (x *explorer) terminal(w *world) error {
	now := at(w.now)
	for i := range x.scope.Keys {
		cl, rec := x.live(w, i, now)
		if rec == nil {
			if err := x.probe(w, i); err != nil {
				return err
			}
			continue
		}
		if rec.State != kernel.InFlight {
			continue
		}
		_, alive := w.db(cl).Get(keys.Owner(rec.Owner))
		free := rec.Owner == "" || !alive || rec.PastDeadline(now)
		if !free && w.hung(i, rec.Attempt) {
			continue // its worker is stuck: held, as it should be
		}
		if !free {
			return broke("L", "key %d stays in flight under live session %s (attempt %s) with nobody running it", i, rec.Owner, rec.Attempt)
		}
		if err := x.probe(w, i); err != nil {
			return err
		}
	}
	return nil
}

// live returns the cluster and the live record of key i (nil: none).
func (x *explorer) live(w *world, i int, now time.Time) (int, *kernel.Record) {
	for cl := range w.etcds {
		if rec, _ := x.read(w, cl, recordKey(i)); rec.Live(now) {
			return cl, rec
		}
	}
	return 0, nil
}

// hung reports whether a stuck client holds key i's attempt.
func (w *world) hung(key int, attempt string) bool {
	for _, p := range w.procs {
		for _, c := range p.clients {
			if c.pc == cHung && c.key == key && c.held.Attempt == attempt {
				return true
			}
		}
	}
	return false
}

// probe claims key i, free by the rules (or absent), through each of the
// world's processes as it stands (its session, its view of the shard's
// epoch, the attempts it holds), every Txn delivered: each must be granted
// (and given up at once, for the next). A process that cannot claim a free
// key is stuck, whatever a new one could do.
func (x *explorer) probe(w *world, i int) error {
	for _, p := range w.procs {
		if err := x.probeVia(w.clone(), p.id, i); err != nil {
			return err
		}
	}
	return nil
}

func (x *explorer) probeVia(w *world, id, i int) error {
	p := w.own(id)
	if !w.alive(0, p.sess[0]) {
		return nil // its session is gone: it starts a new one first
	}
	if x.scope.Shards {
		return x.probeRouted(w, p, i)
	}
	m := kernel.NewClaim(x.cfg(), kernel.ClaimRequest{Key: recordKey(i), Fingerprint: fingerprint(i), Owner: p.owner(), Attempt: "probe"})
	for range 3 * kernel.MaxRounds {
		a := m.Next(x.view(w, p, 0, i))
		if a.Kind == kernel.ActDone {
			if v := m.Answer().Verdict; v != kernel.Won {
				return broke("L", "p%d's probe claim of key %d, free by the rules, was answered %v", p.id, i, v)
			}
			return nil
		}
		if err := x.drive(w, p, i, m, writer{proc: p.id, owner: p.owner(), kind: wClaim, attempt: "probe", now: w.clockOf(p)}, fateDeliver); err != nil {
			return err
		}
	}
	return broke("L", "p%d's probe claim of key %d did not end", p.id, i)
}

// probeRouted claims key i through p as its clients do on a shard set
// (routed, handed over), every Txn delivered: it must be granted or
// replay, within a few routes.
func (x *explorer) probeRouted(w *world, p *proc, i int) error {
	p.clients = append(p.clients, client{id: len(p.clients), key: i})
	c := &p.clients[len(p.clients)-1]
	for range 8 * kernel.MaxRounds {
		if c.pc == cHold || c.pc == cDone {
			return nil
		}
		if err := x.clientStep(w, p, c, fateDeliver); err != nil {
			return err
		}
	}
	return broke("L", "p%d's probe claim of key %d, free by the rules, was not granted (%d tries)", p.id, i, c.tries)
}

// envMoves are the sweeper's, the operator's and dead sessions' moves.
func (x *explorer) envMoves(w *world) []move {
	var out []move
	if slices.ContainsFunc(w.dead, func(d deadLease) bool { return w.alive(d.cl, d.lease) }) {
		out = append(out, move{kind: mExpireDead})
	}
	if x.scope.Sweep {
		if w.sweep == nil {
			for i, b := range w.buckets {
				// A bucket's records expire by its end: the sweep is due a
				// retention after it began (no margin in the model).
				ret := time.Duration(x.scope.Retention) * Step
				if kernel.BucketDue(at(b.until).Add(-ret), ret, 0, at(w.now)) {
					out = append(out, move{kind: mSweepList, idx: i})
				}
			}
		} else {
			out = append(out, move{kind: mSweepDelete})
		}
	}
	if x.scope.Evict {
		if w.evict == nil {
			for i := range x.scope.Keys {
				if rec, _ := x.read(w, 0, recordKey(i)); rec != nil && kernel.Forget(rec, at(w.now)) == kernel.EvictJob {
					out = append(out, move{kind: mEvictRead, idx: i})
				}
			}
		} else {
			out = append(out, move{kind: mEvictDo})
		}
	}
	return out
}

// envApply applies the sweeper's, the operator's and dead sessions' moves.
func (x *explorer) envApply(w *world, m move) error {
	switch m.kind {
	case mExpireDead:
		for _, d := range w.dead {
			_ = w.db(d.cl).Expire(d.lease)
		}
		w.dead = nil
	case mSweepList:
		b := w.buckets[m.idx]
		ks, _ := w.db(b.cl).Keys(b.lease)
		w.sweep = &sweepState{lease: b.lease, keys: ks}
	case mSweepDelete:
		s := w.sweep
		w.sweep = nil
		if _, err := x.apply1(w, kernel.SweepChunk(s.keys, s.lease), writer{kind: wSweep, now: w.now}); only(err) != nil {
			return only(err)
		}
		_ = w.db(0).Expire(s.lease) // revoked once emptied
		w.buckets = slices.DeleteFunc(w.buckets, func(b bucket) bool { return b.lease == s.lease })
	case mEvictRead:
		rec, _ := x.read(w, 0, recordKey(m.idx))
		w.evict = &evictState{key: m.idx, rev: rec.Revision}
	case mEvictDo:
		e := w.evict
		w.evict = nil
		_, err := x.apply1(w, kernel.EvictIf(recordKey(e.key), e.rev), writer{kind: wEvict, now: w.now})
		return only(err)
	}
	return nil
}

type sweepState struct {
	lease int64
	keys  []string
}

type evictState struct {
	key int
	rev int64
}

// replay runs path again from the first state, and writes each move with
// what it did and the records after it.
func (x *explorer) replay(path []move) string {
	var b strings.Builder
	w := x.initial()
	for i, m := range path {
		x.log = []string{}
		next, err := x.apply(w, m)
		fmt.Fprintf(&b, "  %3d. %s\n", i+1, m)
		for _, l := range x.log {
			fmt.Fprintf(&b, "         %s\n", l)
		}
		if err != nil {
			fmt.Fprintf(&b, "         => %v\n", err)
			break
		}
		w = next
		for k := range x.scope.Keys {
			for cl := range w.etcds {
				rec, _ := x.read(w, cl, recordKey(k))
				fmt.Fprintf(&b, "         key %d%s: %s\n", k, [...]string{"", " on b"}[cl], describe(rec))
			}
		}
	}
	x.log = nil
	return b.String()
}

// note adds a line to the replayed step's log.
func (x *explorer) note(format string, args ...any) {
	if x.log != nil {
		x.log = append(x.log, fmt.Sprintf(format, args...))
	}
}

func describe(r *kernel.Record) string {
	if r == nil {
		return "absent"
	}
	s := fmt.Sprintf("%v token=%d rev=%d owner=%q attempt=%q expires=%s", r.State, r.Token, r.Revision, r.Owner, r.Attempt, r.Expires.Sub(epoch0))
	if !r.Deadline.IsZero() {
		s += fmt.Sprintf(" deadline=%s", r.Deadline.Sub(epoch0))
	}
	if len(r.Checkpoint) > 0 {
		s += fmt.Sprintf(" checkpoint=%q", r.Checkpoint)
	}
	if r.Fence {
		s += " FENCE"
	}
	if r.Outcome != nil {
		s += fmt.Sprintf(" outcome=%q", r.Outcome.Body)
	}
	return s
}
