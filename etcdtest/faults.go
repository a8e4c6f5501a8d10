package etcdtest

import (
	"context"
	"fmt"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/types"
)

// Isolate cuts member i off from every other member, in both directions:
// it stops sending to the others and they stop sending to it
// (EtcdServer.CutPeer on both sides, as etcd's own integration framework
// does), and its peer proxy drops what still arrives. Both sides are
// needed: rafthttp carries messages from B to A on stream connections that
// A opened to B, so blocking A's own inbound link alone would let A keep
// hearing the leader. The cluster must have been started with Proxies.
// Heal undoes it; WaitIsolated proves it took effect.
func (c *Cluster) Isolate(i int) error {
	m := c.Members[i]
	if m.PeerProxy == nil {
		return fmt.Errorf("isolate %s: the cluster has no proxies", m.Name)
	}
	m.PeerProxy.Blackhole()
	if e := m.Etcd(); e != nil {
		for _, id := range c.otherIDs(i) {
			e.Server.CutPeer(id)
		}
	}
	id := c.memberIDs[i]
	for j, o := range c.Members {
		if e := o.Etcd(); e != nil && j != i {
			e.Server.CutPeer(id)
		}
	}
	return nil
}

// WaitIsolated waits until member i knows no leader, or is the only member
// that thinks it leads (an isolated leader before it steps down is still
// not the leader the others follow): proof that Isolate took effect.
func (c *Cluster) WaitIsolated(ctx context.Context, i int) error {
	for {
		if e := c.Members[i].Etcd(); e != nil && e.Server.Leader() == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("member %d still follows a leader: the cut did not take effect: %w", i, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Heal ends every proxy fault and mends every cut peer link.
func (c *Cluster) Heal() {
	for i, m := range c.Members {
		for _, p := range []*Proxy{m.PeerProxy, m.ClientProxy} {
			if p != nil {
				p.Heal()
			}
		}
		if e := m.Etcd(); e != nil {
			for _, id := range c.otherIDs(i) {
				e.Server.MendPeer(id)
			}
		}
	}
}

func (c *Cluster) otherIDs(i int) []types.ID {
	var ids []types.ID
	for j, o := range c.Members {
		if j == i {
			continue
		}
		if e := o.Etcd(); e != nil {
			ids = append(ids, e.Server.MemberID())
		} else if id, ok := c.memberIDs[j]; ok {
			ids = append(ids, id)
		}
	}
	return ids
}

// LeaderOf returns the index of the leader that every running member in
// among agrees on, or -1 when they do not agree or know none.
func (c *Cluster) LeaderOf(among ...int) int {
	lead := -1
	for _, i := range among {
		e := c.Members[i].Etcd()
		if e == nil {
			continue
		}
		l := c.indexOf(e.Server.Leader())
		if l < 0 || lead >= 0 && l != lead {
			return -1
		}
		lead = l
	}
	return lead
}

func (c *Cluster) indexOf(id types.ID) int {
	for j, o := range c.Members {
		if e := o.Etcd(); e != nil && e.Server.MemberID() == id {
			return j
		}
		if c.memberIDs[j] == id && id != 0 {
			return j
		}
	}
	return -1
}

// WaitLeader waits until the members in among agree on a leader that is
// not excluded, and returns it. It polls the members' own view every few
// milliseconds: there is no event for "a quorum agrees".
func (c *Cluster) WaitLeader(ctx context.Context, among []int, exclude ...int) (int, error) {
	for {
		l := c.LeaderOf(among...)
		ok := l >= 0
		for _, x := range exclude {
			ok = ok && l != x
		}
		if ok {
			return l, nil
		}
		select {
		case <-ctx.Done():
			return -1, fmt.Errorf("no leader agreed on by members %v: %w", among, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// All returns the indexes of every member, for LeaderOf and WaitLeader.
func (c *Cluster) All() []int {
	idx := make([]int, len(c.Members))
	for i := range idx {
		idx[i] = i
	}
	return idx
}

// Reconnect undoes Isolate and Pause for member i alone: its peer links are
// mended on both sides and its proxies carry traffic again (held traffic is
// delivered). Heal does it for every member.
func (c *Cluster) Reconnect(i int) {
	m := c.Members[i]
	for _, p := range []*Proxy{m.PeerProxy, m.ClientProxy} {
		if p != nil {
			p.Heal()
		}
	}
	if e := m.Etcd(); e != nil {
		for _, id := range c.otherIDs(i) {
			e.Server.MendPeer(id)
		}
	}
	id := c.memberIDs[i]
	for j, o := range c.Members {
		if e := o.Etcd(); e != nil && j != i {
			e.Server.MendPeer(id)
		}
	}
}

// Pause makes member i look, from outside, like a process that stopped
// (SIGSTOP) with its connections open: the other members stop hearing it and
// it stops hearing them (Isolate), and its client proxy holds every request
// without answering or closing (clients wait until their own timeouts, as
// they would for a hung machine). Reconnect or Heal resumes it. The member
// itself keeps running: it notices it has no leader, but nobody hears it.
// The cluster must have been started with Proxies.
func (c *Cluster) Pause(i int) error {
	if err := c.Isolate(i); err != nil {
		return err
	}
	c.Members[i].ClientProxy.Hold()
	return nil
}

// ProxiedEndpoints returns every member's client endpoint behind its client
// proxy (the cluster must have been started with Proxies): a client given
// these sees the faults set on the proxies, and Pause.
func (c *Cluster) ProxiedEndpoints() []string {
	var eps []string
	for _, m := range c.Members {
		if m.ClientProxy != nil {
			eps = append(eps, m.ClientProxy.URL())
		}
	}
	return eps
}
