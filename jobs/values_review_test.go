package jobs

import (
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// This file is a review of schedules' cursors as values placed by key on a
// shard set (shard.Store.GetValue, SetValue; Queue.cursorGet, cursorPut).
// It drives real processes with the gates of cursor_review_test.go.

// DEFECT: a process that learns a newer set while it reads a placed value
// answers "there is none" for a value that exists. shard.Store.GetValue
// reads the value where the set it routes by places it, and when it finds
// none (here a marker: the value was handed over to b) it rereads the set
// and looks again only if the set in force is newer than the one it takes
// *after* the read: s.current() is called once the read returned, not
// before it. When the process learnt the newer set in the meantime (its
// watch loop every Check, another goroutine's refused write, a reload by
// a read of a job: all ordinary during a change), the set it compares with
// is already the newer one, reload finds nothing newer, and GetValue
// returns "none", though it read under the older set. Queue.PauseSchedule
// then fails with etcdstore.ErrNotFound, "no scheduler ran it", for a
// schedule whose cursor is on b (idem jobs pause tells the operator it
// does not exist). ARCHITECTURE.md: "a read that finds none rereads the
// set in force"; it has, but it does not look again.
func TestReviewPauseDuringALearntChangeSaysNoSuchSchedule(t *testing.T) {
	ctx := testCtx(t)
	prefix := testPrefix(t)
	name := scheduleNamePlaced("learn", [][]string{{"a", "b"}}, []string{"b"})
	var subs submissions
	g := newCursorGate(name)
	// A process of generation 1 that learns of changes only when told (its
	// Check is an hour): its link to shard a is gated.
	set1 := newShardProcess(t, prefix, 1, []string{"a"}, nil, time.Hour, map[string]*clientv3.Client{"a": gatedClient(t, g)})
	q1 := newShardQueue(t, set1)
	s1 := newTestScheduler(t, q1, subs.schedule(name))
	waitFor(t, func() bool { _, ok := scheduleInfo(t, set1.Shard("a"), name); return ok })
	s1.Close()

	// Generation 2 hands the cursor over to b (a read does it).
	set2 := newShardProcess(t, prefix, 2, []string{"a", "b"}, []string{"a"}, 100*time.Millisecond, nil)
	inForce(t, set2, 2)
	if err := newShardQueue(t, set2).PauseSchedule(ctx, name, false); err != nil { // not paused: a read, which hands it over
		t.Fatal(err)
	}
	if live := liveCursors(t, set2, name); len(live) != 1 || live["b"].Name == "" {
		t.Fatalf("cursors after generation 2 read it: %+v; want one, on b", live)
	}
	if set1.Status().InForce.Generation != 1 {
		t.Fatal("the process of generation 1 learnt generation 2 already: the test proves nothing")
	}

	// The operator pauses the schedule through the process of generation
	// 1. Its read of the cursor on a (a marker now) is held until the
	// process has learnt generation 2, as its watch loop would.
	g.arm("hold-range")
	defer g.letGo()
	done := make(chan error, 1)
	go func() { done <- q1.PauseSchedule(ctx, name, true) }()
	g.reach(t)
	set1.Check(ctx, 2*time.Second)
	if set1.Status().InForce.Generation != 2 {
		t.Fatal("the process did not learn generation 2: the test proves nothing")
	}
	g.letGo()
	err := <-done
	if errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("PauseSchedule(%s) = %v; its cursor exists, on b (%+v)", name, err, liveCursors(t, set2, name))
	}
	if err != nil {
		t.Fatal(err)
	}
	if si := liveCursors(t, set2, name)["b"]; !si.Paused {
		t.Fatalf("after PauseSchedule returned nil, the cursor on b is %+v; want paused", si)
	}
}
