package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// adminCmd is what every admin command shares: the etcd connection (the
// embedded etcd's address by default), the tenant and the output format.
type adminCmd struct {
	etcd    etcdFlags
	shards  string
	tenant  string
	format  string
	timeout time.Duration
	fs      *flag.FlagSet
	partial bool          // open shards whose client cannot be made, reporting them (status)
	check   func() error  // the command's own flag checks, before etcd is reached
	set     *shard.Admin  // with --shards-file
	setCfg  *shard.Config // with --shards-file: the set, its clients made
}

func newAdminCmd(name, synopsis string, stderr io.Writer) *adminCmd {
	a := &adminCmd{fs: flag.NewFlagSet(name, flag.ContinueOnError)}
	a.fs.SetOutput(stderr)
	a.fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: idem %s\n\nFlags:\n", synopsis)
		a.fs.PrintDefaults()
	}
	a.etcd.register(a.fs, []string{socketURL("idem-data")}) // the embedded etcd of an idem serve run here
	a.tenant = etcdstore.DefaultTenant
	if name != "status" { // status counts every tenant's keys
		a.fs.StringVar(&a.tenant, "tenant", etcdstore.DefaultTenant, "tenant of the keys")
	}
	a.fs.StringVar(&a.format, "w", "simple", "output format: simple, json or table")
	a.fs.DurationVar(&a.timeout, "command-timeout", 10*time.Second, "timeout of the command")
	a.fs.StringVar(&a.shards, "shards-file", "", "the shard set idem serve was given: find keys across its etcd clusters")
	return a
}

// keyAdmin is what get, ls and evict need: one cluster's etcdstore.Admin,
// or a shard set's.
type keyAdmin interface {
	Get(ctx context.Context, key etcdstore.Key) (*etcdstore.Record, error)
	List(ctx context.Context, tenant string, o etcdstore.ListOptions) ([]*etcdstore.Record, error)
	Evict(ctx context.Context, key etcdstore.Key) error
}

// cluster is one etcd cluster the command reads: its name ("" without
// shards), client and Admin.
type cluster struct {
	name string
	cli  *clientv3.Client
	adm  *etcdstore.Admin
	err  error // why there is no client (a shard whose client could not be made)
}

// open parses args and connects: to --endpoints, or to every cluster of
// --shards-file.
func (a *adminCmd) open(ctx context.Context, args []string, nargs int) (keyAdmin, []cluster, context.Context, context.CancelFunc, error) {
	if err := parseFlags(a.fs, args); err != nil {
		return nil, nil, nil, nil, err
	}
	if nargs >= 0 && a.fs.NArg() != nargs { // (nargs < 0: a.check counts them)
		a.fs.Usage()
		return nil, nil, nil, nil, usageError{fmt.Errorf("%s takes %d argument(s), got %d", a.fs.Name(), nargs, a.fs.NArg())}
	}
	switch a.format {
	case "simple", "json", "table":
	default:
		return nil, nil, nil, nil, usageError{fmt.Errorf("-w %q: must be simple, json or table", a.format)}
	}
	if err := etcdstore.ValidateTenant(a.tenant); err != nil {
		return nil, nil, nil, nil, usageError{fmt.Errorf("--tenant: %w", err)}
	}
	if a.check != nil {
		if err := a.check(); err != nil {
			return nil, nil, nil, nil, usageError{err}
		}
	}
	if a.shards == "" {
		if err := a.etcd.socketsExist(); err != nil {
			return nil, nil, nil, nil, err
		}
	}
	cctx, cancel := context.WithTimeout(ctx, a.timeout)
	if a.shards != "" {
		flags, names, cfg, err := readShards(a.shards, a.etcd)
		if err != nil {
			cancel()
			return nil, nil, nil, nil, usageError{err}
		}
		clis, errs := shardClients(flags, &cfg)
		done := func() {
			cancel()
			for _, c := range clis {
				c.Close()
			}
		}
		if len(errs) > 0 && !a.partial {
			done()
			for _, n := range names {
				if err := errs[n]; err != nil {
					return nil, nil, nil, nil, fmt.Errorf("shard %s: %w", n, err)
				}
			}
		}
		var cs []cluster
		for i, n := range names {
			if errs[n] != nil {
				cs = append(cs, cluster{name: n, err: errs[n]})
				cfg.Shards[i].Client = &clientv3.Client{} // never used: the shard is reported as not answering
				continue
			}
			cs = append(cs, cluster{name: n, cli: cfg.Shards[i].Client})
		}
		sa, err := shard.NewAdmin(cfg, etcdstore.WithPrefix(a.etcd.prefix))
		if err != nil {
			done()
			return nil, nil, nil, nil, usageError{err}
		}
		for i := range cs {
			if cs[i].err == nil {
				cs[i].adm = sa.Shard(cs[i].name)
			}
		}
		a.set, a.setCfg = sa, &cfg
		return sa, cs, cctx, done, nil
	}
	cli, err := a.etcd.client()
	if err != nil {
		cancel()
		return nil, nil, nil, nil, err
	}
	adm, err := etcdstore.NewAdmin(cli, etcdstore.WithPrefix(a.etcd.prefix))
	if err != nil {
		cancel()
		cli.Close()
		return nil, nil, nil, nil, err
	}
	return adm, []cluster{{cli: cli, adm: adm}}, cctx, func() { cancel(); cli.Close() }, nil
}

