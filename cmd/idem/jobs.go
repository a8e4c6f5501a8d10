package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

const jobsUsage = `usage: idem jobs COMMAND [flags]

Jobs (package jobs) are records of a tenant ("jobs" by default) that
workers run step by step; these commands show and administer them.

Commands:
  submit     submit a job:              idem jobs submit [--params JSON] [--run-at T] [--if-exists return|refuse] [--dedup-window D] ID KIND
  signal     deliver an event to a job: idem jobs signal [--payload JSON] ID EVENT
  ls         list jobs:                 idem jobs ls [--state running|queued|scheduled|waiting|parked|succeeded|failed|cancelled]
  get        one job, steps, attempts:  idem jobs get ID
  retry      queue a parked job again:  idem jobs retry [--retention D] ID
  cancel     end a job no worker runs:  idem jobs cancel [--reason R] [--retention D] ID
  schedules  the schedules, next times: idem jobs schedules [--next N]
  pause      pause a schedule:          idem jobs pause SCHEDULE
  resume     resume a paused schedule:  idem jobs resume SCHEDULE
  backfill   run a past range again:    idem jobs backfill --from T --to T SCHEDULE
  limits     the limits' held slots:    idem jobs limits [--limit NAME]
  kinds      declared kinds:            idem jobs kinds apply FILE | ls | get KIND | delete KIND

Run "idem jobs COMMAND -h" for a command's flags.
`

// jobsCmd runs "idem jobs ...".
func jobsCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, jobsUsage)
		return errUsage
	}
	switch args[0] {
	case "submit":
		return jobsSubmit(ctx, args[1:], stdout, stderr)
	case "signal":
		return jobsSignal(ctx, args[1:], stdout, stderr)
	case "ls":
		return jobsList(ctx, args[1:], stdout, stderr)
	case "get":
		return jobsGet(ctx, args[1:], stdout, stderr)
	case "retry", "cancel":
		return jobsOperate(ctx, args[0], args[1:], stdout, stderr)
	case "schedules":
		return jobsSchedules(ctx, args[1:], stdout, stderr)
	case "pause", "resume":
		return jobsPause(ctx, args[0], args[1:], stdout, stderr)
	case "backfill":
		return jobsBackfill(ctx, args[1:], stdout, stderr)
	case "limits":
		return jobsLimits(ctx, args[1:], stdout, stderr)
	case "kinds":
		return jobsKinds(ctx, args[1:], stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, jobsUsage)
		return nil
	}
	fmt.Fprint(stderr, jobsUsage)
	return usageError{fmt.Errorf("unknown jobs command %q", args[0])}
}

// newJobsCmd is newAdminCmd for a jobs command: the jobs tenant by
// default.
func newJobsCmd(name, synopsis string, stderr io.Writer) *adminCmd {
	a := newAdminCmd("jobs "+name, "jobs "+synopsis, stderr)
	a.tenant = jobs.DefaultTenant
	a.fs.Lookup("tenant").DefValue = jobs.DefaultTenant
	a.fs.Lookup("tenant").Usage = "tenant of the jobs"
	return a
}

// jobsTarget is where a jobs command finds the jobs: one etcd cluster, or
// a shard set (--shards-file), each job on its key's shard.
type jobsTarget struct {
	keys     keyAdmin  // reads of records: the cluster's Admin, or the set's
	clusters []cluster // every cluster: one without --shards-file
}

// queue opens a store with the workers' retention (on a shard set, a
// store per shard, as a process of the set), and the queue of the
// command's tenant: for the commands that write jobs.
func (a *adminCmd) queue(ctx context.Context, t jobsTarget, retention time.Duration, opts ...jobs.Option) (*jobs.Queue, func(), error) {
	sopts := []etcdstore.Option{etcdstore.WithPrefix(a.etcd.prefix), etcdstore.WithRetention(retention)}
	if _, err := storex.SettingsOf(sopts...); err != nil {
		return nil, nil, usageError{err}
	}
	opts = append([]jobs.Option{jobs.WithTenant(a.tenant)}, opts...)
	if a.setCfg != nil {
		set, err := shard.New(ctx, *a.setCfg, sopts...)
		if err != nil {
			return nil, nil, usageError{err}
		}
		q, err := jobs.NewOnShards(set, opts...)
		if err != nil {
			set.Close()
			return nil, nil, usageError{err}
		}
		return q, func() { set.Close() }, nil
	}
	store, err := etcdstore.New(ctx, t.clusters[0].cli, sopts...)
	if err != nil {
		if errors.Is(err, etcdstore.ErrInvalidArgument) {
			return nil, nil, usageError{err}
		}
		return nil, nil, err
	}
	q, err := jobs.New(store, opts...)
	if err != nil {
		store.Close()
		return nil, nil, usageError{err}
	}
	return q, func() { store.Close() }, nil
}

