package main

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
)

// Issue 38, the console: parked jobs were buried in the id-sorted list,
// and a waiting job's await timeout was labelled "Not before". Parked jobs
// come first; a wait's timeout says so.
func TestConsoleShowsParkedJobsFirstAndAWaitsTimeout(t *testing.T) {
	idem, _, st, ctx := consoleIdem(t)
	q, err := jobs.New(st)
	if err != nil {
		t.Fatal(err)
	}
	w, err := jobs.NewWorker(q, []jobs.Kind{
		{Name: "fails", MaxAttempts: 1, Steps: []jobs.Step{{Name: "s", Run: func(context.Context, *jobs.Run) ([]byte, error) { return nil, errors.New("declined") }}}},
		{Name: "approval", Steps: []jobs.Step{jobs.AwaitStep("wait", "approved", time.Hour, jobs.Fail)}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for _, s := range [][3]string{{"a-queued", "nobody-runs-this"}, {"m-waiting", "approval"}, {"z-parked", "fails"}} {
		if _, err := q.Submit(ctx, s[0], s[1], []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []struct {
		id    string
		state jobs.State
	}{{"z-parked", jobs.Parked}, {"m-waiting", jobs.Waiting}} {
		for {
			j, err := q.Get(ctx, want.id)
			if err == nil && j.State == want.state {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("job %s never %s: %+v, %v", want.id, want.state, j, err)
			}
			time.Sleep(20 * time.Millisecond) // polling another process's view of the job
		}
	}
	rc := newReviewConsole(t, idem)
	_, list := rc.get("/console/jobs")
	p, qd := strings.Index(list, `data-job="z-parked"`), strings.Index(list, `data-job="a-queued"`)
	if p < 0 || qd < 0 || p > qd {
		t.Fatalf("jobs list: parked at %d, queued at %d; want the parked job first:\n%s", p, qd, list)
	}
	_, page := rc.get("/console/job?id=m-waiting")
	if !strings.Contains(page, "Wait times out") || strings.Contains(page, "Not before") {
		t.Fatalf("a waiting job's page does not label its timeout as one:\n%s", page)
	}
	// A waiting job can be signalled from its page (it could not).
	m := reviewCSRF.FindStringSubmatch(page)
	if m == nil || !strings.Contains(page, `action="/console/job/signal"`) {
		t.Fatalf("no signal form on a waiting job's page:\n%s", page)
	}
	form := url.Values{"csrf": {m[1]}, "tenant": {"jobs"}, "id": {"m-waiting"}, "event": {"approved"}, "payload": {"not json"}}
	if st, _, body := rc.post("/console/job/signal", form); st != 400 {
		t.Fatalf("a signal with a payload that is not JSON = %d %s; want 400", st, body)
	}
	form.Set("payload", `{"by":"ada"}`)
	if st, _, body := rc.post("/console/job/signal", form); st != 303 {
		t.Fatalf("signal from the console = %d %s; want a redirect", st, body)
	}
	for {
		j, err := q.Get(ctx, "m-waiting")
		if err == nil && j.State == jobs.Succeeded && string(j.Output("wait")) == `{"by":"ada"}` {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the signalled job = %+v, %v; want it to end with the payload", j, err)
		}
		time.Sleep(20 * time.Millisecond) // polling another process's view of the job
	}
}

// Issue 38: a schedule no scheduler runs any more showed upcoming
// occurrences that would never run. The console and `idem jobs
// schedules` say that nothing runs it.
func TestASchedulesNobodyRunsShowsNoUpcomingOccurrences(t *testing.T) {
	idem, ep, st, ctx := consoleIdem(t)
	// Two cursors as schedulers leave them: one moved a minute ago, one an
	// hour ago (its schedulers are gone).
	now := time.Now().UTC().Truncate(time.Minute)
	for name, last := range map[string]time.Time{"alive": now.Add(-time.Minute), "orphan": now.Add(-time.Hour)} {
		v := `{"last":"` + last.Format(time.RFC3339) + `","kind":"report","spec":"every 1m0s"}`
		if _, ok, err := storex.SetValue(st, ctx, "s/jobs/"+name, []byte(v), 0); err != nil || !ok {
			t.Fatalf("cursor %s: %v %v", name, ok, err)
		}
	}
	rc := newReviewConsole(t, idem)
	_, page := rc.get("/console/jobs")
	orphan := page[strings.Index(page, `data-schedule="orphan"`):]
	orphan = orphan[:strings.Index(orphan, "</tr>")]
	alive := page[strings.Index(page, `data-schedule="alive"`):]
	alive = alive[:strings.Index(alive, "</tr>")]
	if !strings.Contains(orphan, `data-field="unrun"`) || strings.Contains(alive, `data-field="unrun"`) {
		t.Fatalf("schedules: orphan %q, alive %q; want only the orphan marked as run by nobody", orphan, alive)
	}
	out, err := runCmd(t, "jobs", "schedules", "--endpoints", ep)
	if err != nil || !strings.Contains(out, "orphan kind=report") || !strings.Contains(out, "next=none:no-scheduler-runs-it") {
		t.Fatalf("idem jobs schedules = %q, %v; want the orphan's next occurrences as none", out, err)
	}
}