// key is the command's KEY argument, in either form the HTTP edge accepts:
// bare (abc) or as an sf-string ("abc").
func (a *adminCmd) key() (etcdstore.Key, error) {
	id, err := idemhttp.ParseKey(a.fs.Arg(0))
	if err != nil {
		return etcdstore.Key{}, usageError{err}
	}
	return etcdstore.Key{Tenant: a.tenant, ID: id}, nil
}

func adminGet(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newAdminCmd("get", "get [--tenant T] [-w simple|json|table] KEY", stderr)
	defer func() { err = a.explain(err) }()
	adm, _, ctx, done, err := a.open(ctx, args, 1)
	if err != nil {
		return err
	}
	defer done()
	key, err := a.key()
	if err != nil {
		return err
	}
	rec, err := adm.Get(ctx, key)
	if err != nil {
		return err
	}
	return printRecords(stdout, a.format, []*etcdstore.Record{rec}, true)
}

func adminList(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newAdminCmd("ls", "ls [--tenant T] [--all-tenants] [--state in_flight|done] [--limit N] [-w simple|json|table]", stderr)
	defer func() { err = a.explain(err) }()
	state := a.fs.String("state", "", "only keys in this state: in_flight or done")
	limit := a.fs.Int("limit", 0, "at most this many keys (0: all)")
	a.check = func() error {
		switch {
		case *state != "" && *state != string(etcdstore.InFlight) && *state != string(etcdstore.Done):
			return fmt.Errorf("--state %q: must be in_flight or done", *state)
		case *limit < 0:
			return fmt.Errorf("--limit %d: must be 0 (all) or more", *limit)
		}
		return nil
	}
	all := a.fs.Bool("all-tenants", false, "list every tenant's keys")
	adm, _, ctx, done, err := a.open(ctx, args, 0)
	if err != nil {
		return err
	}
	defer done()
	tenant := a.tenant
	if *all {
		tenant = ""
	}
	var recs []*etcdstore.Record
	var after *etcdstore.Key
	for {
		page := etcdstore.MaxListLimit
		if *limit > 0 {
			page = min(page, *limit-len(recs))
		}
		got, err := adm.List(ctx, tenant, etcdstore.ListOptions{State: etcdstore.State(*state), After: after, Limit: page})
		if err != nil {
			return err
		}
		recs = append(recs, got...)
		if len(got) < page || *limit > 0 && len(recs) >= *limit {
			break
		}
		after = &got[len(got)-1].Key
	}
	return printRecords(stdout, a.format, recs, false)
}

