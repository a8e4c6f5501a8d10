package jobs

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

// A kind's declared schedule is run by DeclaredSchedulers (as idem serve
// runs it): its occurrences are submitted with the declared params; a new
// declaration without it stops it. Bad schedules are refused when they are
// declared, naming what is wrong, and change nothing.
func TestDeclaredSchedulesRunAndFollowTheirDeclarations(t *testing.T) {
	s := newStore(t, testPrefix(t))
	q := newQueue(t, s)
	ctx := testCtx(t)
	tick := Declaration{Name: "tick", Steps: []StepDeclaration{{Name: "a"}},
		Schedules: []ScheduleDeclaration{{Name: "every-second", Every: "1s", Params: []byte(`{"x":1}`)}}}
	if err := q.Declare(ctx, tick); err != nil {
		t.Fatal(err)
	}
	d := RunDeclaredSchedules(s, func(tenant string) (*Queue, error) { return New(s, WithTenant(tenant)) }, nil)
	t.Cleanup(func() { d.Close() })
	for {
		js, err := q.List(ctx, ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if i := slices.IndexFunc(js, func(j *Job) bool { return j.Kind == "tick" }); i >= 0 {
			if string(js[i].Params) != `{"x":1}` || !strings.HasPrefix(js[i].Key.ID, "every-second") {
				t.Fatalf("an occurrence's job: %s with params %s", js[i].Key.ID, js[i].Params)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatal("no occurrence was submitted")
		}
		time.Sleep(20 * time.Millisecond) // (polling etcd for the job: the scheduler's own clock decides when)
	}
	if got := d.Running(DefaultTenant); !slices.Equal(got, []string{"every-second"}) {
		t.Fatalf("running %v", got)
	}
	tick.Schedules = nil
	if err := q.Declare(ctx, tick); err != nil {
		t.Fatal(err)
	}
	for len(d.Running(DefaultTenant)) > 0 {
		if ctx.Err() != nil {
			t.Fatal("a schedule no declaration has still runs")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, c := range []struct {
		sd   ScheduleDeclaration
		want string
	}{
		{ScheduleDeclaration{Name: "s", Cron: "bogus"}, "cron"},
		{ScheduleDeclaration{Name: "s", Every: "1s", Overlap: "later"}, `overlap policy "later"`},
		{ScheduleDeclaration{Name: "s", Every: "1s", CatchUp: "some"}, `catch_up "some"`},
		{ScheduleDeclaration{Name: "s", Every: "1s", Location: "Mars/Olympus"}, "Mars/Olympus"},
		{ScheduleDeclaration{Name: "s", Every: "1s", Params: []byte(`{`)}, "params are not JSON"},
		{ScheduleDeclaration{Name: "s"}, "s"},
	} {
		bad := Declaration{Name: "other", Steps: []StepDeclaration{{Name: "a"}}, Schedules: []ScheduleDeclaration{c.sd}}
		if err := q.Declare(ctx, bad); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("declaring %+v: %v, want ErrInvalid naming %q", c.sd, err, c.want)
		}
	}
	twice := Declaration{Name: "tock", Steps: []StepDeclaration{{Name: "a"}}, Schedules: []ScheduleDeclaration{{Name: "nightly", Cron: "0 3 * * *"}}}
	if err := q.Declare(ctx, twice); err != nil {
		t.Fatal(err)
	}
	twice.Name = "tack"
	if err := q.Declare(ctx, twice); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "schedule nightly is kind tock's already") {
		t.Fatalf("a second kind's schedule of the same name: %v", err)
	}
	if ds, err := q.Declared(ctx); err != nil || len(ds) != 2 {
		t.Fatalf("after refusals: %d declarations, %v", len(ds), err)
	}
}
