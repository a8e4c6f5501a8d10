package etcdmodel

import (
	"errors"
	"slices"
	"testing"

	"github.com/idem-dev/idem/internal/kernel"
)

func put(k, v string) kernel.Op { return kernel.PutValue(k, []byte(v), kernel.NoLease) }

func putOn(k, v string, id int64) kernel.Op {
	op := kernel.PutValue(k, []byte(v), kernel.LeaseID)
	op.ID = id
	return op
}

func nest(t kernel.Txn) kernel.Op { return kernel.Op{Kind: kernel.Nested, Txn: &t} }

// TestRules pins the rules the package documents, one case each, on the
// model and on a real etcd at once: every Txn runs on both, their answers
// and states must agree, and the model's answer must be the one the rule
// says.
func TestRules(t *testing.T) {
	p := newPair(t, "/s/")
	// do runs tx on both sides and returns the model's answer and the
	// revision before it.
	do := func(t *testing.T, tx *kernel.Txn) (*Response, error, int64) {
		t.Helper()
		rev := p.m.Rev()
		if err := p.txn(tx); err != nil {
			t.Fatal(err)
		}
		if err := p.sameState(); err != nil {
			t.Fatal(err)
		}
		return p.last.resp, p.last.err, rev
	}
	must := func(t *testing.T, tx *kernel.Txn) *Response {
		t.Helper()
		r, err, _ := do(t, tx)
		if err != nil {
			t.Fatalf("%v: %v", tx, err)
		}
		return r
	}
	refused := func(t *testing.T, tx *kernel.Txn, want error) {
		t.Helper()
		if _, err, _ := do(t, tx); !errors.Is(err, want) {
			t.Fatalf("%v: error %v, want %v", tx, err, want)
		}
	}
	for _, c := range rules {
		t.Run(c.name, func(t *testing.T) { c.run(t, p, must, refused, do) })
	}
}

type (
	mustFunc    func(*testing.T, *kernel.Txn) *Response
	refusedFunc func(*testing.T, *kernel.Txn, error)
	doFunc      func(*testing.T, *kernel.Txn) (*Response, error, int64)
)

