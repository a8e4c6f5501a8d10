package kernel

import (
	"fmt"
	"strconv"
	"time"
)

// Config is a store's constant part of every decision.
type Config struct {
	Keys      Keys
	Retention time.Duration
	// Epochs makes the store one shard of a set: every claim, enqueue and
	// move compares the shard's epoch and shard set (Guards).
	Epochs bool
	// EpochGuard, outside a shard set, makes every claim and enqueue
	// compare the epoch alone (0 until a restore raises it): a store
	// learns a raise from the first write it refuses.
	EpochGuard bool
}

// Guards are the compares of a claim, enqueue or move on a shard: its
// epoch and its shard set as the caller last saw them. A write decided
// under an older epoch or set is refused, and its Else branch reads both
// (GuardReads).
func (k Keys) Guards(epoch, setRev int64) []Cmp {
	return []Cmp{k.EpochCmp(epoch), k.SetCmp(setRev)}
}

// EpochCmp holds while the shard's epoch is e (0: none yet).
func (k Keys) EpochCmp(e int64) Cmp {
	if e == 0 {
		return Absent(k.Epoch())
	}
	return ValueIs(k.Epoch(), []byte(strconv.FormatInt(e, 10)))
}

// SetCmp holds while the shard set is the one written at rev (0: none).
func (k Keys) SetCmp(rev int64) Cmp {
	if rev == 0 {
		return Absent(k.Set())
	}
	return Modified(k.Set(), rev)
}

// GuardReads are the Else reads of a guarded write: the epoch and the set.
func (k Keys) GuardReads() []Op { return []Op{Read(k.Epoch()), Read(k.Set())} }

// MaxEpoch bounds a shard epoch: a token holds it above EpochShift bits.
const MaxEpoch = 1<<(63-EpochShift) - 1

// ParseEpoch reads a shard epoch's value.
func ParseEpoch(v []byte) (int64, error) {
	e, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil || e < 0 || e > MaxEpoch {
		return 0, fmt.Errorf("shard epoch %q", v)
	}
	return e, nil
}

// RaiseEpoch is the Txn that moves the shard epoch from cur to next.
func (k Keys) RaiseEpoch(cur, next int64) *Txn {
	return &Txn{If: []Cmp{k.EpochCmp(cur)}, Then: []Op{PutValue(k.Epoch(), []byte(strconv.FormatInt(next, 10)), NoLease)}}
}

// guarded is the state of a write guarded by the shard's epoch and set:
// what it compared, to tell from a refusal whether either moved.
type guarded struct {
	on            bool
	epochOnly     bool // EpochGuard: the set is neither compared nor read
	epoch, setRev int64
}

// reads are the Else reads of the guarded write: the epoch, and the set
// on a shard.
func (g guarded) reads(k Keys) []Op {
	if g.epochOnly {
		return []Op{Read(k.Epoch())}
	}
	return k.GuardReads()
}

// guard appends the guards of a write under view v to cmps (with Epochs),
// compared with the shard set at under (0: the store's own).
func (c Config) guard(cmps []Cmp, v View, under int64) ([]Cmp, guarded) {
	if !c.Epochs {
		if !c.EpochGuard {
			return cmps, guarded{}
		}
		return append(cmps, c.Keys.EpochCmp(v.Epoch)), guarded{on: true, epochOnly: true, epoch: v.Epoch}
	}
	rev := under
	if rev == 0 {
		rev = v.SetRev
	}
	return append(cmps, c.Keys.Guards(v.Epoch, rev)...), guarded{on: true, epoch: v.Epoch, setRev: rev}
}

// Notes are what a refused guarded write taught the caller of its shard.
type Notes struct {
	// Found: a claim found a record on its first round (the statistic of
	// the adaptive claim path).
	Found bool
	// Epoch is the shard epoch etcd holds, when it is not the one the
	// write compared: the caller believes in it from now on.
	Epoch    int64
	NewEpoch bool
	// Rev is the revision etcd answered the write at: what it taught is
	// as of then (a reply can arrive after a newer one).
	Rev int64
	// Set is the shard set etcd holds, when it is not the one the write
	// compared.
	Set    SetValue
	NewSet bool
}

// learn reads a refused guarded write's reply: a set that moved refuses
// the operation (the caller routes again), an epoch that moved is
// believed in.
func (g guarded) learn(r Reply) (n Notes, setChanged bool) {
	if !g.on {
		return n, false
	}
	n.Rev = r.Rev
	if !g.epochOnly && r.Set.Rev != g.setRev {
		n.Set, n.NewSet = r.Set, true
		return n, true
	}
	if r.Epoch != g.epoch {
		n.Epoch, n.NewEpoch = r.Epoch, true
	}
	return n, false
}

// SetValue is the compare-and-set of a value (its etcd key): value is put,
// on a lease of kind l, if the value's revision is still rev (0: only if
// there is none) and, for setRev other than 0, the shard set is still the
// one written at setRev. Else reads the value (and the set).
func (k Keys) SetValue(key string, value []byte, rev int64, l LeaseKind, setRev int64) *Txn {
	t := &Txn{If: []Cmp{Modified(key, rev)}, Then: []Op{PutValue(key, value, l)}, Else: []Op{Read(key)}}
	if rev == 0 {
		t.If[0] = Absent(key)
	}
	if setRev != 0 {
		t.If = append(t.If, k.SetCmp(setRev))
		t.Else = append(t.Else, Read(k.Set()))
	}
	return t
}

// DeleteValue deletes a value (its etcd key) if its revision is still rev.
func DeleteValue(key string, rev int64) *Txn {
	return &Txn{If: []Cmp{Modified(key, rev)}, Then: []Op{Del(key)}}
}
