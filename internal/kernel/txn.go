package kernel

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Target is what a compare looks at, as in etcd's Compare.
type Target uint8

// The targets of a compare.
const (
	CreateRev Target = iota // the key's CreateRevision (0: absent)
	ModRev                  // its ModRevision (0: absent)
	Version                 // its Version (0: absent)
	Value                   // its value (a compare of an absent key's value fails)
	Lease                   // its lease (0: none, or absent)
)

// Result is a compare's relation, as in etcd's Compare.
type Result uint8

// The relations of a compare.
const (
	Equal Result = iota
	NotEqual
	Greater
	Less
)

// Cmp is one compare of a Txn: Key's Target against Num (or Value).
type Cmp struct {
	Key    string
	Target Target
	Result Result
	Num    int64  // CreateRev, ModRev, Version, Lease
	Value  []byte // Value
}

// Created is the compare CreateRevision(key) result n.
func Created(key string, r Result, n int64) Cmp {
	return Cmp{Key: key, Target: CreateRev, Result: r, Num: n}
}

// Absent is the compare CreateRevision(key) == 0: the key does not exist.
func Absent(key string) Cmp { return Created(key, Equal, 0) }

// Exists is the compare CreateRevision(key) > 0.
func Exists(key string) Cmp { return Created(key, Greater, 0) }

// Modified is the compare ModRevision(key) == rev: the key is still as
// written at rev.
func Modified(key string, rev int64) Cmp {
	return Cmp{Key: key, Target: ModRev, Result: Equal, Num: rev}
}

// ValueIs is the compare Value(key) == v.
func ValueIs(key string, v []byte) Cmp {
	return Cmp{Key: key, Target: Value, Result: Equal, Value: v}
}

// OnLease is the compare Lease(key) == id.
func OnLease(key string, id int64) Cmp {
	return Cmp{Key: key, Target: Lease, Result: Equal, Num: id}
}

// OpKind is what an Op does.
type OpKind uint8

// The kinds of op.
const (
	Put    OpKind = iota // write Key
	Delete               // delete Key
	Get                  // read Key
	Count                // count Key (0 or 1), without its value
	Nested               // a Txn of its own (Op.Txn), as etcd's RequestTxn
)

// LeaseKind says which lease a Put attaches its key to. The caller maps
// it to an etcd lease id: the kernel knows when a record must expire, not
// which lease holds the bucket of that time.
type LeaseKind uint8

// The leases of a Put.
const (
	NoLease        LeaseKind = iota // none: the key lives until deleted
	RetentionLease                  // the retention bucket that outlives Until (a record's expiry)
	BucketLease                     // the retention bucket of now (a value kept a retention)
	SessionLease                    // the caller's session lease
	KeepLease                       // the key's lease as it is (etcd's IgnoreLease)
	LeaseID                         // the lease ID
)

// Op is one op of a Txn branch.
type Op struct {
	Kind OpKind
	Key  string
	// A Put writes Record (encoded by the caller) or Value; KeepValue
	// leaves the value as it is (etcd's IgnoreValue: the key's revision
	// moves, its content does not).
	Record    *Record
	Value     []byte
	KeepValue bool
	Lease     LeaseKind
	Until     time.Time // RetentionLease
	ID        int64     // LeaseID
	Txn       *Txn      // Nested
}

// PutRecord is the Put of rec on the retention lease that outlives its
// expiry.
func PutRecord(key string, rec *Record) Op {
	return Op{Kind: Put, Key: key, Record: rec, Lease: RetentionLease, Until: rec.Expires}
}

// PutValue is the Put of a raw value on a lease of kind l.
func PutValue(key string, v []byte, l LeaseKind) Op {
	return Op{Kind: Put, Key: key, Value: v, Lease: l}
}

// Del is the Delete of key.
func Del(key string) Op { return Op{Kind: Delete, Key: key} }

// Read is the Get of key.
func Read(key string) Op { return Op{Kind: Get, Key: key} }

// CountOf is the count-only Get of key.
func CountOf(key string) Op { return Op{Kind: Count, Key: key} }