var rules = []struct {
	name string
	run  func(t *testing.T, p *pair, must mustFunc, refused refusedFunc, do doFunc)
}{
	{"nested compares see the state before the txn", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, _ doFunc) {
		must(t, &kernel.Txn{Then: []kernel.Op{put("/s/1/a", "old")}})
		r := must(t, &kernel.Txn{Then: []kernel.Op{
			put("/s/1/a", "new"),
			nest(kernel.Txn{If: []kernel.Cmp{kernel.ValueIs("/s/1/a", []byte("old"))}, Then: []kernel.Op{kernel.Read("/s/1/a")}}),
		}})
		if n := r.Results[1].Txn; !n.Succeeded || string(n.Results[0].KVs[0].Value) != "new" {
			t.Fatalf("nested: %s: its compare should see the old value, its get the new", dump(n))
		}
	}},
	{"gets see the writes before them, at the txn's revision", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, _ doFunc) {
		r := must(t, &kernel.Txn{Then: []kernel.Op{kernel.CountOf("/s/2/a"), put("/s/2/a", "x"), kernel.Read("/s/2/a"), kernel.CountOf("/s/2/a")}})
		if kv := r.Results[2].KVs[0]; kv.ModRev != r.Rev || kv.CreateRev != r.Rev || kv.Version != 1 || r.Results[0].Count != 0 || r.Results[3].Count != 1 {
			t.Fatalf("%s", dump(r))
		}
	}},
	{"a put in a nested txn may be deleted by a later nested txn", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, do doFunc) {
		r, _, rev := do(t, &kernel.Txn{Then: []kernel.Op{
			nest(kernel.Txn{Then: []kernel.Op{put("/s/3/a", "x")}}),
			nest(kernel.Txn{Then: []kernel.Op{kernel.Del("/s/3/a")}}),
		}})
		if _, ok := p.m.Get("/s/3/a"); ok || r.Rev != rev+1 || r.Results[1].Txn.Results[0].Deleted != 1 {
			t.Fatalf("%s", dump(r))
		}
	}},
	{"a delete in a nested txn may not be put by a later one", func(t *testing.T, p *pair, _ mustFunc, refused refusedFunc, _ doFunc) {
		refused(t, &kernel.Txn{Then: []kernel.Op{
			nest(kernel.Txn{Then: []kernel.Op{kernel.Del("/s/4/a")}}),
			nest(kernel.Txn{Else: []kernel.Op{put("/s/4/a", "x")}}),
		}}, ErrDuplicateKey)
	}},
	{"a nested txn's delete conflicts with its parent's put, wherever it stands", func(t *testing.T, p *pair, _ mustFunc, refused refusedFunc, _ doFunc) {
		refused(t, &kernel.Txn{Then: []kernel.Op{put("/s/5/a", "x"), nest(kernel.Txn{Then: []kernel.Op{kernel.Del("/s/5/a")}})}}, ErrDuplicateKey)
		refused(t, &kernel.Txn{Then: []kernel.Op{nest(kernel.Txn{Then: []kernel.Op{put("/s/5/a", "x")}}), kernel.Del("/s/5/a")}}, ErrDuplicateKey)
	}},
	{"a nested txn's then and else may put one key, two nested txns may not", func(t *testing.T, p *pair, must mustFunc, refused refusedFunc, _ doFunc) {
		must(t, &kernel.Txn{Then: []kernel.Op{nest(kernel.Txn{Then: []kernel.Op{put("/s/6/a", "x")}, Else: []kernel.Op{put("/s/6/a", "y")}})}})
		refused(t, &kernel.Txn{Then: []kernel.Op{
			nest(kernel.Txn{Then: []kernel.Op{put("/s/6/a", "x")}}),
			nest(kernel.Txn{Else: []kernel.Op{put("/s/6/a", "y")}}),
		}}, ErrDuplicateKey)
	}},
	{"two deletes of one key pass, the second deletes nothing", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, _ doFunc) {
		must(t, &kernel.Txn{Then: []kernel.Op{put("/s/7/a", "x")}})
		r := must(t, &kernel.Txn{Then: []kernel.Op{kernel.Del("/s/7/a"), kernel.Del("/s/7/a")}})
		if r.Results[0].Deleted != 1 || r.Results[1].Deleted != 0 {
			t.Fatalf("%s", dump(r))
		}
	}},
	{"both branches are checked for duplicates, whichever runs", func(t *testing.T, p *pair, _ mustFunc, refused refusedFunc, _ doFunc) {
		refused(t, &kernel.Txn{Then: []kernel.Op{kernel.Read("/s/8/a")}, Else: []kernel.Op{put("/s/8/a", "x"), put("/s/8/a", "y")}}, ErrDuplicateKey)
	}},
	{"puts are checked on the path taken only, in op order", func(t *testing.T, p *pair, must mustFunc, refused refusedFunc, _ doFunc) {
		keep := kernel.Op{Kind: kernel.Put, Key: "/s/9/a", KeepValue: true}
		gone := putOn("/s/9/b", "x", unknownLease)
		must(t, &kernel.Txn{Then: []kernel.Op{kernel.Read("/s/9/a")}, Else: []kernel.Op{keep, gone}})
		must(t, &kernel.Txn{Then: []kernel.Op{nest(kernel.Txn{If: []kernel.Cmp{kernel.Absent("/s/9/a")}, Else: []kernel.Op{keep}})}})
		refused(t, &kernel.Txn{Then: []kernel.Op{keep, gone}}, ErrKeyNotFound)
		refused(t, &kernel.Txn{Then: []kernel.Op{gone, keep}}, ErrLeaseNotFound)
		both := keep
		both.Lease, both.ID = kernel.LeaseID, unknownLease
		refused(t, &kernel.Txn{Then: []kernel.Op{both}}, ErrLeaseNotFound) // the lease first
		refused(t, &kernel.Txn{Then: []kernel.Op{put("/s/9/c", "x"), nest(kernel.Txn{Then: []kernel.Op{keep}})}}, ErrKeyNotFound)
	}},
	{"keep value, keep lease, and no lease detaches", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, _ doFunc) {
		id, err := p.grant(3600)
		if err != nil {
			t.Fatal(err)
		}
		must(t, &kernel.Txn{Then: []kernel.Op{putOn("/s/10/a", "v", id), putOn("/s/10/b", "v", id)}})
		keep := kernel.Op{Kind: kernel.Put, Key: "/s/10/a", KeepValue: true, Lease: kernel.KeepLease}
		must(t, &kernel.Txn{Then: []kernel.Op{keep, put("/s/10/b", "w")}})
		a, _ := p.m.Get("/s/10/a")
		if string(a.Value) != "v" || a.Lease != id || a.Version != 2 {
			t.Fatalf("kept: %s", dumpKVs([]KV{a}))
		}
		if keys, _ := p.m.Keys(id); !slices.Equal(keys, []string{"/s/10/a"}) {
			t.Fatalf("lease keys %q", keys)
		}
	}},
	{"the revision moves only when a key changes", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, do doFunc) {
		for _, tx := range []*kernel.Txn{
			{Then: []kernel.Op{kernel.Read("/s/11/a"), kernel.Del("/s/11/a")}},
			{If: []kernel.Cmp{kernel.Exists("/s/11/a")}, Then: []kernel.Op{put("/s/11/a", "x")}, Else: []kernel.Op{nest(kernel.Txn{})}},
		} {
			if r, _, rev := do(t, tx); r.Rev != rev {
				t.Fatalf("%v moved the revision: %s", tx, dump(r))
			}
		}
		must(t, &kernel.Txn{Then: []kernel.Op{put("/s/11/a", "x")}})
		if r, _, rev := do(t, &kernel.Txn{Then: []kernel.Op{put("/s/11/a", "x"), put("/s/11/b", "x")}}); r.Rev != rev+1 {
			t.Fatalf("two puts, same value: %s after %d", dump(r), rev)
		}
	}},
	{"compares of an absent key", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, _ doFunc) {
		for _, c := range []struct {
			cmp  kernel.Cmp
			want bool
		}{
			{kernel.Cmp{Key: "/s/12/a", Target: kernel.Value, Result: kernel.NotEqual, Value: []byte("x")}, false},
			{kernel.Cmp{Key: "/s/12/a", Target: kernel.Value, Result: kernel.Equal}, false},
			{kernel.Cmp{Key: "/s/12/a", Target: kernel.Version, Result: kernel.Equal}, true},
			{kernel.Cmp{Key: "/s/12/a", Target: kernel.ModRev, Result: kernel.Less, Num: 1}, true},
			{kernel.Cmp{Key: "/s/12/a", Target: kernel.Lease, Result: kernel.Equal}, true},
		} {
			if r := must(t, &kernel.Txn{If: []kernel.Cmp{c.cmp}}); r.Succeeded != c.want {
				t.Fatalf("%v held: %v", c.cmp, r.Succeeded)
			}
		}
	}},
	{"a nested txn gets the ops its parent leaves", func(t *testing.T, p *pair, _ mustFunc, refused refusedFunc, do doFunc) {
		outer := &kernel.Txn{}
		for range 100 {
			outer.Then = append(outer.Then, kernel.Read("/s/13/a"))
		}
		inner := kernel.Txn{}
		for range MaxTxnOps - 100 {
			inner.Then = append(inner.Then, kernel.Read("/s/13/a"))
		}
		outer.Then = append(outer.Then[:99], nest(inner))
		if _, err, _ := do(t, outer); err != nil {
			t.Fatal(err)
		}
		inner.Then = append(inner.Then, kernel.Read("/s/13/a"))
		outer.Then[99] = nest(inner)
		refused(t, outer, ErrTooManyOps)
	}},
	{"revoke deletes the lease's keys in one revision", func(t *testing.T, p *pair, must mustFunc, _ refusedFunc, _ doFunc) {
		empty, _ := p.grant(3600)
		full, _ := p.grant(3600)
		must(t, &kernel.Txn{Then: []kernel.Op{putOn("/s/14/a", "x", full), putOn("/s/14/b", "x", full), put("/s/14/c", "x")}})
		for _, c := range []struct {
			id    int64
			moves int64
			err   error
		}{{empty, 0, nil}, {full, 1, nil}, {full, 0, ErrLeaseNotFound}} {
			rev := p.m.Rev()
			if err := p.do(step{kind: stepRevoke, lease: c.id}); err != nil {
				t.Fatal(err)
			}
			if !errors.Is(p.last.err, c.err) || p.m.Rev() != rev+c.moves {
				t.Fatalf("revoke %d: %v, revision %d after %d", c.id, p.last.err, p.m.Rev(), rev)
			}
			if err := p.sameState(); err != nil {
				t.Fatal(err)
			}
		}
	}},
}
