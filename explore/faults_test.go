package explore

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idem-dev/idem/clock"
)

// Faults, FoundationDB's way (BUGGIFY): every fault site (who makes the
// call, which etcd RPC, which kind of fault) is switched on for a whole
// schedule with probability activation, drawn the first time the site is
// met, and an active site fires with probability fire at each call. A
// schedule so runs with a few rare faults switched on hard, and the common
// paths stay exercised in the others.

type faultKind int

const (
	fkFail      faultKind = iota // fails before it reaches etcd
	fkLost                       // applied, its reply lost
	fkRefuse                     // refused by etcd for what it holds (definite: never applied)
	fkHold                       // held on its way to etcd while other actors run
	fkHoldReply                  // applied, its reply held while other actors run
	fkLate                       // applied, its reply back only after the request's timeout: the caller timed out
)

var faultNames = [...]string{"fail", "lost", "refuse", "hold", "hold-reply", "late"}

func (k faultKind) String() string { return faultNames[k] }

var errInjected = status.Error(codes.Unavailable, "explore: injected fault")

// errRefused is etcd's "too many requests": returned before it proposes
// anything, so definitely not applied, and refused as a whole for a batch.
var errRefused = status.Error(codes.ResourceExhausted, "etcdserver: too many requests")

// faults is a world's fault configuration and the sites it drew.
type faults struct {
	activation, fire float64
	sites            map[string]bool
}

// active reports whether the site is switched on in this world.
func (w *world) active(site string) bool {
	v, ok := w.faults.sites[site]
	if !ok {
		v = w.rng.Float64() < w.faults.activation
		w.faults.sites[site] = v
	}
	return v
}

// rpcName is the RPC's name as a fault site says it: the method, and for a
// Txn whether it is a batch (a Txn of the store's Txns).
func rpcName(method string, req any) string {
	name := method[strings.LastIndexByte(method, '/')+1:]
	if t, ok := req.(*pb.TxnRequest); ok {
		inner := 0
		for _, op := range t.Success {
			if op.GetRequestTxn() != nil {
				inner++
			}
		}
		switch {
		case inner >= 2 && len(t.Compare) == 0:
			return "Txn.batch"
		case inner >= 1 && len(t.Compare) == 0:
			return "Txn.chunk" // the sweeper's deletes, or a batch of one
		}
	}
	return name
}

// class is what kind of caller an actor is, for its fault sites: the kind
// of worker or client ("do", "http"...), or the store's background work
// ("sweeper", "complete", "reap", "session"...).
func class(a *actor) string {
	name := a.name
	if i := strings.IndexByte(name, '/'); i >= 0 {
		name = name[i+1:]
	}
	if a.bg {
		return bgClass(name)
	}
	return name
}

// bgClass is the class of a piece of background work by its name: its
// name without the key, token or owner it names.
func bgClass(name string) string {
	for _, full := range []string{"session supervisor", "dictionary follower", "publish dictionary", "cache feed", "cache progress",
		"feed progress", "revoke lost session", "job completer follow", "job completer dispatch"} {
		if name == full {
			return name
		}
	}
	first, _, _ := strings.Cut(name, " ")
	if first == "session" {
		return "session renewal"
	}
	return first
}