func adminEvict(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newAdminCmd("evict", "evict [--tenant T] KEY", stderr)
	defer func() { err = a.explain(err) }()
	adm, _, ctx, done, err := a.open(ctx, args, 1)
	if err != nil {
		return err
	}
	defer done()
	key, err := a.key()
	if err != nil {
		return err
	}
	if err := adm.Evict(ctx, key); err != nil {
		return err
	}
	if a.format == "json" {
		return json.NewEncoder(stdout).Encode(map[string]any{"evicted": key.ID, "tenant": a.tenant})
	}
	fmt.Fprintf(stdout, "evicted %s\n", key)
	return nil
}

// statusReport is idem status's output.
type statusReport struct {
	Shard   string         `json:"shard,omitempty"`
	Error   string         `json:"error,omitempty"`
	Set     *setReport     `json:"shard_set,omitempty"`
	Members []memberStatus `json:"members"`
	Leader  string         `json:"leader"`
	Keys    storex.Stats   `json:"keys"`
}

type memberStatus struct {
	ID        string `json:"id"`
	Name      string `json:"name"`
	Endpoint  string `json:"endpoint"`
	Version   string `json:"version,omitempty"`
	DBSize    int64  `json:"db_size,omitempty"`
	DBInUse   int64  `json:"db_size_in_use,omitempty"`
	IsLeader  bool   `json:"is_leader"`
	RaftIndex uint64 `json:"raft_index,omitempty"`
	Error     string `json:"error,omitempty"`
}

func adminStatus(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newAdminCmd("status", "status [-w simple|json|table] [--max-scan N] [--shards-file F]", stderr)
	defer func() { err = a.explain(err) }()
	maxScan := a.fs.Int64("max-scan", 100000, "read the state of at most this many keys (0: all)")
	a.partial = true
	_, clusters, ctx, done, err := a.open(ctx, args, 0)
	if err != nil {
		return err
	}
	defer done()
	if a.shards == "" {
		rep, err := clusterStatus(ctx, clusters[0], *maxScan)
		if err != nil {
			return err
		}
		if a.format == "json" {
			return json.NewEncoder(stdout).Encode(rep)
		}
		return printStatus(stdout, a.format, rep)
	}
	// Every shard is asked at once, each within the command's timeout: a
	// shard that does not answer is reported as such, and the others are
	// reported all the same.
	reps := make([]statusReport, len(clusters))
	var wg sync.WaitGroup
	for i, c := range clusters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if c.err != nil {
				reps[i] = statusReport{Shard: c.name, Error: c.err.Error()}
				return
			}
			rep, err := clusterStatus(ctx, c, *maxScan)
			if err != nil {
				rep.Error = err.Error()
			}
			// Its set, read here: a shard that hangs delays only its own.
			if st, err := a.set.SetOf(ctx, c.name); err == nil {
				rep.Set = &setReport{Generation: st.Set.Generation, Placement: st.Set.Placement.Shards, Pin: st.Set.Placement.Pin, Drained: st.Drained, Settled: st.Set.Settled}
				if p := st.Set.Previous; p != nil {
					rep.Set.Previous = p.Shards
				}
			}
			reps[i] = rep
		}()
	}
	wg.Wait()
	down := 0
	for i := range reps {
		if reps[i].Error != "" {
			down++
		}
	}
	if a.format == "json" {
		if err := json.NewEncoder(stdout).Encode(reps); err != nil {
			return err
		}
	} else {
		for i, rep := range reps {
			if i > 0 {
				fmt.Fprintln(stdout)
			}
			fmt.Fprintf(stdout, "shard %s\n", rep.Shard)
			if rep.Set != nil && rep.Set.Generation > 0 {
				fmt.Fprintf(stdout, "shard set: generation %d, placement %v", rep.Set.Generation, rep.Set.Placement)
				switch {
				case rep.Set.Previous != nil && rep.Set.Settled:
					fmt.Fprintf(stdout, ", settled (keys handed over from %v)", rep.Set.Previous)
				case rep.Set.Previous != nil:
					fmt.Fprintf(stdout, ", handing keys over from %v", rep.Set.Previous)
				}
				if rep.Set.Drained > 0 {
					fmt.Fprintf(stdout, "; drained for generation %d", rep.Set.Drained)
				}
				fmt.Fprintln(stdout)
			}
			if rep.Error != "" {
				fmt.Fprintf(stdout, "does not answer: %s\n", rep.Error)
				continue
			}
			if err := printStatus(stdout, a.format, rep); err != nil {
				return err
			}
		}
	}
	if down == len(reps) {
		return fmt.Errorf("no shard answers")
	}
	return nil
}