// openJobs connects as the admin commands do: to one cluster, or to every
// shard of --shards-file.
func (a *adminCmd) openJobs(ctx context.Context, args []string, nargs int) (jobsTarget, context.Context, func(), error) {
	keys, cs, cctx, done, err := a.open(ctx, args, nargs)
	if err != nil {
		return jobsTarget{}, nil, nil, err
	}
	return jobsTarget{keys: keys, clusters: cs}, cctx, done, nil
}

// schedules reads the schedules' cursors of every cluster of t for the
// command's tenant (readSchedules).
func (a *adminCmd) schedules(ctx context.Context, t jobsTarget) ([]jobs.ScheduleInfo, error) {
	return readSchedules(ctx, t, a.tenant)
}

// readSchedules reads the schedules' cursors of tenant in every cluster of
// t: on a shard set, each on the shard its name is placed on (while the set
// changes, a cursor carried over is on two: the one further on is shown).
// idem jobs schedules and the console's Jobs page show what it returns.
func readSchedules(ctx context.Context, t jobsTarget, tenant string) ([]jobs.ScheduleInfo, error) {
	var out []jobs.ScheduleInfo
	at := map[string]int{}
	for _, c := range t.clusters {
		infos, err := jobs.Schedules(ctx, c.adm, tenant)
		if err != nil {
			if c.name != "" {
				return nil, fmt.Errorf("shard %s: %w", c.name, err)
			}
			return nil, err
		}
		for _, si := range infos {
			if i, ok := at[si.Name]; ok {
				if si.Last.After(out[i].Last) {
					out[i] = si
				}
				continue
			}
			at[si.Name] = len(out)
			out = append(out, si)
		}
	}
	slices.SortFunc(out, func(x, y jobs.ScheduleInfo) int { return strings.Compare(x.Name, y.Name) })
	return out, nil
}

// jobsSubmit submits a job from the command line (or a script in any
// language): idempotent by ID, as Queue.Submit is.
func jobsSubmit(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("submit", "submit [--tenant T] [--params JSON | --params-file F] [--run-at RFC3339] [--if-exists return|refuse] [--submission-id S] [--dedup-window D] [--retention D] ID KIND", stderr)
	defer func() { err = a.explain(err) }()
	params := a.fs.String("params", "", "the job's params, JSON; the same on every retry of the submission (bytes that are not JSON: --params-file)")
	paramsFile := a.fs.String("params-file", "", "read the params from this file (- : standard input)")
	a.check = func() error { return inlineJSON("params", *params, *paramsFile) }
	runAt := a.fs.String("run-at", "", "run it no earlier than this time (RFC 3339), within half the store's retention")
	ifExists := a.fs.String("if-exists", "return", "when ID names a job another submission wrote: return it (exit 0), or refuse (exit 1, the job printed)")
	submission := a.fs.String("submission-id", "", "names this submission on every retry of it, so that --if-exists refuse recognises its own job after an unknown outcome")
	window := a.fs.Duration("dedup-window", 0, "ID names one job for this long after it was submitted (0: the store's retention); past it, an ended job is replaced")
	retention := a.fs.Duration("retention", etcdstore.DefaultRetention, "the retention of the workers' store (idem serve --retention, etcdstore.WithRetention)")
	zone := a.fs.String("zone", "", "the data centre (zone) the job is submitted in: a worker there runs it while there is one (jobs.WithZone)")
	if err := parseFlags(a.fs, args); err != nil {
		return err
	}
	var qopts []jobs.Option
	if *zone != "" {
		if err := jobs.ValidateName(*zone); err != nil {
			return usageError{fmt.Errorf("--zone: %w", err)}
		}
		qopts = append(qopts, jobs.WithZone(*zone))
	}
	if *ifExists != "return" && *ifExists != "refuse" {
		return usageError{fmt.Errorf("--if-exists %q: return or refuse", *ifExists)}
	}
	if *window < 0 {
		return usageError{fmt.Errorf("--dedup-window %v: negative", *window)}
	}
	c, ctx, done, err := a.openJobs(ctx, args, 2)
	if err != nil {
		return err
	}
	defer done()
	key, err := a.key()
	if err != nil {
		return err
	}
	kind := a.fs.Arg(1)
	p, err := bytesFlag("params", *params, *paramsFile)
	if err != nil {
		return err
	}
	opts := []jobs.SubmitOption{jobs.DedupWindow(*window)}
	if *ifExists == "refuse" {
		opts = append(opts, jobs.RefuseDuplicate())
	}
	if *submission != "" {
		opts = append(opts, jobs.SubmissionID(*submission))
	}
	if *runAt != "" {
		t, err := time.Parse(time.RFC3339, *runAt)
		if err != nil {
			return usageError{fmt.Errorf("--run-at %q: not an RFC 3339 time (2026-12-24T18:00:00Z)", *runAt)}
		}
		opts = append(opts, jobs.RunAt(t))
	}
	q, closeQueue, err := a.queue(ctx, c, *retention, qopts...)
	if err != nil {
		return err
	}
	defer closeQueue()
	j, err := q.Submit(ctx, key.ID, kind, p, opts...)
	if errors.Is(err, jobs.ErrDuplicate) {
		printJobs(stdout, a.format, []*jobs.Job{j}, false)
		return err
	}
	if err != nil {
		if errors.Is(err, jobs.ErrInvalid) || errors.Is(err, etcdstore.ErrInvalidArgument) || errors.Is(err, etcdstore.ErrInvalidKey) ||
			errors.Is(err, etcdstore.ErrInvalidParams) || errors.Is(err, etcdstore.ErrTooLarge) {
			return usageError{err} // bad input: nothing was submitted
		}
		return err
	}
	return printJobs(stdout, a.format, []*jobs.Job{j}, false)
}