// inject is the fault injector of one process's etcd client.
func (w *world) inject(p *process) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		a := w.s.currentCtx(ctx)
		if slowFlag {
			who := "-"
			if a != nil {
				who = class(a)
			}
			w.ledger.hit("rpc:" + who + "/" + rpcName(method, req))
		}
		invoke := func() error {
			err := invoker(ctx, method, req, reply, cc, opts...)
			if err == nil {
				w.noteDeletes(a, req, reply) // before revisions: its revision is the real one
				if t, ok := req.(*pb.TxnRequest); ok {
					w.checkGuards(t, reply.(*pb.TxnResponse))
				}
				w.revisions(req, reply)
			}
			w.observeCall(p, method, req, reply, err)
			if err != nil && a != nil && ctx.Err() == nil && !p.dead {
				w.note("%s: %s: etcd answered %v", who2(a, p), rpcName(method, req), err)
			}
			return err
		}
		if a == nil {
			return invoke() // not an actor: an observer outside the schedule
		}
		if p.dead {
			return errInjected // the process is gone
		}
		if w.healed || ctx.Err() != nil {
			// (A call whose context has ended never leaves: gRPC fails it
			// at once, and clientv3's retry, seeing the context, stops.)
			return invoke()
		}
		name := rpcName(method, req)
		who := class(a)
		if traceCalls {
			w.note("%s: call %s (ctx %v)", who2(a, p), name, context.Cause(ctx))
		}
		kind, fire := faultKind(-1), false
		if w.cutOff(p, req) {
			// One shard cut off from the process: its calls to that
			// shard fail or lose their reply.
			kind, fire = fkFail, true
			if w.rng.IntN(2) == 0 {
				kind = fkLost
			}
		}
		if !fire && p.outage > 0 {
			// A connection outage: every call fails or loses its reply.
			p.outage--
			kind, fire = fkFail, true
			if w.rng.IntN(2) == 0 {
				kind = fkLost
			}
		}
		for k := fkFail; !fire && k <= fkLate; k++ {
			if k == fkRefuse && !strings.HasPrefix(name, "Txn") {
				continue
			}
			if site := who + "/" + name + "/" + k.String(); w.active(site) && w.rng.Float64() < w.faults.fire {
				kind, fire = k, true
				w.ledger.hit("fault:" + site)
			}
		}
		if !fire {
			return invoke()
		}
		w.faultCount++
		switch kind {
		case fkFail:
			w.note("%s: %s fails before etcd", who2(a, p), name)
			return errInjected
		case fkRefuse:
			w.note("%s: %s refused", who2(a, p), name)
			if name == "Txn.batch" {
				w.ledger.hit("path:batch refused and split")
			}
			return errRefused
		case fkLost:
			err := invoke()
			w.note("%s: %s applied, reply lost (err %v)", who2(a, p), name, err)
			if name == "Txn.batch" && err == nil {
				w.ledger.hit("path:batch reply lost")
			}
			if err != nil {
				return err
			}
			return errInjected
		case fkLate:
			// Applied; its answer comes after the call's own timeout, on
			// the simulated clock: the caller sees the timeout, and time
			// has passed meanwhile.
			err := invoke()
			clock.Sleep(p.clock, ctx, 30*time.Second)
			w.note("%s: %s applied (err %v), its reply after the timeout", who2(a, p), name, err)
			if name == "Txn" || name == "Txn.batch" {
				w.ledger.hit("path:write applied, its reply after the request's timeout")
			}
			if p.dead {
				return errInjected
			}
			return status.Error(codes.DeadlineExceeded, "context deadline exceeded")
		case fkHold:
			w.note("%s: %s held before etcd", who2(a, p), name)
			if !w.hold(a, p) {
				return errInjected
			}
			return invoke()
		default:
			err := invoke()
			w.note("%s: %s applied, reply held", who2(a, p), name)
			if !w.hold(a, p) {
				return errInjected
			}
			return err
		}
	}
}

func who2(a *actor, p *process) string { return a.name + "@" + p.name }

// hold parks the calling actor in the middle of an etcd call while others
// run. It reports false when the call's process died meanwhile.
func (w *world) hold(a *actor, p *process) bool {
	a.inProc = p
	ok := w.s.yield(a)
	a.inProc = nil
	return ok && !p.dead
}

// injectStream observes (and may fail) the session renewals, which are
// gRPC streams.
func (w *world) injectStream(p *process) grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if !strings.HasSuffix(method, "/LeaseKeepAlive") {
			return streamer(ctx, desc, cc, method, opts...)
		}
		if a := w.s.currentCtx(ctx); a != nil && !w.healed && ctx.Err() == nil {
			if p.dead {
				return nil, errInjected
			}
			if site := class(a) + "/LeaseKeepAlive/fail"; w.active(site) && w.rng.Float64() < w.faults.fire {
				w.ledger.hit("fault:" + site)
				w.faultCount++
				w.note("%s: a session renewal fails", who2(a, p))
				return nil, errInjected
			}
		}
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			return nil, err
		}
		return &keepAliveStream{ClientStream: cs, w: w}, nil
	}
}

type keepAliveStream struct {
	grpc.ClientStream
	w *world
}

func (s *keepAliveStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if r, ok := m.(*pb.LeaseKeepAliveResponse); ok && err == nil && r.TTL > 0 {
		s.w.renewed(clientv3.LeaseID(r.ID), time.Duration(r.TTL)*time.Second)
	}
	return err
}

// Leases in simulated time. etcd would expire a lease in real time, which
// passes at its own pace; the explorer keeps every lease of the world alive
// in real time and expires it itself (revokes it) once the simulated time
// has passed its TTL since it was granted or last renewed, as etcd's
// leader would have.

