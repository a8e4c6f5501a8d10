package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/jobs"
)

// An operator sees jobs by state, one job with its steps and attempts, and
// retries or cancels parked ones, with idem jobs; idem get and ls show that
// a record is a job.
func TestJobsCommands(t *testing.T) {
	c, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ep := c.Endpoints()[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, err := etcdstore.New(ctx, c.MustClient(t), etcdstore.WithSessionTTL(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	var broken atomic.Bool
	broken.Store(true)
	ok := func(ctx context.Context, r *jobs.Run) ([]byte, error) { return []byte(`{"ok":true}`), nil }
	kind := jobs.Kind{Name: "invoice", MaxAttempts: 2, Backoff: 10 * time.Millisecond, Steps: []jobs.Step{
		{Name: "compute", Run: ok},
		{Name: "charge", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			if broken.Load() {
				return nil, errors.New("card processor down")
			}
			return nil, nil
		}},
		{Name: "email", Run: ok},
	}}
	w, err := jobs.NewWorker(q, []jobs.Kind{kind}, jobs.Concurrency(2))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := q.Submit(ctx, "inv-1", "invoice", []byte(`{"customer":"acme"}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Submit(ctx, "later-1", "refund", nil); err != nil { // no worker runs refunds
		t.Fatal(err)
	}
	if j, err := q.Wait(ctx, "inv-1"); err != nil || j.State != jobs.Parked {
		t.Fatalf("inv-1 = %+v, %v; want parked", j, err)
	}
	sched, err := jobs.NewScheduler(q, []jobs.Schedule{{Name: "monthly-invoices", Cron: "0 3 1 * *", Kind: "invoice-run"}})
	if err != nil {
		t.Fatal(err)
	}
	defer sched.Close()
	// The scheduler makes the schedule's cursor at its first tick, in its
	// own goroutine: wait for it before listing schedules.
	for {
		infos, err := jobs.Schedules(ctx, &store.Admin, "")
		if err != nil {
			t.Fatal(err)
		}
		if len(infos) > 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the scheduler never made its cursor")
		case <-time.After(10 * time.Millisecond):
		}
	}

	// withEndpoints puts --endpoints after the command's words, before its
	// flags and arguments (flags stop at the first argument).
	withEndpoints := func(args []string) []string {
		n := 1
		if args[0] == "jobs" && len(args) > 1 {
			n = 2
		}
		return append(append(append([]string{}, args[:n]...), "--endpoints", ep), args[n:]...)
	}
	idem := func(args ...string) string {
		t.Helper()
		out, err := runCmd(t, withEndpoints(args)...)
		if err != nil {
			t.Fatalf("idem %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	out := idem("jobs", "ls")
	if !strings.Contains(out, "jobs/inv-1 kind=invoice state=parked attempts=2 steps=1/3") || !strings.Contains(out, "jobs/later-1 kind=refund state=queued") {
		t.Fatalf("jobs ls:\n%s", out)
	}
	if out := idem("jobs", "ls", "--state", "parked"); strings.Contains(out, "later-1") || !strings.Contains(out, "inv-1") {
		t.Fatalf("jobs ls --state parked:\n%s", out)
	}
	out = idem("jobs", "get", "inv-1")
	for _, want := range []string{`params {"customer":"acme"}`, "step compute: finished", "step charge: not finished", "step email: not finished",
		"attempt 1 (token", "attempt 2 (token", "in step charge: card processor down", `error="step charge: card processor down"`} {
		if !strings.Contains(out, want) {
			t.Fatalf("jobs get lacks %q:\n%s", want, out)
		}
	}
	var v jobView
	if err := json.Unmarshal([]byte(idem("jobs", "get", "-w", "json", "inv-1")), &v); err != nil || v.State != jobs.Parked || len(v.Errors) != 2 || !v.Steps[0].Finished {
		t.Fatalf("jobs get -w json = %+v, %v", v, err)
	}
	if out := idem("ls", "--tenant", "jobs"); !strings.Contains(out, "job=parked kind=invoice attempts=2") {
		t.Fatalf("idem ls --tenant jobs does not say it holds a parked job:\n%s", out)
	}
	if out := idem("jobs", "schedules"); !strings.Contains(out, `monthly-invoices kind=invoice-run spec="0 3 1 * *"`) {
		t.Fatalf("jobs schedules:\n%s", out)
	}

	broken.Store(false)
	if out := idem("jobs", "retry", "inv-1"); !strings.Contains(out, "jobs/inv-1") {
		t.Fatalf("jobs retry:\n%s", out)
	}
	if j, err := q.Wait(ctx, "inv-1"); err != nil || j.State != jobs.Succeeded || j.Attempts != 1 {
		t.Fatalf("inv-1 after retry = %+v, %v; want succeeded", j, err)
	}
	if out := idem("jobs", "cancel", "--reason", "refunds are off", "later-1"); !strings.Contains(out, "state=cancelled") || !strings.Contains(out, "refunds are off") {
		t.Fatalf("jobs cancel:\n%s", out)
	}
	// Refusals say why, and change nothing.
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"jobs", "cancel", "inv-1"}, 1, "job has ended"},
		{[]string{"jobs", "retry", "later-1"}, 1, "job has ended"},
		{[]string{"jobs", "get", "no-such-job"}, 1, "not found"},
		{[]string{"jobs", "ls", "--state", "done"}, 2, "--state"},
		{[]string{"jobs", "get"}, 2, "takes 1 argument"},
		{[]string{"jobs", "frobnicate"}, 2, "unknown jobs command"},
		{[]string{"jobs", "retry", "--retention", "500ms", "inv-1"}, 2, "retention"},
	} {
		out, err := runCmd(t, withEndpoints(tc.args)...)
		if exitCode(err) != tc.code || !strings.Contains(out+errString(err), tc.want) {
			t.Errorf("idem %s = %q, %v (exit %d); want exit %d saying %q", strings.Join(tc.args, " "), out, err, exitCode(err), tc.code, tc.want)
		}
	}
	if j, err := q.Get(ctx, "inv-1"); err != nil || j.State != jobs.Succeeded {
		t.Fatalf("inv-1 after refused commands = %+v, %v", j, err)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// docs/JOBS.md's first job: idem jobs submit (twice: one job), a Go
// worker runs it, idem jobs get shows it succeeded; the same ID with other
// params is refused, and bad input exits 2 and submits nothing.
func TestJobsSubmitFromTheCommandLine(t *testing.T) {
	c, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ep := c.Endpoints()[0]
	for range 2 {
		out, err := runCmd(t, "jobs", "submit", "--endpoints", ep, "--params", `"Ada"`, "welcome-ada", "welcome")
		if err != nil || !strings.Contains(out, "welcome-ada") || !strings.Contains(out, "queued") {
			t.Fatalf("jobs submit: %v\n%s", err, out)
		}
	}
	if out, err := runCmd(t, "jobs", "submit", "--endpoints", ep, "--params", `"Bob"`, "welcome-ada", "welcome"); err == nil || exitCode(err) == 0 || !errors.Is(err, etcdstore.ErrMismatch) {
		t.Fatalf("jobs submit with other params: %v\n%s; want a mismatch", err, out)
	}
	for _, bad := range [][]string{
		{"welcome-bob"}, // no kind
		{"--run-at", "tomorrow", "welcome-bob", "welcome"}, // not a time
		{"--params", "x", "--params-file", "f", "welcome-bob", "welcome"},
		{"welcome/bob", "welcome"}, // not a key
	} {
		if out, err := runCmd(t, append([]string{"jobs", "submit", "--endpoints", ep}, bad...)...); exitCode(err) != 2 {
			t.Fatalf("jobs submit %q: %v\n%s; want exit 2", bad, err, out)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, err := etcdstore.New(ctx, c.MustClient(t))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Get(ctx, "welcome-bob"); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("welcome-bob after refused submits: %v; want none", err)
	}
	var runs atomic.Int32
	w, err := jobs.NewWorker(q, []jobs.Kind{{Name: "welcome", Steps: []jobs.Step{
		{Name: "greet", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			runs.Add(1)
			return append([]byte(`"hello, `), r.Params()[1:]...), nil
		}},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if j, err := q.Wait(ctx, "welcome-ada"); err != nil || j.State != jobs.Succeeded {
		t.Fatalf("welcome-ada: %+v %v", j, err)
	}
	out, err := runCmd(t, "jobs", "get", "--endpoints", ep, "-w", "json", "welcome-ada")
	if err != nil {
		t.Fatalf("jobs get: %v\n%s", err, out)
	}
	var got struct {
		State string
		Steps []struct {
			Name     string
			Finished bool
			Output   string
		}
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || got.State != "succeeded" ||
		len(got.Steps) != 1 || !got.Steps[0].Finished || got.Steps[0].Output != `"hello, Ada"` {
		t.Fatalf("jobs get: %s (%v)", out, err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the job ran %d times, want 1", n)
	}
}

// The README's library, pointed at idem serve's embedded etcd by its
// socket: one store, and idem get sees the library's key.
func TestLibraryReachesServesEmbeddedEtcd(t *testing.T) {
	dir := tempDir(t)
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	startIdem(t, dir, flags...)
	ep := etcdEndpoint(flags) // unix://<dir>/idem-data/etcd.sock
	if !strings.HasSuffix(ep, "/idem-data/etcd.sock") {
		t.Fatalf("the embedded etcd's endpoint is %s", ep)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	store, err := etcdstore.New(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	key := etcdstore.Key{Tenant: "acme", ID: "8e03978e-40d5-43e8-bc93-6894a57f9324"}
	res, err := store.Do(ctx, key, []byte(`{"amount":100}`), func(ctx context.Context, c *etcdstore.Claim) ([]byte, error) {
		return []byte(`{"charge":"ch_1"}`), nil
	})
	if err != nil || res.Replayed {
		t.Fatalf("Do: %+v %v", res, err)
	}
	out, err := runCmd(t, "get", "--endpoints", ep, "--tenant", "acme", key.ID)
	if err != nil || !strings.Contains(out, "done") || !strings.Contains(out, "ch_1") {
		t.Fatalf("idem get of the library's key: %v\n%s", err, out)
	}
}

// idem jobs submit --if-exists refuse refuses another submission's job
// (exit 1, the job printed); bad flags exit 2 before etcd is reached; idem
// jobs signal delivers an event once, refuses another payload, and names
// what is wrong with bad input.
func TestJobsSubmitRefuseAndSignal(t *testing.T) {
	c, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ep := c.Endpoints()[0]
	if out, err := runCmd(t, "jobs", "submit", "--endpoints", ep, "--if-exists", "refuse", "approve-7", "approve"); err != nil {
		t.Fatalf("first submit: %v\n%s", err, out)
	}
	out, err := runCmd(t, "jobs", "submit", "--endpoints", ep, "--if-exists", "refuse", "approve-7", "approve")
	if exitCode(err) != 1 || !errors.Is(err, jobs.ErrDuplicate) || !strings.Contains(out, "approve-7") {
		t.Fatalf("second submit with --if-exists refuse: %v (exit %d)\n%s; want exit 1, ErrDuplicate, the job printed", err, exitCode(err), out)
	}
	for _, bad := range [][]string{
		{"--if-exists", "replace", "x", "approve"},
		{"--dedup-window", "-1s", "x", "approve"},
	} {
		// A closed port: a configuration error must exit 2 before etcd is asked.
		if out, err := runCmd(t, append([]string{"jobs", "submit", "--endpoints", "127.0.0.1:1", "--timeout", "1s"}, bad...)...); exitCode(err) != 2 {
			t.Fatalf("jobs submit %q: %v\n%s; want exit 2", bad, err, out)
		}
	}
	for range 2 { // a retried signal
		if out, err := runCmd(t, "jobs", "signal", "--endpoints", ep, "--payload", `{"ok":true}`, "approve-7", "approved"); err != nil || !strings.Contains(out, "signalled approved") {
			t.Fatalf("jobs signal: %v\n%s", err, out)
		}
	}
	if out, err := runCmd(t, "jobs", "signal", "--endpoints", ep, "--payload", `{"ok":false}`, "approve-7", "approved"); exitCode(err) != 1 || !errors.Is(err, jobs.ErrSignalMismatch) {
		t.Fatalf("jobs signal with another payload: %v\n%s; want exit 1 and ErrSignalMismatch", err, out)
	}
	for _, bad := range [][]string{
		{"approve-7", "bad/name"},
		{"approve-7"},
		{"--payload", "x", "--payload-file", "f", "approve-7", "approved"},
	} {
		if out, err := runCmd(t, append([]string{"jobs", "signal", "--endpoints", ep}, bad...)...); exitCode(err) != 2 {
			t.Fatalf("jobs signal %q: %v\n%s; want exit 2", bad, err, out)
		}
	}
	if out, err := runCmd(t, "jobs", "signal", "--endpoints", ep, "nobody", "approved"); exitCode(err) != 1 || !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("jobs signal to no job: %v\n%s; want exit 1, not found", err, out)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, err := etcdstore.New(ctx, c.MustClient(t))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	w, err := jobs.NewWorker(q, []jobs.Kind{{Name: "approve", Steps: []jobs.Step{jobs.AwaitStep("wait", "approved", time.Minute, jobs.Fail)}}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if j, err := q.Wait(ctx, "approve-7"); err != nil || j.State != jobs.Succeeded || string(j.Output("wait")) != `{"ok":true}` {
		t.Fatalf("approve-7: %+v %v; want succeeded with the first payload", j, err)
	}
}

// idem jobs schedules shows each schedule's policies and next occurrences;
// pause and resume reach every scheduler through the cursor; backfill
// submits a past range once; bad input exits 2.
func TestJobsSchedulesPauseBackfill(t *testing.T) {
	c, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ep := c.Endpoints()[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, err := etcdstore.New(ctx, c.MustClient(t))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	s, err := jobs.NewScheduler(q, []jobs.Schedule{{Name: "hourly-sync", Kind: "sync", Every: time.Hour, Overlap: jobs.OverlapSkip}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// The scheduler writes its cursor on its first tick: wait for it on a Watch.
	cli := c.MustClient(t)
	cursor := store.Prefix() + "j/s/jobs/hourly-sync"
	if resp, err := cli.Get(ctx, cursor); err != nil {
		t.Fatal(err)
	} else if len(resp.Kvs) == 0 {
		for wr := range cli.Watch(ctx, cursor, clientv3.WithRev(resp.Header.Revision+1)) {
			if len(wr.Events) > 0 {
				break
			}
		}
	}
	out, err := runCmd(t, "jobs", "schedules", "--endpoints", ep, "-w", "json")
	var got []struct {
		Name, Overlap string
		Paused        bool
		Next          []time.Time
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || len(got) != 1 || got[0].Overlap != "skip" || len(got[0].Next) != 3 ||
		got[0].Next[1].Sub(got[0].Next[0]) != time.Hour {
		t.Fatalf("jobs schedules: %v\n%s", err, out)
	}
	if out, err := runCmd(t, "jobs", "pause", "--endpoints", ep, "hourly-sync"); err != nil || !strings.Contains(out, "paused hourly-sync") {
		t.Fatalf("jobs pause: %v\n%s", err, out)
	}
	if infos, err := jobs.Schedules(ctx, &store.Admin, ""); err != nil || !infos[0].Paused {
		t.Fatalf("after pause: %+v, %v", infos, err)
	}
	if out, err := runCmd(t, "jobs", "resume", "--endpoints", ep, "hourly-sync"); err != nil || !strings.Contains(out, "resumed hourly-sync") {
		t.Fatalf("jobs resume: %v\n%s", err, out)
	}
	if out, err := runCmd(t, "jobs", "pause", "--endpoints", ep, "nightly"); exitCode(err) != 1 || !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("jobs pause of a schedule no scheduler ran: %v\n%s", err, out)
	}
	hour := time.Now().UTC().Truncate(time.Hour)
	from, to := hour.Add(-3*time.Hour).Format(time.RFC3339), hour.Add(-time.Hour).Format(time.RFC3339)
	for want := 3; want >= 0; want -= 3 { // again: nothing new
		out, err := runCmd(t, "jobs", "backfill", "--endpoints", ep, "--from", from, "--to", to, "hourly-sync")
		if err != nil || !strings.Contains(out, fmt.Sprintf("%d occurrences submitted", want)) {
			t.Fatalf("jobs backfill: %v\n%s; want %d submitted", err, out, want)
		}
	}
	if _, err := q.Get(ctx, jobs.OccurrenceID("hourly-sync", hour.Add(-2*time.Hour))); err != nil {
		t.Fatalf("a backfilled occurrence: %v", err)
	}
	for _, bad := range [][]string{
		{"backfill", "--from", "yesterday", "--to", to, "hourly-sync"},
		{"backfill", "--from", from, "--to", hour.Add(2 * time.Hour).Format(time.RFC3339), "hourly-sync"}, // the future
		{"schedules", "--next", "-1"},
		{"pause"},
	} {
		if out, err := runCmd(t, append([]string{"jobs", bad[0], "--endpoints", ep}, bad[1:]...)...); exitCode(err) != 2 {
			t.Fatalf("jobs %q: %v\n%s; want exit 2", bad, err, out)
		}
	}
}

// idem jobs limits shows which job holds which key's slot while it runs,
// and nothing once it ended; a bad limit name exits 2; idem jobs get says
// what holds a job back.
func TestJobsLimits(t *testing.T) {
	c, err := etcdtest.New(t.TempDir(), 1, etcdtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	ep := c.Endpoints()[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, err := etcdstore.New(ctx, c.MustClient(t))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q, err := jobs.New(store)
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan string, 1), make(chan struct{})
	closeRelease := sync.OnceFunc(func() { close(release) })
	defer closeRelease() // a failure must not leave a step blocked (Close would wait for it)
	k := jobs.Kind{Name: "payout", Limits: []jobs.Limit{{Name: "merchant", Key: jobs.ParamKey("merchant"), Concurrency: 1}},
		Steps: []jobs.Step{{Name: "pay", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			entered <- r.Key().ID
			<-release
			return nil, nil
		}}}}
	w, err := jobs.NewWorker(q, []jobs.Kind{k})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for _, id := range []string{"p-1", "p-2"} {
		if _, err := q.Submit(ctx, id, "payout", []byte(`{"merchant":"acme"}`)); err != nil {
			t.Fatal(err)
		}
	}
	first := <-entered
	second := map[string]string{"p-1": "p-2", "p-2": "p-1"}[first]
	out, err := runCmd(t, "jobs", "limits", "--endpoints", ep, "-w", "json")
	var got []struct {
		Limit, Key, Job string
		Slot            int
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || len(got) != 1 || got[0].Limit != "merchant" || got[0].Key != "acme" || got[0].Job != first {
		t.Fatalf("jobs limits while %s runs: %v\n%s", first, err, out)
	}
	// The other job, tried by a worker without a completer, is held back.
	other, err := jobs.NewWorker(q, []jobs.Kind{k}, jobs.Concurrency(0))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.Run(ctx, second); err != nil {
		t.Fatalf("%s run while the slot is held: %v", second, err)
	}
	// (The first worker's completer may be trying it at the same time:
	// either attempt gives it back, limited.)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) { // polls a state
		j, err := q.Get(ctx, second)
		if err == nil && j.Limited == "merchant=acme" && j.State == jobs.Scheduled {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never shown held back by merchant=acme: %+v %v", second, j, err)
		}
	}
	if out, err := runCmd(t, "jobs", "get", "--endpoints", ep, second); err != nil || !strings.Contains(out, `limited="merchant=acme"`) {
		t.Fatalf("jobs get %s: %v\n%s", second, err, out)
	}
	if out, err := runCmd(t, "jobs", "limits", "--endpoints", ep, "--limit", "bad*name"); exitCode(err) != 2 {
		t.Fatalf("jobs limits --limit bad*name: exit %d, want 2\n%s", exitCode(err), out)
	}
	closeRelease()
	for _, id := range []string{"p-1", "p-2"} {
		if j, err := q.Wait(ctx, id); err != nil || j.State != jobs.Succeeded {
			t.Fatalf("%s: %+v %v", id, j, err)
		}
	}
	if out, err := runCmd(t, "jobs", "limits", "--endpoints", ep); err != nil || strings.TrimSpace(out) != "" {
		t.Fatalf("jobs limits once both ended: %v\n%q", err, out)
	}
}