// setReport is what one shard records of the shard set.
type setReport struct {
	Generation int64             `json:"generation"`
	Placement  []string          `json:"placement"`
	Pin        map[string]string `json:"pin,omitempty"`
	Previous   []string          `json:"previous,omitempty"`
	Drained    int64             `json:"drained_generation,omitempty"`
	Settled    bool              `json:"settled,omitempty"`
}

// clusterStatus reads one cluster's members and idem's keys in it.
func clusterStatus(ctx context.Context, c cluster, maxScan int64) (statusReport, error) {
	rep := statusReport{Shard: c.name}
	ml, err := c.cli.MemberList(ctx)
	if err != nil {
		return rep, fmt.Errorf("member list: %w", err)
	}
	for _, m := range ml.Members {
		ms := memberStatus{ID: strconv.FormatUint(m.ID, 16), Name: m.Name}
		if len(m.ClientURLs) > 0 {
			ms.Endpoint = m.ClientURLs[0]
			st, err := c.cli.Status(ctx, ms.Endpoint)
			if err != nil {
				ms.Error = err.Error()
			} else {
				ms.Version, ms.DBSize, ms.DBInUse, ms.RaftIndex = st.Version, st.DbSize, st.DbSizeInUse, st.RaftIndex
				ms.IsLeader = st.Leader == m.ID
				if ms.IsLeader {
					rep.Leader = ms.Name
				}
			}
		}
		rep.Members = append(rep.Members, ms)
	}
	sort.Slice(rep.Members, func(i, j int) bool { return rep.Members[i].Name < rep.Members[j].Name })
	rep.Keys, err = storex.ReadStats(c.adm, ctx, maxScan)
	return rep, err
}

func printStatus(stdout io.Writer, format string, rep statusReport) error {
	if format == "table" {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "MEMBER\tID\tENDPOINT\tVERSION\tDB SIZE\tIN USE\tLEADER\tERROR")
		for _, m := range rep.Members {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%v\t%s\n", m.Name, m.ID, m.Endpoint, m.Version, bytesOf(m.DBSize), bytesOf(m.DBInUse), m.IsLeader, m.Error)
		}
		tw.Flush()
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		k := rep.Keys
		fmt.Fprintln(tw, "KEYS\tIN FLIGHT\tDONE\tEXPIRED\tSCANNED\tSESSIONS\tLEASES")
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t%d\n", k.Records, k.InFlight, k.Done, k.Expired, k.Scanned, k.Owners, k.Leases)
		return tw.Flush()
	}
	for _, m := range rep.Members {
		line := fmt.Sprintf("member %s id=%s endpoint=%s version=%s db=%s in_use=%s leader=%v", m.Name, m.ID, m.Endpoint, m.Version, bytesOf(m.DBSize), bytesOf(m.DBInUse), m.IsLeader)
		if m.Error != "" {
			line += " error=" + strconv.Quote(m.Error)
		}
		fmt.Fprintln(stdout, line)
	}
	k := rep.Keys
	fmt.Fprintf(stdout, "keys=%d in_flight=%d done=%d expired=%d scanned=%d sessions=%d leases=%d\n",
		k.Records, k.InFlight, k.Done, k.Expired, k.Scanned, k.Owners, k.Leases)
	return nil
}