// bytesFlag is the bytes of a --NAME / --NAME-file pair of flags: inline,
// or read from a file ("-": standard input); giving both is a usage error.
// inlineJSON checks a bytes flag before etcd is reached: one of --NAME and
// --NAME-file, and --NAME JSON.
func inlineJSON(name, inline, file string) error {
	switch {
	case inline != "" && file != "":
		return fmt.Errorf("--%s and --%s-file: give one", name, name)
	case inline != "" && !json.Valid([]byte(inline)):
		// Typed on a command line, JSON that lost its quotes to the shell
		// ({amount:5}) is a mistake, not bytes to submit: any bytes go
		// through the file flag.
		return fmt.Errorf("--%s %q is not JSON (quote it for the shell: --%s '{\"amount\":5}'); for bytes that are not JSON use --%s-file", name, inline, name, name)
	}
	return nil
}

func bytesFlag(name, inline, file string) ([]byte, error) {
	switch {
	case inline != "" && file != "":
		return nil, usageError{fmt.Errorf("--%s and --%s-file: give one", name, name)}
	case file == "-":
		b, err := io.ReadAll(os.Stdin)
		if err != nil {
			return nil, usageError{fmt.Errorf("--%s-file -: %w", name, err)}
		}
		return b, nil
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, usageError{fmt.Errorf("--%s-file: %w", name, err)}
		}
		return b, nil
	}
	if err := inlineJSON(name, inline, file); err != nil {
		return nil, usageError{err}
	}
	return []byte(inline), nil
}

// jobsSignal delivers an event to a job (Queue.Signal): once, however
// often it is sent.
func jobsSignal(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("signal", "signal [--tenant T] [--payload JSON | --payload-file F] [--retention D] ID EVENT", stderr)
	defer func() { err = a.explain(err) }()
	payload := a.fs.String("payload", "", "the event's payload, JSON: what the job's Run.Await returns; the same on every retry (bytes that are not JSON: --payload-file)")
	payloadFile := a.fs.String("payload-file", "", "read the payload from this file (- : standard input)")
	a.check = func() error { return inlineJSON("payload", *payload, *payloadFile) }
	retention := a.fs.Duration("retention", etcdstore.DefaultRetention, "the retention of the workers' store: how long the event is kept")
	if err := parseFlags(a.fs, args); err != nil {
		return err
	}
	if a.fs.NArg() == 2 {
		if err := jobs.ValidateName(a.fs.Arg(1)); err != nil {
			return usageError{fmt.Errorf("event: %w", err)} // before anything talks to etcd
		}
	}
	c, ctx, done, err := a.openJobs(ctx, args, 2)
	if err != nil {
		return err
	}
	defer done()
	key, err := a.key()
	if err != nil {
		return err
	}
	p, err := bytesFlag("payload", *payload, *payloadFile)
	if err != nil {
		return err
	}
	q, closeQueue, err := a.queue(ctx, c, *retention)
	if err != nil {
		return err
	}
	defer closeQueue()
	if err := q.Signal(ctx, key.ID, a.fs.Arg(1), p); err != nil {
		if errors.Is(err, jobs.ErrInvalid) || errors.Is(err, etcdstore.ErrInvalidKey) {
			return usageError{err} // bad input: nothing was sent
		}
		return err
	}
	fmt.Fprintf(stdout, "signalled %s to %s\n", a.fs.Arg(1), key)
	return nil
}