type leaseState struct {
	id      clientv3.LeaseID
	expires time.Time
	owner   string // the session's owner id, for a session lease
	stop    context.CancelFunc
	timer   func() bool
}

// observeCall notes what a successful call did to the world's leases and
// sessions.
func (w *world) observeCall(p *process, method string, req, reply any, err error) {
	if err != nil {
		return
	}
	if h, ok := reply.(interface{ GetHeader() *pb.ResponseHeader }); ok && h.GetHeader() != nil {
		w.stamp(h.GetHeader().Revision)
	}
	if t, ok := req.(*pb.TxnRequest); ok && rpcName(method, req) == "Txn.batch" {
		w.ledger.hit("path:batch of 2+ writes")
		if len(t.Success) >= 4 {
			w.ledger.hit("path:batch of 4+ writes")
		}
	}
	switch r := req.(type) {
	case *pb.LeaseGrantRequest:
		if g, ok := reply.(*pb.LeaseGrantResponse); ok && g.ID != 0 {
			w.trackLease(clientv3.LeaseID(g.ID), time.Duration(g.TTL)*time.Second)
		}
	case *pb.LeaseRevokeRequest:
		w.syncLast()
		w.leaseGone(clientv3.LeaseID(r.ID), "revoked by "+p.name)
	case *pb.PutRequest:
		rest, _ := w.storeRest(string(r.Key))
		if owner, ok := strings.CutPrefix(rest, "o/"); ok && r.Lease != 0 {
			w.mu.Lock()
			if ls := w.leases[clientv3.LeaseID(r.Lease)]; ls != nil {
				ls.owner = owner
			}
			w.mu.Unlock()
		}
	}
}

func (w *world) trackLease(id clientv3.LeaseID, ttl time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	ls := &leaseState{id: id, expires: w.s.Now().Add(ttl), stop: cancel}
	if ch, err := w.admin.KeepAlive(ctx, id); err == nil {
		go func() {
			for range ch {
			}
		}()
	}
	w.mu.Lock()
	if w.leases == nil {
		// The world is closed: a call that left before it answered now.
		w.mu.Unlock()
		cancel()
		return
	}
	w.leases[id] = ls
	w.mu.Unlock()
	w.armLease(ls)
}

func (w *world) armLease(ls *leaseState) {
	ls.timer = w.s.afterFunc(ls.expires.Sub(w.s.Now()), func() { w.expireLease(ls) })
}

// renewed moves a lease's expiry: a renewal etcd answered.
func (w *world) renewed(id clientv3.LeaseID, ttl time.Duration) {
	w.mu.Lock()
	ls := w.leases[id]
	w.mu.Unlock()
	if ls == nil {
		return
	}
	ls.timer()
	ls.expires = w.s.Now().Add(ttl)
	w.armLease(ls)
}

// expireLease revokes a lease whose TTL passed in simulated time: what
// etcd's leader does when a lease expires.
func (w *world) expireLease(ls *leaseState) {
	w.mu.Lock()
	cur := w.leases[ls.id]
	w.mu.Unlock()
	if cur != ls {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if resp, err := w.admin.Revoke(ctx, ls.id); err != nil && !errors.Is(err, context.Canceled) {
		w.note("expiring lease %x: %v", int64(ls.id), err)
	} else if err == nil {
		w.stamp(resp.Header.Revision)
	}
	w.syncLast()
	w.ledger.hit("path:lease expired")
	w.leaseGone(ls.id, "expired")
}

// leaseGone forgets a lease etcd no longer has; a session's ends with it.
func (w *world) leaseGone(id clientv3.LeaseID, how string) {
	w.mu.Lock()
	ls := w.leases[id]
	delete(w.leases, id)
	w.mu.Unlock()
	if ls == nil {
		return
	}
	ls.stop()
	ls.timer()
	if ls.owner != "" {
		w.log(event{kind: evSessionEnd, owner: ls.owner, body: how})
	}
}

// The coverage ledger: how often each fault site fired and each path of
// the store was reached, summed over schedules.

type ledger struct {
	mu sync.Mutex
	n  map[string]int
}

func newLedger() *ledger { return &ledger{n: make(map[string]int)} }

func (l *ledger) hit(path string) { l.add(path, 1) }

func (l *ledger) add(path string, n int) {
	if n == 0 {
		return
	}
	l.mu.Lock()
	l.n[path] += n
	l.mu.Unlock()
}

func (l *ledger) merge(o *ledger) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for k, v := range o.n {
		l.add(k, v)
	}
}

