package etcdmodel

import (
	"math/rand/v2"

	"github.com/idem-dev/idem/internal/kernel"
)

// unknownLease is a lease id the model never grants.
const unknownLease = 1 << 40

// values are the values puts write and compares compare: the empty value
// (etcd returns it as nil), and values that order below, between and
// above one another.
var values = []string{"", "a", "b", "ab", "c"}

// gen generates random steps over a few keys, reading the model (equal to
// etcd while they agree) to pick numbers compares can hit.
type gen struct {
	r       *rand.Rand
	m       *Store
	keys    []string
	revoked []int64 // model ids of revoked leases
}

func newGen(seed int64, m *Store, prefix string) *gen {
	g := &gen{r: rand.New(rand.NewPCG(uint64(seed), 0x9e3779b97f4a7c15)), m: m}
	for _, k := range []string{"a", "b", "c", "d"} {
		g.keys = append(g.keys, prefix+k)
	}
	return g
}

func (g *gen) step() step {
	leases := g.m.Leases()
	switch n := g.r.IntN(100); {
	case n < 6 && len(leases) < 4:
		return step{kind: stepGrant}
	case n < 11:
		id := g.leaseID(false)
		if g.r.IntN(4) > 0 { // mostly a live one
			id = g.pick(leases)
		}
		if _, err := g.m.TTL(id); err == nil {
			g.revoked = append(g.revoked, id)
		}
		return step{kind: stepRevoke, lease: id}
	case n < 14:
		return step{kind: stepKeepAlive, lease: g.anyLease()}
	case n < 19:
		return step{kind: stepKeys, lease: g.anyLease()}
	}
	return step{kind: stepTxn, txn: g.top()}
}

// top is a Txn. Most write each key once per branch (so most run); one
// in eight writes keys freely, which etcd often refuses (ErrDuplicateKey)
// and sometimes not (a put in one nested Txn, a delete in a later one).
// One in 500 has too many ops.
func (g *gen) top() *kernel.Txn {
	if g.r.IntN(500) == 0 {
		t := &kernel.Txn{}
		for range MaxTxnOps + 1 {
			t.Then = append(t.Then, kernel.Read(g.key()))
		}
		return t
	}
	free := g.r.IntN(8) == 0
	t := &kernel.Txn{If: g.cmps()}
	t.Then = g.ops(0, g.pool(free))
	if g.r.IntN(5) < 3 {
		t.Else = g.ops(0, g.pool(free))
	}
	return t
}

// pool is the keys a branch may write: each once, or any (free: nil).
func (g *gen) pool(free bool) *[]string {
	if free {
		return nil
	}
	p := append([]string(nil), g.keys...)
	g.r.Shuffle(len(p), func(i, j int) { p[i], p[j] = p[j], p[i] })
	return &p
}

// writeKey is a key to write from pool, or "" when the pool is spent.
func (g *gen) writeKey(pool *[]string) string {
	if pool == nil {
		return g.key()
	}
	if len(*pool) == 0 {
		return ""
	}
	k := (*pool)[0]
	*pool = (*pool)[1:]
	return k
}

func (g *gen) ops(depth int, pool *[]string) []kernel.Op {
	var ops []kernel.Op
	n := g.r.IntN(4) // a nested branch may be empty
	if depth == 0 {
		n = 1 + g.r.IntN(3)
	}
	for range n {
		n := g.r.IntN(100)
		if n >= 85 && depth < 2 {
			t := &kernel.Txn{If: g.cmps(), Then: g.ops(depth+1, pool), Else: g.ops(depth+1, pool)}
			ops = append(ops, kernel.Op{Kind: kernel.Nested, Txn: t})
			continue
		}
		if n < 55 {
			if k := g.writeKey(pool); k != "" {
				ops = append(ops, g.write(k, n < 38))
				continue
			}
		}
		op := kernel.Read(g.key())
		if n%2 == 0 {
			op = kernel.CountOf(g.key())
		}
		ops = append(ops, op)
	}
	return ops
}

// write is a put (or a delete) of k: on no lease, a lease (live, revoked
// or unknown), or the key's own; keeping the value or not. A few are
// malformed (an empty key, a kept value that gives one).
func (g *gen) write(k string, put bool) kernel.Op {
	if g.r.IntN(400) == 0 {
		k = ""
	}
	if !put {
		return kernel.Del(k)
	}
	op := kernel.PutValue(k, []byte(values[g.r.IntN(len(values))]), kernel.NoLease)
	switch n := g.r.IntN(20); {
	case n < 2:
		op.Lease, op.ID = kernel.LeaseID, g.leaseID(false)
	case n < 9:
		op.Lease, op.ID = kernel.LeaseID, g.pick(g.m.Leases())
	case n < 13:
		op.Lease = kernel.KeepLease
	}
	if g.r.IntN(5) == 0 {
		op.KeepValue = true
		if g.r.IntN(20) > 0 {
			op.Value = nil
		}
	}
	return op
}

func (g *gen) cmps() []kernel.Cmp {
	var cs []kernel.Cmp
	for range g.r.IntN(3) {
		cs = append(cs, g.cmp())
	}
	return cs
}

// cmp is a compare of any target and relation, against a number near the
// key's own (or 0, or the store's revision) so that it holds about as
// often as not. Lease ids only compare for equality with ids (etcd's do
// not order as the model's), and by order with 0.
func (g *gen) cmp() kernel.Cmp {
	c := kernel.Cmp{Key: g.key(), Target: kernel.Target(g.r.IntN(5)), Result: kernel.Result(g.r.IntN(4))}
	if g.r.IntN(600) == 0 {
		c.Key = ""
	}
	kv, _ := g.m.Get(c.Key)
	switch c.Target {
	case kernel.Value:
		c.Value = []byte(values[g.r.IntN(len(values))])
	case kernel.Lease:
		if c.Result == kernel.Equal || c.Result == kernel.NotEqual {
			c.Num = [...]int64{0, kv.Lease, g.leaseID(true), g.pick(g.m.Leases())}[g.r.IntN(4)]
		}
	default:
		n := [...]int64{kv.CreateRev, kv.ModRev, kv.Version}[c.Target]
		c.Num = [...]int64{0, n - 1, n, n, n + 1, g.m.Rev()}[g.r.IntN(6)]
	}
	return c
}

func (g *gen) key() string { return g.keys[g.r.IntN(len(g.keys))] }

// leaseID is a lease id of any standing: live, revoked, unknown or 0
// (with zero).
func (g *gen) leaseID(zero bool) int64 {
	ids := append(append(g.m.Leases(), g.revoked...), unknownLease)
	if zero {
		ids = append(ids, 0)
	}
	return g.pick(ids)
}

// anyLease is mostly a live lease, else one of any standing.
func (g *gen) anyLease() int64 {
	if ids := g.m.Leases(); len(ids) > 0 && g.r.IntN(4) > 0 {
		return g.pick(ids)
	}
	return g.leaseID(true)
}

// pick is a random element of ids, or 0 if there is none.
func (g *gen) pick(ids []int64) int64 {
	if len(ids) == 0 {
		return 0
	}
	return ids[g.r.IntN(len(ids))]
}
