package etcdstore

import (
	"strings"
	"testing"
)

// FuzzKeyEncoding checks the isolation invariant: a key that validates is
// encoded under exactly its tenant's prefix and decodes back to itself.
func FuzzKeyEncoding(f *testing.F) {
	for _, s := range [][2]string{
		{"acme", "order-1"}, {"", "k"}, {"a", "../b/k"}, {"a.b", "/"}, {"a-b", ".."},
		{"a/b", "k"}, {"..", "k"}, {"a", "k\x00"}, {"a", ""}, {"x", strings.Repeat("k", 256)},
	} {
		f.Add(s[0], s[1])
	}
	ks := keyspace{prefix: "/idem/"}
	f.Fuzz(func(t *testing.T, tenant, id string) {
		k := Key{Tenant: tenant, ID: id}
		if err := k.Validate(); err != nil {
			return
		}
		enc := ks.record(k)
		tp := ks.tenant(k.tenant())
		if !strings.HasPrefix(enc, tp) {
			t.Fatalf("%v encodes to %q, outside its tenant prefix %q", k, enc, tp)
		}
		back, ok := ks.parseRecord(enc)
		if !ok || back.Tenant != k.tenant() || back.ID != id {
			t.Fatalf("%v encodes to %q which decodes to %v", k, enc, back)
		}
		// No other tenant's prefix contains it.
		for _, other := range []string{k.tenant() + "x", k.tenant()[:len(k.tenant())-1], "default"} {
			if other != k.tenant() && other != "" && strings.HasPrefix(enc, ks.tenant(other)) {
				t.Fatalf("%v is inside tenant %q's prefix", k, other)
			}
		}
	})
}
