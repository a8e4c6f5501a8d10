package jobs

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// A plain key whose work failed, as idem before kinds (record format 1, no
// "k") saved it in the jobs tenant: done, a saved error, no body. The
// issue's defect (c) was that jobs read it as a failed job with no kind;
// FromRecord's comment says records written before kinds "fall through to
// the job state's own marker", but a saved error with no body skips that
// marker and is read as a failed job: `idem jobs ls` and the console list
// it, for as long as such records live (a retention after the upgrade,
// and whatever a not-yet-upgraded process writes meanwhile).
func TestReview5LegacyFailedPlainKeyIsNotAJob(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	s := newStore(t, prefix)
	q := newQueue(t, s)
	fp, err := etcdstore.FingerprintOf([]byte(`{"amount":5}`))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	meta, _ := json.Marshal(map[string]any{"s": "done", "fp": fp.String(), "t": 7, "c": now.UnixMilli(), "x": now.Add(time.Hour).UnixMilli(), "e": "card declined"})
	v := binary.AppendUvarint([]byte{1}, uint64(len(meta)))
	v = append(v, meta...)
	if _, err := cluster.MustClient(t).Put(ctx, prefix+"k/"+q.Tenant()+"/charge-9", string(v)); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx, q.Key("charge-9"))
	if err != nil || rec.Kind != "" || rec.Outcome.Err != "card declined" {
		t.Fatalf("the legacy record reads as %+v, %v; want done, no kind, its saved error", rec, err)
	}
	if j, err := q.Get(ctx, "charge-9"); !errors.Is(err, ErrNotJob) {
		t.Errorf("Queue.Get of a failed plain key written before kinds = %+v, %v; want ErrNotJob", j, err)
	}
	got, err := q.List(ctx, ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range got {
		t.Errorf("Queue.List lists the plain key as a job: %s state %s kind %q err %q", j.Key, j.State, j.Kind, j.Err)
	}
}
