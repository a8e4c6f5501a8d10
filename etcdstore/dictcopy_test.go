package etcdstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// A dictionary's copy on a lease is what keeps the dictionary readable
// while the records on that lease live. When writing the copy fails, the
// record is written without the dictionary (and the copy tried again next
// time): never compressed against a dictionary with no copy on its lease,
// which the dictionary's end would leave unreadable.
func TestRecordNeverNamesADictionaryWithoutItsCopy(t *testing.T) {
	prefix := testPrefix(t)
	cli := client(t)
	ctx := testCtx(t)
	a := newStore(t, client(t), prefix)
	warm(t, a, prefix)
	waitFor(t, "a dictionary", func() bool { return a.Metrics().Dictionaries.Published == 1 })

	// b adopts the dictionary, and every copy it writes onto its own
	// leases fails before etcd sees it.
	dicts := a.ks.dictionaries()
	var failed atomic.Int32
	hook := func(method string, req any, invoke func() error) error {
		if txn, ok := req.(*pb.TxnRequest); ok && len(txn.Compare) == 1 {
			if k := string(txn.Compare[0].Key); strings.HasPrefix(k, dicts) && strings.Count(k[len(dicts):], "/") == 1 {
				failed.Add(1)
				return errLost
			}
		}
		return invoke()
	}
	// A retention of its own: leases of its own (a process with the same
	// retention shares the buckets, and a's copies on them).
	b := newStore(t, hookedClient(t, hook), prefix, WithRetention(90*time.Minute))
	for i := 0; i < 50 && failed.Load() == 0; i++ {
		key := Key{ID: fmt.Sprintf("b-%d", i)}
		body := paymentLike(200 + i)
		if _, err := b.Do(ctx, key, nil, func(context.Context, *Claim) ([]byte, error) { return body, nil }); err != nil {
			t.Fatal(err)
		}
		raw, err := cli.Get(ctx, b.ks.record(key))
		if err != nil || len(raw.Kvs) != 1 {
			t.Fatalf("record of %s: %v, %v", key, raw, err)
		}
		id := dictionaryOf(t, cli, b, key)
		if id == 0 {
			continue
		}
		copyOn := dicts + strconv.FormatUint(id, 10) + "/" + strconv.FormatInt(raw.Kvs[0].Lease, 16)
		c, err := cli.Get(ctx, copyOn)
		if err != nil {
			t.Fatal(err)
		}
		if len(c.Kvs) == 0 {
			t.Fatalf("%s is compressed against dictionary %d, which has no copy on its lease %x (the copy's write failed)", key, id, raw.Kvs[0].Lease)
		}
	}
	if failed.Load() == 0 {
		t.Fatal("b never wrote a copy of the dictionary: the test does not test what it says")
	}
}