func (l *ledger) get(path string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n[path]
}

// summary prints the ledger: paths and states by count, and how many fault
// sites fired.
func (l *ledger) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var paths []string
	sites, fired := 0, 0
	for k := range l.n {
		if strings.HasPrefix(k, "fault:") {
			sites++
			fired += l.n[k]
			continue
		}
		paths = append(paths, k)
	}
	sort.Strings(paths)
	var b strings.Builder
	fmt.Fprintf(&b, "%d fault sites fired %d faults\n", sites, fired)
	for _, k := range paths {
		fmt.Fprintf(&b, "  %-58s %d\n", k, l.n[k])
	}
	return b.String()
}

// sites lists the fault sites that fired, by count.
func (l *ledger) sites() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var s []string
	for k, v := range l.n {
		if strings.HasPrefix(k, "fault:") {
			s = append(s, fmt.Sprintf("%s %d", strings.TrimPrefix(k, "fault:"), v))
		}
	}
	sort.Strings(s)
	return strings.Join(s, "\n  ")
}

// stamp notes that etcd was at rev at the simulated time now: the
// invariants date the writes of the history by it.
func (w *world) stamp(rev int64) {
	now := w.s.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := len(w.stamps); n > 0 && w.stamps[n-1].rev >= rev {
		return
	}
	w.stamps = append(w.stamps, stamp{rev, now})
}

type stamp struct {
	rev int64
	at  time.Time
}

// timeOf returns when etcd reached rev: the time of the first answer seen
// at rev or after.
func (w *world) timeOf(rev int64) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	i := sort.Search(len(w.stamps), func(i int) bool { return w.stamps[i].rev >= rev })
	if i == len(w.stamps) {
		return time.Time{}, false
	}
	return w.stamps[i].at, true
}

// Revisions. etcd's revision is global: the shared cluster serves other
// schedules meanwhile, so an answer that wrote nothing carries a revision
// that depends on them, and a watch begun from it would include the
// world's last event or not by chance. The injector so rewrites the header
// of every answer that wrote nothing to the world's own latest write, the
// revision etcd would have answered were the world alone on it; an answer
// that wrote carries its write's revision, which becomes the latest. What
// the driver writes itself (restores, epoch raises, lease expiries) it
// follows by syncLast.

// revisions notes the revision of a write, or rewrites the header of an
// answer that wrote nothing.
func (w *world) revisions(req, reply any) {
	h, ok := reply.(interface{ GetHeader() *pb.ResponseHeader })
	if !ok || h.GetHeader() == nil {
		return
	}
	hdr := h.GetHeader()
	w.mu.Lock()
	defer w.mu.Unlock()
	if wrote(req, reply) {
		w.lastWrite = max(w.lastWrite, hdr.Revision)
		return
	}
	if _, ok := req.(*pb.LeaseRevokeRequest); ok {
		return // syncLast follows
	}
	hdr.Revision = w.lastWrite
}

// wrote reports whether an answered request changed etcd's keys.
func wrote(req, reply any) bool {
	switch r := reply.(type) {
	case *pb.PutResponse:
		return true
	case *pb.DeleteRangeResponse:
		return r.Deleted > 0
	case *pb.TxnResponse:
		t, ok := req.(*pb.TxnRequest)
		return ok && txnWrote(t, r)
	}
	return false
}

func txnWrote(t *pb.TxnRequest, r *pb.TxnResponse) bool {
	ops := t.Failure
	if r.Succeeded {
		ops = t.Success
	}
	for i, op := range ops {
		if i >= len(r.Responses) {
			break
		}
		switch {
		case op.GetRequestPut() != nil:
			return true
		case op.GetRequestDeleteRange() != nil:
			if r.Responses[i].GetResponseDeleteRange().GetDeleted() > 0 {
				return true
			}
		case op.GetRequestTxn() != nil:
			if txnWrote(op.GetRequestTxn(), r.Responses[i].GetResponseTxn()) {
				return true
			}
		}
	}
	return false
}

// syncLast writes a key of the world's own, after the driver changed etcd
// without the injector seeing it: its revision, greater than every write
// before it, becomes the latest.
func (w *world) syncLast() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := w.admin.Put(ctx, w.prefix+"zz-sync", "")
	if err != nil {
		w.note("sync: %v", err)
		return
	}
	w.mu.Lock()
	w.lastWrite = max(w.lastWrite, resp.Header.Revision)
	w.mu.Unlock()
}