func jobsList(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("ls", "ls [--tenant T] [--state S] [--limit N] [-w simple|json|table]", stderr)
	defer func() { err = a.explain(err) }()
	state := a.fs.String("state", "", "only jobs in this state: running, queued, scheduled, waiting, parked, succeeded, failed or cancelled")
	limit := a.fs.Int("limit", 0, "at most this many jobs (0: all)")
	a.check = func() error {
		switch s := jobs.State(*state); {
		case *limit < 0:
			return fmt.Errorf("--limit %d: must be 0 (all) or more", *limit)
		case s == "", s == jobs.Running, s == jobs.Queued, s == jobs.Scheduled, s == jobs.Waiting, s == jobs.Parked, s == jobs.Succeeded, s == jobs.Failed, s == jobs.Cancelled:
			return nil
		}
		return fmt.Errorf("--state %q: must be running, queued, scheduled, waiting, parked, succeeded, failed or cancelled", *state)
	}
	c, ctx, done, err := a.openJobs(ctx, args, 0)
	if err != nil {
		return err
	}
	defer done()
	out, err := listJobs(ctx, c.keys, a.tenant, jobs.State(*state), *limit)
	if err != nil {
		return err
	}
	return printJobs(stdout, a.format, out, false)
}

// listJobs lists tenant's jobs in state (all with ""), at most limit of
// them (0: all): idem jobs ls and the console's Jobs page.
func listJobs(ctx context.Context, keys keyAdmin, tenant string, state jobs.State, limit int) ([]*jobs.Job, error) {
	js, _, err := listJobsScan(ctx, keys, tenant, state, limit, 0)
	return js, err
}

// listJobsScan is listJobs reading at most maxScan records (0: all); it
// returns how many it read.
func listJobsScan(ctx context.Context, keys keyAdmin, tenant string, state jobs.State, limit, maxScan int) ([]*jobs.Job, int, error) {
	var out []*jobs.Job
	var after *etcdstore.Key
	scanned := 0
	for {
		page := etcdstore.MaxListLimit
		if maxScan > 0 {
			page = min(page, maxScan-scanned)
		}
		recs, err := keys.List(ctx, tenant, etcdstore.ListOptions{After: after, Limit: page})
		if err != nil && len(recs) == 0 {
			return nil, scanned, err
		}
		scanned += len(recs)
		for _, r := range recs {
			j, err := jobs.FromRecord(r, time.Now())
			if err != nil || (state != "" && j.State != state) {
				continue
			}
			out = append(out, j)
		}
		if len(recs) < page || limit > 0 && len(out) >= limit || maxScan > 0 && scanned >= maxScan {
			break
		}
		after = &recs[len(recs)-1].Key
	}
	if limit > 0 && len(out) > limit {
		out = out[:limit]
	}
	return out, scanned, nil
}

func jobsGet(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("get", "get [--tenant T] [-w simple|json|table] ID", stderr)
	defer func() { err = a.explain(err) }()
	c, ctx, done, err := a.openJobs(ctx, args, 1)
	if err != nil {
		return err
	}
	defer done()
	key, err := a.key()
	if err != nil {
		return err
	}
	rec, err := c.keys.Get(ctx, key)
	if err != nil {
		return err
	}
	j, err := jobs.FromRecord(rec, time.Now())
	if err != nil {
		return err
	}
	return printJobs(stdout, a.format, []*jobs.Job{j}, true)
}

