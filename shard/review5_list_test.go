package shard_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// idem.Store.List: "every tenant's when tenant is empty, in key order, one
// page at a time (ListOptions.After, Limit)". A shard set sorts what its
// shards list by (tenant, id), but each shard pages in etcd key order
// ("<tenant>/<id>"), where tenant "t-b" comes before "t" ('-' < '/'): a
// page cut after t/y resumes past t-b/x in etcd, and never lists it (on several
// shards); on one shard a page cut after t-b/x resumes before t/y, and lists
// it twice.
func TestReview5ShardListAllTenantsPagesSkipARecord(t *testing.T) {
	for _, names := range [][]string{{"a"}, {"a", "b", "c"}} {
		t.Run(fmt.Sprintf("%d shards", len(names)), func(t *testing.T) {
			prefix := confPrefix(t)
			s := openSet(t, prefix, 1, names, names...)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			keys := []etcdstore.Key{{Tenant: "t", ID: "y"}, {Tenant: "t", ID: "z"}, {Tenant: "t-b", ID: "x"}}
			fp, _ := etcdstore.FingerprintOf(nil)
			for _, k := range keys {
				if _, err := s.Run(ctx, k, fp, func(context.Context, *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
					return etcdstore.Outcome{Body: []byte("ok")}, etcdstore.EndSave
				}); err != nil {
					t.Fatal(err)
				}
			}
			// One page of everything lists both.
			all, err := s.List(ctx, "", etcdstore.ListOptions{})
			if err != nil || len(all) != len(keys) {
				t.Fatalf("List = %d records, %v; want %d", len(all), err, len(keys))
			}
			// Page by page (Limit 2), as `idem ls` and the console do.
			var got []etcdstore.Key
			var after *etcdstore.Key
			for range 5 {
				page, err := s.List(ctx, "", etcdstore.ListOptions{Limit: 2, After: after})
				if err != nil {
					t.Fatal(err)
				}
				for _, r := range page {
					got = append(got, r.Key)
				}
				if len(page) < 2 {
					break
				}
				after = &page[len(page)-1].Key
			}
			var one []etcdstore.Key
			for _, r := range all {
				one = append(one, r.Key)
			}
			if fmt.Sprint(got) != fmt.Sprint(one) {
				t.Fatalf("List page by page (limit 2) = %v; want each record once, as one page lists them: %v", got, one)
			}
		})
	}
}