// printRecords writes records in the chosen format. detail adds the body
// to simple output.
func printRecords(w io.Writer, format string, recs []*etcdstore.Record, detail bool) error {
	switch format {
	case "json":
		out := make([]recordView, len(recs))
		for i, r := range recs {
			out[i] = view(r)
		}
		enc := json.NewEncoder(w)
		if detail && len(out) == 1 {
			return enc.Encode(out[0])
		}
		return enc.Encode(out)
	case "table":
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TENANT\tKEY\tTYPE\tSTATE\tTOKEN\tSTATUS\tBODY\tCREATED\tEXPIRES")
		for _, r := range recs {
			v := view(r)
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", v.Tenant, v.Key, typeOf(v), v.State, v.Token, statusOf(v), bytesOf(int64(len(v.bodyBytes))),
				v.Created.Format(time.RFC3339), v.Expires.Format(time.RFC3339))
		}
		return tw.Flush()
	}
	for _, r := range recs {
		v := view(r)
		fmt.Fprintf(w, "%s/%s state=%s token=%d status=%s body=%s created=%s expires=%s type=%s", v.Tenant, v.Key, v.State, v.Token,
			statusOf(v), bytesOf(int64(len(v.bodyBytes))), v.Created.Format(time.RFC3339), v.Expires.Format(time.RFC3339), typeOf(v))
		if v.Job == nil && v.Outcome != nil && v.Outcome.Error != "" {
			fmt.Fprintf(w, " error=%q", oneLine(v.Outcome.Error, 200))
		}
		if v.Abandoned {
			fmt.Fprint(w, " abandoned=true")
		}
		if v.Deadline != nil {
			fmt.Fprintf(w, " deadline=%s", v.Deadline.Format(time.RFC3339))
		}
		if j := v.Job; j != nil {
			fmt.Fprintf(w, " job=%s kind=%s attempts=%d", j.State, j.Kind, j.Attempts)
			if j.Error != "" {
				fmt.Fprintf(w, " job_error=%q", oneLine(j.Error, 200))
			}
		}
		fmt.Fprintln(w)
		if detail && len(v.bodyBytes) > 0 {
			fmt.Fprintf(w, "%s\n", printable(v.bodyBytes))
		}
	}
	return nil
}

// recordView is a record as the admin commands show it.
type recordView struct {
	Tenant string `json:"tenant"`
	idemhttp.RecordJSON
	Owner   string `json:"owner,omitempty"`
	Attempt string `json:"attempt,omitempty"`
	// Job is set when the record holds a job (package jobs): idem jobs get
	// shows the rest.
	Job       *jobSummary `json:"job,omitempty"`
	bodyBytes []byte
}

// jobSummary is what get and ls show of a job.
type jobSummary struct {
	Kind     string     `json:"kind"`
	State    jobs.State `json:"state"`
	Attempts int        `json:"attempts"`
	Error    string     `json:"error,omitempty"`
}

func view(r *etcdstore.Record) recordView {
	v := recordView{Tenant: r.Key.Tenant, Owner: r.Owner, Attempt: r.Attempt, RecordJSON: idemhttp.RecordView(r)}
	if j, err := jobs.FromRecord(r, time.Now()); err == nil {
		v.Job = &jobSummary{Kind: j.Kind, State: j.State, Attempts: j.Attempts, Error: j.Err}
	}
	if r.Outcome != nil {
		v.bodyBytes = r.Outcome.Body
	}
	return v
}

// typeOf is what the record is: key, job, or - (a moved record, or one
// written before records had kinds).
func typeOf(v recordView) string {
	switch {
	case v.Kind != "":
		return v.Kind
	case v.Job != nil:
		return string(etcdstore.KindJob)
	}
	return "-"
}

func statusOf(v recordView) string {
	if v.Outcome == nil || v.Outcome.Status == 0 {
		return "-"
	}
	return strconv.Itoa(v.Outcome.Status)
}

func bytesOf(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1fGiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1fKiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%dB", n)
}

// printable shows a body as text when it is, and as a quoted string when not.
func printable(b []byte) string {
	s := string(b)
	if strings.ToValidUTF8(s, "\uFFFD") == s && !strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 && r != '\n' && r != '\t' }) {
		return s
	}
	return strconv.Quote(s)
}

// explain adds what the endpoints say to a failure to reach etcd (see
// etcdFlags.explain); with --shards-file the error names its shard.
func (a *adminCmd) explain(err error) error {
	if a.shards != "" {
		return err
	}
	return a.etcd.explain(err)
}

// BodySize is the size of the record's saved body (the console shows it).
func (v recordView) BodySize() int64 { return int64(len(v.bodyBytes)) }

// Status is the saved status, or "-" (the console shows it).
func (v recordView) Status() string { return statusOf(v) }