// jobsOperate runs retry or cancel: each takes the job over with a claim,
// so it runs a store (with a session) for the command's length.
func jobsOperate(ctx context.Context, op string, args []string, stdout, stderr io.Writer) (err error) {
	synopsis := "retry [--tenant T] [--retention D] ID"
	if op == "cancel" {
		synopsis = "cancel [--tenant T] [--reason R] [--retention D] ID"
	}
	a := newJobsCmd(op, synopsis, stderr)
	defer func() { err = a.explain(err) }()
	reason := new(string)
	if op == "cancel" {
		reason = a.fs.String("reason", "cancelled by an operator", "why, saved with the job")
	}
	retention := a.fs.Duration("retention", etcdstore.DefaultRetention, "the retention of the workers' store (idem serve --retention, etcdstore.WithRetention): the job is rewritten with it")
	c, ctx, done, err := a.openJobs(ctx, args, 1)
	if err != nil {
		return err
	}
	defer done()
	key, err := a.key()
	if err != nil {
		return err
	}
	q, closeQueue, err := a.queue(ctx, c, *retention)
	if err != nil {
		return err
	}
	defer closeQueue()
	var j *jobs.Job
	if op == "retry" {
		j, err = q.Retry(ctx, key.ID)
	} else {
		j, err = q.Cancel(ctx, key.ID, *reason)
	}
	if err != nil {
		return err
	}
	return printJobs(stdout, a.format, []*jobs.Job{j}, false)
}

func jobsSchedules(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("schedules", "schedules [--tenant T] [--next N] [-w simple|json|table]", stderr)
	defer func() { err = a.explain(err) }()
	next := a.fs.Int("next", 3, "how many of each schedule's next occurrences to show")
	if err := parseFlags(a.fs, args); err != nil {
		return err
	}
	if *next < 0 || *next > 100 {
		return usageError{fmt.Errorf("--next %d: 0 to 100", *next)}
	}
	c, ctx, done, err := a.openJobs(ctx, args, 0)
	if err != nil {
		return err
	}
	defer done()
	infos, err := a.schedules(ctx, c)
	if err != nil {
		return err
	}
	views := scheduleViews(infos, time.Now(), *next)
	switch a.format {
	case "json":
		return json.NewEncoder(stdout).Encode(views)
	case "table":
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SCHEDULE\tKIND\tSPEC\tZONE\tOVERLAP\tCATCH-UP\tPAUSED\tLAST OCCURRENCE\tNEXT")
		for _, v := range views {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%v\t%s\t%s\n", v.Name, v.Kind, v.Spec, zone(v.Location), v.Overlap, v.CatchUp, v.Paused, v.Last.Format(time.RFC3339), nextOf(v))
		}
		return tw.Flush()
	}
	for _, v := range views {
		fmt.Fprintf(stdout, "%s kind=%s spec=%q zone=%s overlap=%s catch_up=%s paused=%v last=%s next=%s\n",
			v.Name, v.Kind, v.Spec, zone(v.Location), v.Overlap, v.CatchUp, v.Paused, v.Last.Format(time.RFC3339), nextOf(v))
	}
	return nil
}

// times lists ts in RFC 3339, comma-separated.
func times(ts []time.Time) string {
	var out []string
	for _, t := range ts {
		out = append(out, t.Format(time.RFC3339))
	}
	return strings.Join(out, ",")
}

// nextOf is what the schedules' listing says of a schedule's next
// occurrences: none, and why, when no scheduler runs it.
func nextOf(v scheduleView) string {
	if v.Unrun {
		return "none:no-scheduler-runs-it"
	}
	return times(v.Next)
}

// jobsLimits lists the concurrency slots of the jobs' limits held now:
// which job holds which merchant's (customer's...) slot, since when.
func jobsLimits(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("limits", "limits [--tenant T] [--limit NAME] [-w simple|json|table]", stderr)
	defer func() { err = a.explain(err) }()
	limit := a.fs.String("limit", "", "only this limit's slots (Limit.Name)")
	if err := parseFlags(a.fs, args); err != nil {
		return err
	}
	if *limit != "" {
		if err := jobs.ValidateName(*limit); err != nil {
			return usageError{fmt.Errorf("--limit: %w", err)}
		}
	}
	c, ctx, done, err := a.openJobs(ctx, args, 0)
	if err != nil {
		return err
	}
	defer done()
	var slots []jobs.Slot
	for _, cl := range c.clusters { // (a shard set runs no limits: none)
		got, err := jobs.Slots(ctx, cl.adm, a.tenant, *limit)
		if err != nil {
			return err
		}
		slots = append(slots, got...)
	}
	type view struct {
		Limit string    `json:"limit"`
		Key   string    `json:"key"`
		Slot  int       `json:"slot"`
		Job   string    `json:"job"`
		Token int64     `json:"token"`
		Since time.Time `json:"since"`
	}
	views := make([]view, len(slots))
	for i, s := range slots {
		views[i] = view{Limit: s.Limit, Key: s.Key, Slot: s.Slot, Job: s.Job, Token: int64(s.Token), Since: s.Since}
	}
	switch a.format {
	case "json":
		return json.NewEncoder(stdout).Encode(views)
	case "table":
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "LIMIT\tKEY\tSLOT\tJOB\tTOKEN\tSINCE")
		for _, v := range views {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%s\n", v.Limit, v.Key, v.Slot, v.Job, v.Token, v.Since.Format(time.RFC3339))
		}
		return tw.Flush()
	}
	for _, v := range views {
		fmt.Fprintf(stdout, "%s key=%q slot=%d job=%s token=%d since=%s\n", v.Limit, v.Key, v.Slot, v.Job, v.Token, v.Since.Format(time.RFC3339))
	}
	return nil
}

