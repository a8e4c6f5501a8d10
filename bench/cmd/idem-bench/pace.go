// Code generated from etcdstore/internal/send/pace.go (a copy; TestPacerIsEtcdstores keeps it identical). DO NOT EDIT.

package main

import "time"

// pacer decides, from what the Sender measured of its own batches, how long
// a write that finds a batch in flight waits for company before a further
// batch may go beside it (the hold). It measures two round trips:
//
//   - srtt, the smoothed round trip of every batch (gain 1/8, as TCP's);
//   - base, the round trip of etcd when nothing of ours queues there: the
//     least round trip of a write sent alone while no other batch of this
//     Sender flew, over a window of baseWindow (a window that saw no such
//     write keeps the last one's figure; until one is seen, the least
//     round trip of any batch stands in, which can only be longer).
//
// srtt - base is the time etcd spends queueing our writes: applying the
// batches before them, fsyncs, CPU taken by this very process. The hold is
// that queueing delay, bounded below by a gatherDiv-th of base (time for
// the writes that arrive together to leave together) and above by srtt
// (waiting for the batch in flight to answer, which frees its slot).
//
//   - Where a round trip is long and etcd does not queue (members in other
//     data centres, a light load), srtt is close to base and the hold is a
//     small fraction of a round trip: a write that finds a batch in flight
//     goes in the next one a moment later, not a round trip later.
//   - Where etcd is the bottleneck (a local cluster under load), srtt is
//     several times base and the hold reaches srtt: writes wait for the
//     batch in flight and go together, as many per raft entry as the load
//     brings, so that etcd spends its time on writes, not on requests.
//
// The hold is negative feedback on what it measures: a longer hold sends
// fewer, fuller batches, which queue less at etcd, which shortens the
// hold. It is damped (srtt moves by an eighth of each difference; base
// moves only at a window's end) and bounded on both sides, so it settles
// between the two rules a constant would have to pick from rather than
// swinging between them; see docs/ARCHITECTURE.md.
type pacer struct {
	n      int64         // batches measured
	srtt   time.Duration // smoothed round trip of a batch
	base   time.Duration // least round trip of a lone write, last window
	hasB   bool
	cand   time.Duration // least in the current window
	hasC   bool
	window time.Time     // the current window's start
	least  time.Duration // least round trip of any batch, while !hasB
}

const (
	baseWindow = 10 * time.Second // as BBR's min_rtt filter
	gatherDiv  = 16
)

// observe notes the round trip of one batch, sent at now-rtt; alone says
// it held one write and no other batch of the Sender flew meanwhile.
func (p *pacer) observe(rtt time.Duration, alone bool, now time.Time) {
	if rtt < 0 {
		rtt = 0 // a clock stepped back
	}
	if p.n == 0 {
		p.srtt = rtt
	} else {
		p.srtt += (rtt - p.srtt) / 8
	}
	if p.n == 0 || rtt < p.least {
		p.least = rtt
	}
	p.n++
	if !alone {
		return
	}
	if !p.hasB || rtt < p.base {
		p.base, p.hasB = rtt, true
	}
	if !p.hasC || rtt < p.cand {
		p.cand, p.hasC = rtt, true
	}
	if now.Sub(p.window) >= baseWindow {
		// The window closes: its least lone round trip becomes base, so
		// that a figure from a cluster that has since moved ages out.
		p.base, p.cand, p.hasC, p.window = p.cand, 0, false, now
	}
}

// hold returns how long after the last batch left a further one may go
// while batches fly, and false when nothing is measured yet (the batch in
// flight will be the first measurement: wait for it).
func (p *pacer) hold() (time.Duration, bool) {
	if p.n == 0 {
		return 0, false
	}
	base := p.least
	if p.hasB {
		base = p.base
	}
	h := max(p.srtt-base, base/gatherDiv)
	return min(h, p.srtt), true
}
