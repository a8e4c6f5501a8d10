package etcdstore

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Every bad input is refused with an error naming what is wrong, before any
// etcd write: the revision does not move.
func TestBadInputIsRejectedWithoutWriting(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t), WithMaxRecordSize(4096))
	ctx := testCtx(t)
	fp := fpOf(t, "p")
	good := Key{Tenant: "acme", ID: "order-1"}
	noop := func(context.Context, *Claim) ([]byte, error) { return nil, nil }
	claim := func(k Key, opts ...ClaimOption) error { _, _, err := s.Claim(ctx, k, fp, opts...); return err }
	do := func(params string) error { _, err := s.Do(ctx, good, []byte(params), noop); return err }

	// A held claim, for the cases that need one.
	held, _, err := s.Claim(ctx, Key{ID: "held"}, fp)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(ctx)

	cases := []struct {
		name string
		want error
		call func() error
	}{
		{"empty key", ErrInvalidKey, func() error { return claim(Key{ID: ""}) }},
		{"key over 255 bytes", ErrInvalidKey, func() error { return claim(Key{ID: strings.Repeat("k", 256)}) }},
		{"key with a space", ErrInvalidKey, func() error { return claim(Key{ID: "a b"}) }},
		{"key with NUL", ErrInvalidKey, func() error { return claim(Key{ID: "a\x00b"}) }},
		{"key with newline", ErrInvalidKey, func() error { return claim(Key{ID: "a\nb"}) }},
		{"key with DEL", ErrInvalidKey, func() error { return claim(Key{ID: "a\x7fb"}) }},
		{"non-ASCII key", ErrInvalidKey, func() error { return claim(Key{ID: "clé"}) }},
		{"invalid UTF-8 key", ErrInvalidKey, func() error { return claim(Key{ID: "\xff\xfe"}) }},
		{"key with a slash", ErrInvalidKey, func() error { return claim(Key{ID: "a/b"}) }},
		{"key ..", ErrInvalidKey, func() error { return claim(Key{ID: ".."}) }},
		{"key .", ErrInvalidKey, func() error { return claim(Key{ID: "."}) }},
		{"key reaching into another tenant", ErrInvalidKey, func() error { return claim(Key{Tenant: "a", ID: "../b/k"}) }},
		{"key naming the owner keys", ErrInvalidKey, func() error { return claim(Key{ID: "../../o/owner"}) }},
		{"tenant with slash", ErrInvalidTenant, func() error { return claim(Key{Tenant: "a/b", ID: "k"}) }},
		{"tenant ..", ErrInvalidTenant, func() error { return claim(Key{Tenant: "..", ID: "k"}) }},
		{"tenant starting with dot", ErrInvalidTenant, func() error { return claim(Key{Tenant: ".a", ID: "k"}) }},
		{"tenant over 64", ErrInvalidTenant, func() error { return claim(Key{Tenant: strings.Repeat("t", 65), ID: "k"}) }},
		{"tenant with space", ErrInvalidTenant, func() error { return claim(Key{Tenant: "a b", ID: "k"}) }},
		{"tenant with NUL", ErrInvalidTenant, func() error { return claim(Key{Tenant: "a\x00", ID: "k"}) }},
		{"empty attempt", ErrInvalidArgument, func() error { return claim(good, WithAttempt("")) }},
		{"attempt over 64", ErrInvalidArgument, func() error { return claim(good, WithAttempt(strings.Repeat("a", 65))) }},
		{"negative deadline", ErrInvalidArgument, func() error { return claim(good, WithDeadline(-1)) }},
		{"unknown error policy", ErrInvalidArgument, func() error { _, err := s.Do(ctx, good, nil, noop, OnError(7)); return err }},
		{"JSON with a repeated member", ErrInvalidParams, func() error { return do(`{"a":1,"a":2}`) }},
		{"JSON number beyond float64", ErrInvalidParams, func() error { return do(`{"a":1e400}`) }},
		{"JSON number not exact", ErrInvalidParams, func() error { return do(`[0.1000000000000000000001]`) }},
		{"outcome too large", ErrTooLarge, func() error {
			return held.Complete(ctx, Outcome{Body: make([]byte, 5000)})
		}},
		{"checkpoint too large", ErrTooLarge, func() error { return held.Checkpoint(ctx, make([]byte, 5000)) }},
		{"extra op inside the prefix", ErrInvalidArgument, func() error {
			return held.Complete(ctx, Outcome{}, clientv3.OpPut(s.ks.record(Key{ID: "other"}), "x"))
		}},
		{"extra range op over the prefix", ErrInvalidArgument, func() error {
			return held.Complete(ctx, Outcome{}, clientv3.OpDelete("/", clientv3.WithFromKey()))
		}},
		{"too many extra ops", ErrInvalidArgument, func() error {
			ops := make([]clientv3.Op, MaxExtraOps+1)
			for i := range ops {
				ops[i] = clientv3.OpPut("/elsewhere", "x")
			}
			return held.Complete(ctx, Outcome{}, ops...)
		}},
		{"nested txn op", ErrInvalidArgument, func() error {
			return held.Complete(ctx, Outcome{}, clientv3.OpTxn(nil, nil, nil))
		}},
		{"get bad key", ErrInvalidKey, func() error { _, err := s.Get(ctx, Key{ID: ""}); return err }},
		{"evict bad tenant", ErrInvalidTenant, func() error { return s.Evict(ctx, Key{Tenant: "x/y", ID: "k"}) }},
		{"wait bad key", ErrInvalidKey, func() error { _, err := s.Wait(ctx, Key{ID: " "}); return err }},
		{"list bad tenant", ErrInvalidTenant, func() error { _, err := s.List(ctx, "a/b", ListOptions{}); return err }},
		{"list bad limit", ErrInvalidArgument, func() error { _, err := s.List(ctx, "", ListOptions{Limit: 5000}); return err }},
		{"list bad state", ErrInvalidArgument, func() error { _, err := s.List(ctx, "", ListOptions{State: "pending"}); return err }},
		{"list after another tenant", ErrInvalidArgument, func() error {
			_, err := s.List(ctx, "acme", ListOptions{After: &Key{Tenant: "other", ID: "k"}})
			return err
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := revision(t, cli)
			err := tc.call()
			if !errors.Is(err, tc.want) {
				t.Fatalf("error = %v; want %v", err, tc.want)
			}
			if after := revision(t, cli); after != before {
				t.Fatalf("revision moved %d -> %d: bad input wrote to etcd", before, after)
			}
		})
	}
	// The held claim survived every refused write.
	if err := held.Checkpoint(ctx, []byte("still mine")); err != nil {
		t.Fatalf("claim after refused writes: %v", err)
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	cli := client(t)
	ctx := testCtx(t)
	for name, opt := range map[string]Option{
		"prefix without slash":     WithPrefix("/idem"),
		"empty prefix":             WithPrefix(""),
		"retention under 1s":       WithRetention(500_000_000),
		"retention not whole":      WithRetention(1_500_000_000),
		"bucket wider than window": WithBucketWidth(48 * 3600 * 1_000_000_000),
		"session ttl 1s":           WithSessionTTL(1_000_000_000),
		"record size 1 byte":       WithMaxRecordSize(1),
		"record size 2 MiB":        WithMaxRecordSize(2 << 20),
		"retry-after 0":            WithRetryAfter(0),
		"end timeout 0":            WithEndTimeout(0),
	} {
		if s, err := New(ctx, cli, opt); !errors.Is(err, ErrInvalidArgument) {
			if s != nil {
				s.Close()
			}
			t.Errorf("%s: New = %v; want ErrInvalidArgument", name, err)
		}
	}
	if _, err := New(ctx, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("nil client: New = %v; want ErrInvalidArgument", err)
	}
}