// zone is a schedule's time zone as shown: UTC when the cursor says none.
func zone(loc string) string {
	if loc == "" {
		return "UTC"
	}
	return loc
}

// jobsPause pauses or resumes a schedule, for every scheduler of it.
func jobsPause(ctx context.Context, op string, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd(op, op+" [--tenant T] [--retention D] SCHEDULE", stderr)
	defer func() { err = a.explain(err) }()
	retention := a.fs.Duration("retention", etcdstore.DefaultRetention, "the retention of the workers' store")
	if err := parseFlags(a.fs, args); err != nil {
		return err
	}
	if a.fs.NArg() == 1 {
		if err := jobs.ValidateName(a.fs.Arg(0)); err != nil {
			return usageError{fmt.Errorf("schedule: %w", err)} // before anything talks to etcd
		}
	}
	c, ctx, done, err := a.openJobs(ctx, args, 1)
	if err != nil {
		return err
	}
	defer done()
	q, closeQueue, err := a.queue(ctx, c, *retention)
	if err != nil {
		return err
	}
	defer closeQueue()
	name := a.fs.Arg(0)
	if err := q.PauseSchedule(ctx, name, op == "pause"); err != nil {
		if errors.Is(err, jobs.ErrInvalid) {
			return usageError{err}
		}
		return err
	}
	fmt.Fprintf(stdout, "%sd %s\n", op, name)
	return nil
}

// jobsBackfill submits a past range of a schedule's occurrences, each once.
func jobsBackfill(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("backfill", "backfill [--tenant T] --from RFC3339 --to RFC3339 [--retention D] SCHEDULE", stderr)
	defer func() { err = a.explain(err) }()
	fromS := a.fs.String("from", "", "the first occurrence's earliest time (RFC 3339), within half the retention")
	toS := a.fs.String("to", "", "the last occurrence's latest time (RFC 3339), in the past")
	retention := a.fs.Duration("retention", etcdstore.DefaultRetention, "the retention of the workers' store")
	if err := parseFlags(a.fs, args); err != nil {
		return err
	}
	from, ferr := time.Parse(time.RFC3339, *fromS)
	to, terr := time.Parse(time.RFC3339, *toS)
	switch {
	case ferr != nil:
		return usageError{fmt.Errorf("--from %q: not an RFC 3339 time (2026-12-01T00:00:00Z)", *fromS)}
	case terr != nil:
		return usageError{fmt.Errorf("--to %q: not an RFC 3339 time (2026-12-02T00:00:00Z)", *toS)}
	case to.Before(from):
		return usageError{fmt.Errorf("--from %s is after --to %s", *fromS, *toS)}
	case to.After(time.Now()):
		return usageError{fmt.Errorf("--to %s is in the future: its occurrences are the schedulers'", *toS)}
	case from.Before(time.Now().Add(-*retention / 2)):
		return usageError{fmt.Errorf("--from %s is older than half the retention (%v): those jobs may be forgotten, and would run twice", *fromS, *retention)}
	}
	if a.fs.NArg() == 1 {
		if err := jobs.ValidateName(a.fs.Arg(0)); err != nil {
			return usageError{fmt.Errorf("schedule: %w", err)}
		}
	}
	c, ctx, done, err := a.openJobs(ctx, args, 1)
	if err != nil {
		return err
	}
	defer done()
	infos, err := a.schedules(ctx, c)
	if err != nil {
		return err
	}
	name := a.fs.Arg(0)
	var info *jobs.ScheduleInfo
	for i := range infos {
		if infos[i].Name == name {
			info = &infos[i]
		}
	}
	switch {
	case info == nil:
		return fmt.Errorf("backfill %s: %w: no scheduler ran it (tenant %s)", name, etcdstore.ErrNotFound, a.tenant)
	case !info.DefaultParams:
		return fmt.Errorf("backfill %s: its occurrences' params come from the program's Schedule.Params: backfill from that program (Queue.Backfill)", name)
	}
	sc, err := info.Schedule(*retention)
	if err != nil {
		return err
	}
	q, closeQueue, err := a.queue(ctx, c, *retention)
	if err != nil {
		return err
	}
	defer closeQueue()
	n, err := q.Backfill(ctx, sc, from, to)
	if err != nil {
		if errors.Is(err, jobs.ErrInvalid) {
			return usageError{err}
		}
		return err
	}
	fmt.Fprintf(stdout, "backfilled %s: %d occurrences submitted\n", name, n)
	return nil
}

