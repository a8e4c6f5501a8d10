package etcdstore

import (
	"reflect"
	"testing"
)

// The commit "a hand-over's answered record is the stored one" rounds the
// Moved record's times so that Forward's answer is the record a read
// returns. It is still not: the answer lacks the retention lease the
// record was written on (a read, and a second Forward, report it).
func TestReview3ForwardAnswerIsTheStoredRecord(t *testing.T) {
	s := newStore(t, client(t), testPrefix(t), withEpochs())
	ctx := testCtx(t)
	key := Key{ID: "gone"}
	landed, err := s.forwardKey(ctx, key, "b")
	if err != nil || landed.State != Moved {
		t.Fatalf("Forward = %+v, %v; want a Moved record", landed, err)
	}
	read, err := s.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	found, err := s.forwardKey(ctx, key, "b")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(found, read) {
		t.Fatalf("the second Forward's record differs from a read:\n%+v\n%+v", found, read)
	}
	if !reflect.DeepEqual(landed, read) {
		t.Errorf("Forward's landed record is not the stored one (Lease %d, read %d):\nlanded %+v\nread   %+v", landed.Lease, read.Lease, landed, read)
	}
}
