package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// DEFECT: idem jobs schedules --shards-file shows a schedule's stale
// cursor. When a set change moves a cursor, the scheduler (or idem jobs
// pause) copies it to its new shard and leaves the old copy where it was;
// the command reads every shard and, for a name found on two, keeps the
// one whose Last is later, and on a tie the first shard's: the stale
// copy. JOBS.md: "idem jobs schedules shows each cursor from its shard".
// Here an operator pauses a schedule (idem jobs pause, which carries the
// cursor over to b and pauses it there) and idem jobs schedules then says
// it is not paused.
func TestReviewJobsSchedulesShowsTheStaleCopy(t *testing.T) {
	file1, _ := twoShards(t, "generation: 1\nplacement: [a]\n")
	body, err := os.ReadFile(file1)
	if err != nil {
		t.Fatal(err)
	}
	file2 := filepath.Join(filepath.Dir(file1), "shards-2.yaml")
	two := strings.Replace(strings.Replace(string(body), "generation: 1", "generation: 2", 1), "placement: [a]", "placement: [a, b]", 1)
	if err := os.WriteFile(file2, []byte(two), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	set1 := openShards(t, file1)
	q1, err := jobs.NewOnShards(set1)
	if err != nil {
		t.Fatal(err)
	}
	// A schedule whose name generation 2 places on b.
	var name string
	for i := 0; name == ""; i++ {
		n := fmt.Sprintf("nightly-%d", i)
		if (shard.Placement{Shards: []string{"a", "b"}}).Place(etcdstore.Key{Tenant: jobs.DefaultTenant, ID: "schedule." + n}) == "b" {
			name = n
		}
	}
	s1, err := jobs.NewScheduler(q1, []jobs.Schedule{{Name: name, Kind: "report", Cron: "0 3 * * *", MaxSkew: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		infos, err := jobs.Schedules(ctx, &set1.Shard("a").Admin, jobs.DefaultTenant)
		if err == nil && len(infos) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no cursor on a: %v, %v", infos, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	s1.Close()
	// A queued job that generation 2 places on b: a is not drained while
	// it lives, so the hand-over lasts and the cursor is carried over.
	var keep string
	for i := 0; keep == ""; i++ {
		if id := fmt.Sprintf("keep-%d", i); (shard.Placement{Shards: []string{"a", "b"}}).Place(q1.Key(id)) == "b" {
			keep = id
		}
	}
	if _, err := q1.Submit(ctx, keep, "report", nil); err != nil {
		t.Fatal(err)
	}

	// Generation 2 in force; the operator pauses the schedule.
	set2 := openShards(t, file2)
	for deadline := time.Now().Add(30 * time.Second); set2.Status().InForce.Generation != 2; {
		if time.Now().After(deadline) {
			t.Fatalf("generation 2 not in force: %+v", set2.Status())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if out, err := runCmd(t, "jobs", "pause", "--shards-file", file2, name); err != nil {
		t.Fatalf("idem jobs pause = %q, %v", out, err)
	}
	onB, err := jobs.Schedules(ctx, &set2.Shard("b").Admin, jobs.DefaultTenant)
	if err != nil || len(onB) != 1 || !onB[0].Paused {
		t.Fatalf("the cursor on b, its shard under generation 2: %+v, %v; want it paused", onB, err)
	}
	out, err := runCmd(t, "jobs", "schedules", "--shards-file", file2, "-w", "json")
	if err != nil {
		t.Fatalf("idem jobs schedules = %q, %v", out, err)
	}
	var views []struct {
		Name   string `json:"name"`
		Paused bool   `json:"paused"`
	}
	if err := json.Unmarshal([]byte(out), &views); err != nil || len(views) != 1 {
		t.Fatalf("idem jobs schedules = %q, %v", out, err)
	}
	if !views[0].Paused {
		t.Fatalf("idem jobs schedules --shards-file says %s is not paused (%s); its cursor, on b, is paused: it showed the stale copy left on a", name, strings.TrimSpace(out))
	}
}