// Txn is an etcd transaction as data: If every compare holds, Then's ops
// run, else Else's.
type Txn struct {
	If   []Cmp
	Then []Op
	Else []Op
}

func (c Cmp) String() string {
	t := [...]string{"create", "mod", "version", "value", "lease"}[c.Target]
	r := [...]string{"=", "!=", ">", "<"}[c.Result]
	v := strconv.FormatInt(c.Num, 10)
	if c.Target == Value {
		v = strconv.Quote(string(c.Value))
	}
	return t + "(" + c.Key + ")" + r + v
}

func (o Op) String() string {
	switch o.Kind {
	case Put:
		what := "value"
		if o.Record != nil {
			what = o.Record.State.String()
		}
		return "put(" + o.Key + "," + what + ")"
	case Delete:
		return "delete(" + o.Key + ")"
	case Get:
		return "get(" + o.Key + ")"
	case Count:
		return "count(" + o.Key + ")"
	}
	return "txn(" + o.Txn.String() + ")"
}

// String writes the Txn as If [...] Then [...] Else [...].
func (t *Txn) String() string {
	var b strings.Builder
	join := func(name string, n int, s func(int) string) {
		fmt.Fprintf(&b, "%s [", name)
		for i := range n {
			if i > 0 {
				b.WriteString(" ")
			}
			b.WriteString(s(i))
		}
		b.WriteString("]")
	}
	join("if", len(t.If), func(i int) string { return t.If[i].String() })
	b.WriteString(" ")
	join("then", len(t.Then), func(i int) string { return t.Then[i].String() })
	if len(t.Else) > 0 {
		b.WriteString(" ")
		join("else", len(t.Else), func(i int) string { return t.Else[i].String() })
	}
	return b.String()
}

// Delivery is what became of a Txn the caller sent.
type Delivery uint8

// The deliveries of a Txn.
const (
	Applied Delivery = iota // its compares held: Then ran
	Refused                 // a compare failed: Else ran, and Reply says what it read
	Full                    // etcd is over its quota (NOSPACE): it refuses any Txn with a Put, even one whose Else would run
	Failed                  // no answer: see Reply.MayHaveLanded
)

// Reply is the outcome of a Txn, as the caller learnt it.
type Reply struct {
	Delivery Delivery
	Rev      int64 // the revision of the answer: the Put's ModRevision when Applied
	Lease    int64 // Applied: the lease the first record put was attached to (0: none)

	// Refused: what the Else branch read, decoded by the caller.
	Cur       *Record  // the record (nil: absent)
	OwnerGone bool     // the session's owner key did not exist
	Epoch     int64    // the shard epoch etcd holds (guarded Txns)
	Set       SetValue // the shard set etcd holds (guarded Txns)
	ValueRev  int64    // the value the Txn compared (Enqueue's IfValue): its ModRevision

	// Failed: MayHaveLanded says the Txn may have been applied (it left
	// this process and its answer was lost, or came too late), NotSent
	// that it never left (its context ended in the queue), Retry that the
	// caller may try again (its context lives; the error is transient).
	// Err is the error, reported if the operation gives up.
	MayHaveLanded, NotSent, Retry bool
	Err                           error
}

// SetValue is the shard set value as etcd holds it (Rev 0: none).
type SetValue struct {
	Value []byte
	Rev   int64
}

// MaxTries bounds an operation's own retries of one etcd write.
const MaxTries = 4

// MaxRounds bounds how often a claim (or an enqueue, or a move) judges the
// record again after a refused write before it gives up.
const MaxRounds = 8

// Backoff is how long an operation waits before its retry number try
// (from 0): 25 ms, doubling up to 800 ms.
func Backoff(try int) time.Duration { return time.Duration(25<<min(try, 5)) * time.Millisecond }

// earlier wraps the error of a try that was never sent when an earlier
// try of the same write may have landed: the write as a whole may have.
func earlier(err error) error {
	return fmt.Errorf("an earlier try may have landed; the last was not sent (%v)", err)
}
