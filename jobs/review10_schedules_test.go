package jobs

import (
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/storex"
)

// Promise (docs/JOBS.md "Workers in any language": "a schedule's name is
// its tenant's (two kinds may not declare one name)"; jobs/declare.go,
// Queue.Declare: "A schedule's name is the tenant's: another kind's may
// not have it"). Declare reads the other kinds, then writes its own value
// fenced only by its own revision: two kinds declared at once with one
// schedule name both succeed, and from then on DeclaredSchedulers refuses
// the tenant's whole set ("schedule s is declared by kinds ..."), so none
// of the tenant's schedules runs.
func TestReview10TwoKindsDeclaredAtOnceCannotShareAScheduleName(t *testing.T) {
	s := newStore(t, testPrefix(t))
	ctx := testCtx(t)
	for trial := range 40 {
		q := newQueue(t, s, WithTenant(fmt.Sprintf("t%d", trial)))
		start := make(chan struct{})
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, k := range []string{"ka", "kb"} {
			wg.Go(func() {
				<-start
				errs[i] = q.Declare(ctx, Declaration{Name: k, Steps: []StepDeclaration{{Name: "a"}},
					Schedules: []ScheduleDeclaration{{Name: "nightly", Every: "1h"}}})
			})
		}
		close(start)
		wg.Wait()
		ds, err := q.Declared(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := DeclaredSchedules(ds, q.retention()); err != nil {
			t.Fatalf("trial %d: both declarations accepted (%v, %v); the tenant's declared schedules cannot run: %v", trial, errs[0], errs[1], err)
		}
	}
}

// Promise (docs/JOBS.md "Workers in any language": a kind's schedules are
// run by every idem serve, "a changed declaration is taken up within
// moments"; jobs/declared_schedules.go, DeclaredSchedulers: "started again
// whenever the tenant's declared schedules change"). A tenant whose
// declarations hold one schedule name twice (Declare refuses that now;
// written here directly, as by an older idem) still runs its other
// schedules, and the first kind's of that name; a schedule whose kind is
// undeclared stops. (Rewritten after the fix: the whole set was refused
// and the old scheduler kept, running an undeclared kind's schedule.)
func TestReview10AnUndeclaredKindsScheduleStops(t *testing.T) {
	s := newStore(t, testPrefix(t))
	ctx := testCtx(t)
	d := RunDeclaredSchedules(s, func(tenant string) (*Queue, error) { return New(s, WithTenant(tenant)) }, nil)
	t.Cleanup(func() { d.Close() })
	q := newQueue(t, s, WithTenant("u"))
	decl := func(kind, schedule string) Declaration {
		return Declaration{Name: kind, Steps: []StepDeclaration{{Name: "a"}}, Schedules: []ScheduleDeclaration{{Name: schedule, Every: "1h"}}}
	}
	write := func(ds ...Declaration) {
		m := map[string]Declaration{}
		for _, d := range ds {
			m[d.Name] = d
		}
		b, _ := json.Marshal(m)
		v, err := storex.GetValue(s, ctx, declName("u"))
		if err != nil {
			t.Fatal(err)
		}
		if _, ok, err := storex.SetValue(s, ctx, declName("u"), b, v.Revision); err != nil || !ok {
			t.Fatalf("writing the declarations: %v %v", ok, err)
		}
	}
	runs := func(want ...string) {
		t.Helper()
		for !slices.Equal(d.Running("u"), want) {
			if ctx.Err() != nil {
				t.Fatalf("running %v, want %v", d.Running("u"), want)
			}
			time.Sleep(10 * time.Millisecond) // polling DeclaredSchedulers' state
		}
	}
	write(decl("gone", "own"), decl("ka", "nightly"), decl("kb", "nightly"))
	runs("own", "nightly")
	if ds, err := q.Declared(ctx); err != nil || len(ds) != 3 {
		t.Fatalf("declared: %v %v", ds, err)
	}
	if ok, err := q.Undeclare(ctx, "gone"); err != nil || !ok {
		t.Fatalf("Undeclare: %v, %v", ok, err)
	}
	runs("nightly")
}