// jobView is a job as the commands show it in JSON.
type jobView struct {
	Tenant    string        `json:"tenant"`
	ID        string        `json:"id"`
	Kind      string        `json:"kind"`
	State     jobs.State    `json:"state"`
	Attempts  int           `json:"attempts"`
	Token     int64         `json:"token"`
	Owner     string        `json:"owner,omitempty"`
	Error     string        `json:"error,omitempty"`
	NotBefore *time.Time    `json:"not_before,omitempty"`
	Awaiting  string        `json:"awaiting,omitempty"`
	Limited   string        `json:"limited,omitempty"`
	Zone      string        `json:"zone,omitempty"`
	Params    string        `json:"params,omitempty"`
	Steps     []stepView    `json:"steps,omitempty"`
	Errors    []attemptView `json:"errors,omitempty"`
	Created   time.Time     `json:"created"`
	Expires   time.Time     `json:"expires"`
}

type stepView struct {
	Name        string     `json:"name"`
	Finished    bool       `json:"finished"`
	Token       int64      `json:"token,omitempty"`
	At          *time.Time `json:"at,omitempty"`
	Output      string     `json:"output,omitempty"`
	Compensated bool       `json:"compensated,omitempty"`
}

type attemptView struct {
	Attempt int       `json:"attempt"`
	Token   int64     `json:"token"`
	Step    string    `json:"step,omitempty"`
	Error   string    `json:"error"`
	At      time.Time `json:"at"`
}

func viewJob(j *jobs.Job) jobView {
	v := jobView{Tenant: j.Key.Tenant, ID: j.Key.ID, Kind: j.Kind, State: j.State, Attempts: j.Attempts, Token: int64(j.Token),
		Owner: j.Owner, Error: j.Err, Awaiting: j.Awaiting, Limited: j.Limited, Zone: j.Zone, Params: string(j.Params), Created: j.Created, Expires: j.Expires}
	if !j.NotBefore.IsZero() {
		t := j.NotBefore
		v.NotBefore = &t
	}
	for _, s := range j.Steps {
		sv := stepView{Name: s.Name, Finished: s.Finished, Token: int64(s.Token), Output: string(s.Output), Compensated: s.Compensated}
		if s.Finished {
			t := s.At
			sv.At = &t
		}
		v.Steps = append(v.Steps, sv)
	}
	for _, e := range j.Errors {
		v.Errors = append(v.Errors, attemptView{Attempt: e.Attempt, Token: int64(e.Token), Step: e.Step, Error: e.Err, At: e.At})
	}
	return v
}

