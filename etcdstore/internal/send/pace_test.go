package send

import (
	"math"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/protobuf/proto"
)

const ms = time.Millisecond

func TestPacerHoldsNothingBeforeAMeasurement(t *testing.T) {
	var p pacer
	if h, ok := p.hold(); ok {
		t.Fatalf("hold %v before any batch was measured: the batch in flight should be the first measurement", h)
	}
}

// Where the round trip is long and etcd does not queue (data centres 50 ms
// apart), a further batch waits a small fraction of a round trip, not one.
func TestPacerLongRoundTripWithoutQueueingHoldsAFraction(t *testing.T) {
	var p pacer
	now := time.Unix(0, 0)
	for i := 0; i < 40; i++ {
		now = now.Add(50 * ms)
		p.observe(50*ms, i%4 == 0, now)
		p.observe(51*ms, false, now) // fuller batches take a little longer
	}
	h, ok := p.hold()
	if !ok || h != 50*ms/gatherDiv {
		t.Fatalf("hold %v (%v), want a %dth of the 50 ms round trip", h, ok, gatherDiv)
	}
}

// Where etcd queues (a local cluster under load: batches take several
// times a lone write's round trip), writes wait about as long as etcd
// would keep them queued, never longer than a batch's round trip.
func TestPacerQueueingHoldsTheQueueingDelay(t *testing.T) {
	var p pacer
	now := time.Unix(0, 0)
	p.observe(ms, true, now) // idle: a lone write, 1 ms
	for i := 0; i < 100; i++ {
		now = now.Add(6 * ms)
		p.observe(6*ms, false, now)
	}
	h, _ := p.hold()
	if h < 4900*time.Microsecond || h > 5*ms {
		t.Fatalf("hold %v, want the queueing delay, about 6 ms - 1 ms", h)
	}
	// The same load with a lone write as slow as the batches: nothing
	// queues; the hold falls to the gathering floor.
	var q pacer
	for i := 0; i < 100; i++ {
		now = now.Add(6 * ms)
		q.observe(6*ms, i == 0, now)
	}
	if h, _ := q.hold(); h != 6*ms/gatherDiv {
		t.Fatalf("hold %v without queueing, want %v", h, 6*ms/gatherDiv)
	}
}

// The hold is bounded by the smoothed round trip, and srtt follows a
// change by an eighth of it per batch (no jump on one slow batch).
func TestPacerBoundedAndDamped(t *testing.T) {
	var p pacer
	now := time.Unix(0, 0)
	p.observe(8*ms, false, now)
	p.observe(0, true, now) // a round trip too short to see (a coarse clock)
	if h, _ := p.hold(); h != 7*ms || p.srtt != 7*ms {
		t.Fatalf("hold %v, srtt %v: want both 7 ms (gain 1/8; the hold capped at srtt)", h, p.srtt)
	}
	p.observe(15*ms, false, now) // one slow batch
	if p.srtt != 8*ms {
		t.Fatalf("srtt %v after 7 ms then 15 ms, want 8 ms (gain 1/8)", p.srtt)
	}
	p.observe(-time.Second, false, now) // the clock stepped back
	if p.srtt < 0 {
		t.Fatalf("srtt %v went negative", p.srtt)
	}
}

// base, the round trip without queueing, ages out with its window: a
// cluster that moved (its leader now in another data centre) is not held
// to a round trip it no longer has.
func TestPacerBaseAgesOutWithItsWindow(t *testing.T) {
	var p pacer
	now := time.Unix(0, 0)
	p.observe(ms, true, now) // local leader
	for i := 0; i < 30; i++ {
		now = now.Add(time.Second)
		p.observe(50*ms, true, now) // the leader moved 50 ms away
	}
	if p.base != 50*ms {
		t.Fatalf("base %v after %v of 50 ms lone writes, want 50 ms", p.base, 30*time.Second)
	}
	if h, _ := p.hold(); h != 50*ms/gatherDiv {
		t.Fatalf("hold %v, want %v", h, 50*ms/gatherDiv)
	}
	// A window without a lone write keeps the figure it had.
	for i := 0; i < 30; i++ {
		now = now.Add(time.Second)
		p.observe(60*ms, false, now)
	}
	if p.base != 50*ms {
		t.Fatalf("base %v after a window without lone writes, want 50 ms kept", p.base)
	}
}

// Until a lone write is seen (a store that starts under load), the least
// round trip of any batch stands in for base.
func TestPacerWithoutALoneWriteUsesTheLeastBatch(t *testing.T) {
	var p pacer
	now := time.Unix(0, 0)
	p.observe(4*ms, false, now)
	p.observe(12*ms, false, now)
	if h, ok := p.hold(); !ok || h != p.srtt-4*ms {
		t.Fatalf("hold %v (%v), want srtt %v - 4 ms", h, ok, p.srtt)
	}
}

// sizeAtMost bounds the encoded size from above, for every shape the store
// sends, so that a batch never exceeds its byte limit on the wire.
func TestSizeAtMostBoundsTheEncodedSize(t *testing.T) {
	big := make([]byte, 70000)
	reqs := []*pb.TxnRequest{
		{},
		{Compare: []*pb.Compare{{Key: []byte("k"), Target: pb.Compare_CREATE, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_CreateRevision{CreateRevision: math.MaxInt64}}},
			Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte("k"), Value: big, Lease: math.MaxInt64, PrevKv: true, IgnoreValue: true, IgnoreLease: true}}}},
			Failure: []*pb.RequestOp{{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: []byte("k"), RangeEnd: []byte("l"), Limit: math.MaxInt64, Revision: math.MaxInt64,
				SortOrder: pb.RangeRequest_DESCEND, SortTarget: pb.RangeRequest_VALUE, Serializable: true, KeysOnly: true, CountOnly: true,
				MinModRevision: math.MaxInt64, MaxModRevision: math.MaxInt64, MinCreateRevision: math.MaxInt64, MaxCreateRevision: math.MaxInt64}}}}},
		{Compare: []*pb.Compare{{Key: big[:300], RangeEnd: []byte("z"), Target: pb.Compare_VALUE, Result: pb.Compare_NOT_EQUAL, TargetUnion: &pb.Compare_Value{Value: big[:5000]}}},
			Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: []byte("a"), RangeEnd: []byte("b"), PrevKv: true}}}}},
	}
	var inner []*pb.RequestOp
	for _, r := range reqs {
		inner = append(inner, &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: r}})
	}
	reqs = append(reqs, &pb.TxnRequest{Success: inner}, &pb.TxnRequest{Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestTxn{RequestTxn: &pb.TxnRequest{Success: inner}}}}})
	for i, r := range reqs {
		if got, want := sizeAtMost(r), proto.Size(r); got < want {
			t.Errorf("request %d: sizeAtMost %d < its encoded size %d", i, got, want)
		}
	}
}