// Tenants never see each other's keys, whatever bytes the keys hold.
func TestTenantsAreIsolated(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	ids := []string{"k", "..ab", "ab", "%2F..%2Fab%2Fk", `..\ab\k`}
	for _, tenant := range []string{"a", "ab", "a-b", "a.b"} {
		for _, id := range ids {
			if _, err := s.Do(ctx, Key{Tenant: tenant, ID: id}, []byte(tenant), func(context.Context, *Claim) ([]byte, error) {
				return []byte(tenant), nil
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tenant := range []string{"a", "ab", "a-b", "a.b"} {
		recs, err := s.List(ctx, tenant, ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) != len(ids) {
			t.Fatalf("List(%q) = %d records; want %d", tenant, len(recs), len(ids))
		}
		for _, r := range recs {
			if r.Key.Tenant != tenant || string(r.Outcome.Body) != tenant {
				t.Fatalf("List(%q) returned %v with body %q", tenant, r.Key, r.Outcome.Body)
			}
		}
		// The same id in another tenant is another operation: "a"'s replay
		// is never served to "ab".
		rec, err := s.Get(ctx, Key{Tenant: tenant, ID: "%2F..%2Fab%2Fk"})
		if err != nil || string(rec.Outcome.Body) != tenant {
			t.Fatalf("Get(%s) = %v, %v", tenant, rec, err)
		}
	}
	all, err := s.List(ctx, "", ListOptions{Limit: 7})
	if err != nil || len(all) != 7 {
		t.Fatalf("List all, page of 7 = %d, %v", len(all), err)
	}
	rest, err := s.List(ctx, "", ListOptions{After: &all[6].Key, Limit: 100})
	if err != nil || len(rest) != 4*len(ids)-7 {
		t.Fatalf("second page = %d records, %v; want %d", len(rest), err, 4*len(ids)-7)
	}
}

func TestEvict(t *testing.T) {
	cli := client(t)
	s := newStore(t, cli, testPrefix(t))
	ctx := testCtx(t)
	key := Key{ID: "k"}
	c, _, err := s.Claim(ctx, key, fpOf(t, "p"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Evict(ctx, key); err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(ctx, Outcome{}); !errors.Is(err, ErrFenced) {
		t.Fatalf("Complete after evict = %v; want ErrFenced", err)
	}
	if err := s.Evict(ctx, key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second Evict = %v; want ErrNotFound", err)
	}
}

// New against an etcd that does not answer returns ErrUnavailable within
// its request timeout, even with a context that never ends (the README's
// ten lines, etcd not started).
func TestNewWithoutEtcdIsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	done := make(chan error, 1)
	go func() {
		s, err := New(context.Background(), cli) // the default request timeout, 5 s
		if s != nil {
			s.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("New without etcd: %v, want ErrUnavailable", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("New without etcd has not returned after 30 s with the default 5 s request timeout")
	}
}