// printJobs writes jobs in the chosen format; detail adds steps, errors
// and params to simple output.
func printJobs(w io.Writer, format string, js []*jobs.Job, detail bool) error {
	switch format {
	case "json":
		out := make([]jobView, len(js))
		for i, j := range js {
			out[i] = viewJob(j)
		}
		enc := json.NewEncoder(w)
		if detail && len(out) == 1 {
			return enc.Encode(out[0])
		}
		return enc.Encode(out)
	case "table":
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tKIND\tSTATE\tATTEMPTS\tSTEPS DONE\tTOKEN\tERROR")
		for _, j := range js {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\n", j.Key.ID, j.Kind, j.State, j.Attempts, stepsDone(j), j.Token, oneLine(j.Err, 60))
		}
		return tw.Flush()
	}
	for _, j := range js {
		fmt.Fprintf(w, "%s/%s kind=%s state=%s attempts=%d steps=%s token=%d", j.Key.Tenant, j.Key.ID, j.Kind, j.State, j.Attempts, stepsDone(j), j.Token)
		if j.Owner != "" {
			fmt.Fprintf(w, " owner=%s", j.Owner)
		}
		if !j.NotBefore.IsZero() {
			fmt.Fprintf(w, " not_before=%s", j.NotBefore.Format(time.RFC3339))
		}
		if j.Awaiting != "" {
			fmt.Fprintf(w, " awaiting=%s", j.Awaiting)
		}
		if j.Limited != "" {
			fmt.Fprintf(w, " limited=%q", j.Limited)
		}
		if j.Err != "" {
			fmt.Fprintf(w, " error=%q", oneLine(j.Err, 200))
		}
		fmt.Fprintln(w)
		if !detail {
			continue
		}
		fmt.Fprintf(w, "  created %s, expires %s\n", j.Created.Format(time.RFC3339), j.Expires.Format(time.RFC3339))
		if j.Zone != "" {
			fmt.Fprintf(w, "  submitted in zone %s\n", j.Zone)
		}
		if len(j.Params) > 0 {
			fmt.Fprintf(w, "  params %s\n", printable(j.Params))
		}
		for _, s := range j.Steps {
			switch {
			case s.Compensated:
				fmt.Fprintf(w, "  step %s: finished (token %d, %s), compensated\n", s.Name, s.Token, s.At.Format(time.RFC3339))
			case s.Finished:
				fmt.Fprintf(w, "  step %s: finished (token %d, %s)", s.Name, s.Token, s.At.Format(time.RFC3339))
				if len(s.Output) > 0 {
					fmt.Fprintf(w, " output %s", oneLine(printable(s.Output), 120))
				}
				fmt.Fprintln(w)
			default:
				fmt.Fprintf(w, "  step %s: not finished\n", s.Name)
			}
		}
		for _, e := range j.Errors {
			fmt.Fprintf(w, "  attempt %d (token %d, %s) failed", e.Attempt, e.Token, e.At.Format(time.RFC3339))
			if e.Step != "" {
				fmt.Fprintf(w, " in step %s", e.Step)
			}
			fmt.Fprintf(w, ": %s\n", oneLine(e.Err, 200))
		}
	}
	return nil
}

func stepsDone(j *jobs.Job) string {
	n := 0
	for _, s := range j.Steps {
		if s.Finished {
			n++
		}
	}
	if len(j.Steps) == 0 {
		return "-"
	}
	return fmt.Sprintf("%d/%d", n, len(j.Steps))
}

func oneLine(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// scheduleView is a schedule as idem jobs schedules and the console show
// it.
type scheduleView struct {
	Name          string      `json:"name"`
	Kind          string      `json:"kind"`
	Spec          string      `json:"spec"`
	Location      string      `json:"location,omitempty"`
	Overlap       string      `json:"overlap"`
	CatchUp       string      `json:"catch_up"`
	Paused        bool        `json:"paused"`
	Last          time.Time   `json:"last"`
	Running       *time.Time  `json:"running,omitempty"`
	Buffered      *time.Time  `json:"buffered,omitempty"`
	Next          []time.Time `json:"next"`
	DefaultParams bool        `json:"default_params"`
	// Unrun: no scheduler has moved the cursor past an occurrence that is
	// long due (by two intervals and the default clock skew): nothing runs
	// its upcoming occurrences, so none are listed.
	Unrun bool `json:"unrun,omitempty"`
}

// unrun reports whether no scheduler runs a schedule whose last handled
// occurrence is last: its next one is due by more than two intervals and
// the default clock skew (5 minutes).
func unrun(s jobs.ScheduleInfo, now time.Time) bool {
	next := s.Next(s.Last, 2)
	if s.Paused || len(next) < 2 {
		return false
	}
	return next[0].Before(now.Add(-2*next[1].Sub(next[0]) - 5*time.Minute))
}

// scheduleViews shows infos with each one's next n occurrences after now.
func scheduleViews(infos []jobs.ScheduleInfo, now time.Time, n int) []scheduleView {
	views := make([]scheduleView, len(infos))
	for i, s := range infos {
		v := scheduleView{Name: s.Name, Kind: s.Kind, Spec: s.Spec, Location: s.Location, Overlap: s.Overlap, CatchUp: s.CatchUp,
			Paused: s.Paused, Last: s.Last, Next: s.Next(now, n), DefaultParams: s.DefaultParams}
		if v.Overlap == "" {
			v.Overlap = jobs.OverlapAllowAll.String() // a cursor from before the policies
		}
		if v.CatchUp == "" {
			v.CatchUp = jobs.CatchUpLatest.String()
		}
		if !s.Prev.IsZero() {
			v.Running = &infos[i].Prev
		}
		if !s.Buffered.IsZero() {
			v.Buffered = &infos[i].Buffered
		}
		if v.Unrun = unrun(s, now); v.Unrun || v.Next == nil {
			v.Next = []time.Time{}
		}
		views[i] = v
	}
	return views
}
