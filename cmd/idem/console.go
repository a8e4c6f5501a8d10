package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	dto "github.com/prometheus/client_model/go"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/idemhttp"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
	"github.com/idem-dev/idem/shard"
)

// The console (idem serve --console): pages for the people who run idem,
// served on the admin listener under /console/, behind its TLS and client
// certificates. It reads what the admin commands read and acts through
// the code the CLI's commands call (etcdstore.Admin.Evict or the shard
// set's, jobs.Queue.Retry and Cancel). docs/CONSOLE.md describes it.

//go:embed console
var consoleFiles embed.FS

const (
	consoleSampleEvery = 5 * time.Second
	consoleSamples     = 121 // ten minutes of consoleSampleEvery, and the first point
	consolePageSize    = 100
	consoleCookie      = "idem_console"
	consoleStatScan    = 2000 // records whose state the overview reads, per cluster
	consoleJobScan     = 5000 // records the jobs page reads at most to fill a page of one state
)

// consoleOutcomes are the edge outcomes the overview charts: what a
// person on call asks first.
var consoleOutcomes = []struct{ Label, Title string }{
	{"claimed", "Claims"},
	{"replayed", "Replays"},
	{"conflict", "Conflicts (409)"},
	{"mismatch", "Mismatches (422)"},
	{"unavailable", "Unavailable (503)"},
	{"takeover", "Takeovers"},
}

type console struct {
	s      *server
	pages  map[string]*template.Template
	static http.Handler
	secret []byte // signs the CSRF tokens; new with every process
	cop    *http.CrossOriginProtection

	started time.Time // the counters count from about here (the process's start)

	mu      sync.Mutex
	samples []consoleSample // oldest first
	stop    chan struct{}
	done    chan struct{}
}

type consoleSample struct {
	At     time.Time
	Counts []float64 // by consoleOutcomes
}

func newConsole(s *server) (*console, error) {
	k := &console{s: s, pages: map[string]*template.Template{}, stop: make(chan struct{}), done: make(chan struct{}),
		cop: http.NewCrossOriginProtection(), started: time.Now()}
	k.secret = make([]byte, 32)
	rand.Read(k.secret)
	funcs := template.FuncMap{
		"when":      consoleWhen,
		"ago":       func(t time.Time) string { return consoleAgo(time.Since(t)) },
		"left":      func(t time.Time) string { return consoleAgo(time.Until(t)) },
		"bytes":     bytesOf,
		"count":     func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) },
		"q":         url.QueryEscape,
		"printable": printable,
		"short":     oneLine,
		"pct": func(a, b int64) string {
			if b <= 0 {
				return "-"
			}
			return fmt.Sprintf("%.0f%%", 100*float64(a)/float64(b))
		},
	}
	for _, page := range []string{"overview", "keys", "key", "confirm", "jobs", "job", "error"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(consoleFiles, "console/layout.html", "console/"+page+".html")
		if err != nil {
			return nil, fmt.Errorf("console template %s: %w", page, err)
		}
		k.pages[page] = t
	}
	sub, err := fs.Sub(consoleFiles, "console/static")
	if err != nil {
		return nil, err
	}
	k.static = http.StripPrefix("/console/static/", http.FileServerFS(sub))
	k.sample()
	go k.sampler()
	return k, nil
}

// Close stops the sampler.
func (k *console) Close() {
	select {
	case <-k.stop:
	default:
		close(k.stop)
	}
	<-k.done
}

func (k *console) sampler() {
	defer close(k.done)
	t := time.NewTicker(consoleSampleEvery)
	defer t.Stop()
	for {
		select {
		case <-k.stop:
			return
		case <-t.C:
			k.sample()
		}
	}
}

// sample reads the edge's counters.
func (k *console) sample() {
	sm := consoleSample{At: time.Now(), Counts: make([]float64, len(consoleOutcomes))}
	for i, o := range consoleOutcomes {
		sm.Counts[i] = k.count(o.Label)
		if o.Label == "unavailable" {
			sm.Counts[i] += k.count("store_full") // 503 too
		}
	}
	k.mu.Lock()
	k.samples = append(k.samples, sm)
	if len(k.samples) > consoleSamples {
		k.samples = slices.Delete(k.samples, 0, len(k.samples)-consoleSamples)
	}
	k.mu.Unlock()
}

func (k *console) count(label string) float64 {
	var m dto.Metric
	if err := k.s.metrics.Requests.WithLabelValues(label).Write(&m); err != nil {
		return 0
	}
	return m.GetCounter().GetValue()
}

// ServeHTTP routes the console's pages.
func (k *console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "no-referrer")
	if !k.hostAllowed(r) {
		k.s.log.Warn("console request refused: Host is not one the console answers to", "host", r.Host, "remote", r.RemoteAddr)
		http.Error(w, fmt.Sprintf("the console does not answer to Host %q over plain HTTP: only to IP addresses, localhost and the names of --console-hosts (a name could be DNS rebinding)", r.Host), http.StatusMisdirectedRequest)
		return
	}
	if strings.HasPrefix(r.URL.Path, "/console/static/") && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		if strings.HasSuffix(r.URL.Path, "/") {
			http.NotFound(w, r) // no listings
			return
		}
		k.static.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	if r.Method == http.MethodPost {
		k.post(w, r)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD, POST")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	switch r.URL.Path {
	case "/console", "/console/":
		k.overview(w, r)
	case "/console/keys":
		k.keys(w, r)
	case "/console/key":
		k.key(w, r)
	case "/console/key/evict":
		k.confirm(w, r, "evict")
	case "/console/jobs":
		k.jobs(w, r)
	case "/console/job":
		k.job(w, r)
	case "/console/job/cancel":
		k.confirm(w, r, "cancel")
	default:
		k.fail(w, r, http.StatusNotFound, errors.New("no such page"))
	}
}

// page is what every page's layout needs.
type page struct {
	Title   string
	Nav     string // the section: overview, keys or jobs
	Token   string // the CSRF token for the page's forms
	Who     string
	Refresh bool // the page refreshes its main part by itself
	Flash   string
	Data    any
}

func (k *console) render(w http.ResponseWriter, r *http.Request, status int, name string, p page) {
	p.Token = k.token(w, r)
	p.Who = who(r)
	if msg := r.URL.Query().Get("done"); msg != "" && hmac.Equal([]byte(r.URL.Query().Get("sig")), []byte(k.mac("done\x00"+msg))) {
		p.Flash = msg // said by this process's own redirect after an action, not by whoever wrote the link
	}
	var buf bytes.Buffer
	if err := k.pages[name].Execute(&buf, p); err != nil {
		k.s.log.Error("console page", "page", name, "err", err)
		http.Error(w, "the console could not draw this page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	w.Write(buf.Bytes())
}

func (k *console) fail(w http.ResponseWriter, r *http.Request, status int, err error) {
	k.render(w, r, status, "error", page{Title: http.StatusText(status), Data: err.Error()})
}

// failFor answers err of a read or a refused action with the status the
// worker API gives it (idemhttp.ProblemFor).
func (k *console) failFor(w http.ResponseWriter, r *http.Request, err error) {
	k.fail(w, r, httpStatusOf(err), err)
}

func httpStatusOf(err error) int {
	switch {
	case errors.Is(err, errNoStore):
		return http.StatusServiceUnavailable
	case errors.Is(err, jobs.ErrNotParked), errors.Is(err, jobs.ErrRunning):
		return http.StatusConflict
	}
	return idemhttp.ProblemFor(err).Status
}

// outcomeUnknown reports whether an action that failed with err may have
// happened all the same: its write may have reached etcd (etcd did not
// answer in time, the connection broke), or the error is not one that says
// it was refused. Only a write that never left this process, or a refusal
// (bad input, not found, a conflict), did not happen.
func outcomeUnknown(err error) bool {
	if errors.Is(err, etcdstore.ErrNotSent) || errors.Is(err, errNoStore) {
		return false
	}
	status := httpStatusOf(err)
	return status >= 500
}

var errNoStore = errors.New("idem has not reached etcd yet")

// clusters returns the admin's view of what the server serves: one
// cluster, or every shard of its set (a shard not connected yet is one
// with its error, and the set's keys are read through the store).
func (k *console) clusters() (jobsTarget, backend, error) {
	store := k.s.current()
	if store == nil {
		return jobsTarget{}, nil, errNoStore
	}
	switch st := store.(type) {
	case *shard.Store:
		t := jobsTarget{keys: st}
		status := st.Status()
		for _, n := range st.Shards() {
			sh := st.Shard(n)
			if sh == nil {
				err := status.Shards[n]
				if err == nil {
					err = errors.New("not connected yet")
				}
				t.clusters = append(t.clusters, cluster{name: n, err: err})
				continue
			}
			t.clusters = append(t.clusters, cluster{name: n, cli: sh.Client(), adm: &sh.Admin})
		}
		return t, store, nil
	case *etcdstore.Store:
		return jobsTarget{keys: &st.Admin, clusters: []cluster{{cli: st.Client(), adm: &st.Admin}}}, store, nil
	}
	return jobsTarget{}, nil, fmt.Errorf("the console cannot read a %T", store)
}

// connected is t without the shards that are not connected, and why
// those are not.
func connected(t jobsTarget) (jobsTarget, []string) {
	var out jobsTarget
	out.keys = t.keys
	var down []string
	for _, c := range t.clusters {
		if c.err != nil {
			down = append(down, fmt.Sprintf("shard %s: %v", c.name, c.err))
			continue
		}
		out.clusters = append(out.clusters, c)
	}
	return out, down
}

func (k *console) ctx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), 5*time.Second)
}

// --- Overview

type overviewData struct {
	Charts   []chart
	Since    time.Time
	Live     bool
	Full     bool
	Running  int
	Owner    string
	Clusters []clusterView
	Err      string
}

type chart struct {
	Title, Label string
	Total        float64
	Last         float64 // in the last interval
	Bars         []bar   // one per interval with requests, right-aligned: the newest last
	Max          float64
	Desc         string
}

type bar struct{ X, Y, W, H float64 }

type clusterView struct {
	statusReport
	Alarms  []string
	Quota   int64 // bytes, when known
	Healthy string
}

func (k *console) overview(w http.ResponseWriter, r *http.Request) {
	d := overviewData{Charts: k.charts()}
	d.Since = k.started
	t, store, err := k.clusters()
	if err != nil {
		d.Err = err.Error()
		k.render(w, r, http.StatusOK, "overview", page{Title: "Overview", Nav: "overview", Refresh: true, Data: d})
		return
	}
	m := store.Metrics()
	d.Live, d.Full, d.Running, d.Owner = m.Live, m.Full, m.Running, store.Owner()
	ctx, cancel := k.ctx(r)
	defer cancel()
	var health map[string]error
	if set, ok := store.(*shard.Store); ok {
		health = set.Check(ctx, readyTimeout)
	}
	d.Clusters = make([]clusterView, len(t.clusters))
	var wg sync.WaitGroup
	for i, c := range t.clusters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cv := clusterView{}
			if c.err != nil {
				cv.statusReport = statusReport{Shard: c.name, Error: c.err.Error()}
				cv.Healthy = "does not answer: " + c.err.Error()
				d.Clusters[i] = cv
				return
			}
			rep, err := clusterStatus(ctx, c, consoleStatScan)
			if err != nil {
				rep.Error = err.Error()
			}
			cv.statusReport = rep
			if al, err := c.cli.AlarmList(ctx); err == nil {
				for _, a := range al.Alarms {
					cv.Alarms = append(cv.Alarms, fmt.Sprintf("%s on member %x", a.Alarm, a.MemberID))
				}
			}
			if k.s.etcd != nil {
				cv.Quota = k.s.cfg.quotaBytes
			}
			if health != nil {
				cv.Healthy = "answers"
				if err := health[c.name]; err != nil {
					cv.Healthy = "does not answer: " + err.Error()
				}
			}
			d.Clusters[i] = cv
		}()
	}
	wg.Wait()
	k.render(w, r, http.StatusOK, "overview", page{Title: "Overview", Nav: "overview", Refresh: true, Data: d})
}

// charts draws each outcome's requests per interval over the samples.
func (k *console) charts() []chart {
	k.mu.Lock()
	samples := slices.Clone(k.samples)
	k.mu.Unlock()
	out := make([]chart, len(consoleOutcomes))
	const width, height = 240.0, 48.0
	for i, o := range consoleOutcomes {
		c := chart{Title: o.Title, Label: o.Label}
		var deltas []float64
		for j := 1; j < len(samples); j++ {
			deltas = append(deltas, samples[j].Counts[i]-samples[j-1].Counts[i])
		}
		if n := len(samples); n > 0 {
			c.Total = samples[n-1].Counts[i]
		}
		c.Total = max(c.Total, k.count(o.Label)) // now, not at the last sample
		if o.Label == "unavailable" {
			c.Total = max(c.Total, k.count("unavailable")+k.count("store_full"))
		}
		for _, d := range deltas {
			c.Max = max(c.Max, d)
		}
		if len(deltas) > 0 {
			c.Last = deltas[len(deltas)-1]
		}
		step := width / float64(consoleSamples-1)
		x0 := width - step*float64(len(deltas))
		for j, d := range deltas {
			if d <= 0 || c.Max <= 0 {
				continue
			}
			h := max(d/c.Max*(height-2), 1.5)
			c.Bars = append(c.Bars, bar{X: x0 + step*float64(j), Y: height - h, W: max(step-0.4, 0.8), H: h})
		}
		c.Desc = fmt.Sprintf("%s per %s over the last %s: at most %.0f, %.0f in the last interval, %.0f since the process started",
			o.Title, consoleSampleEvery, consoleAgo(consoleSampleEvery*time.Duration(max(len(deltas), 1))), c.Max, c.Last, c.Total)
		out[i] = c
	}
	return out
}

// --- Keys

type keysData struct {
	Tenant, State string
	Records       []recordView
	Next          template.URL // the next page, "" on the last
	Err           string
}

func (k *console) keys(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	d := keysData{Tenant: q.Get("tenant"), State: q.Get("state")}
	if d.Tenant != "" {
		if err := etcdstore.ValidateTenant(d.Tenant); err != nil {
			k.fail(w, r, http.StatusBadRequest, fmt.Errorf("tenant: %w", err))
			return
		}
	}
	switch etcdstore.State(d.State) {
	case "", etcdstore.InFlight, etcdstore.Done:
	default:
		k.fail(w, r, http.StatusBadRequest, fmt.Errorf("state %q: must be in_flight or done", d.State))
		return
	}
	var after *etcdstore.Key
	if a := q.Get("after_key"); a != "" {
		after = &etcdstore.Key{Tenant: q.Get("after_tenant"), ID: a}
		if err := after.Validate(); err != nil {
			k.fail(w, r, http.StatusBadRequest, fmt.Errorf("after: %w", err))
			return
		}
	}
	t, _, err := k.clusters()
	if err != nil {
		k.failFor(w, r, err)
		return
	}
	ctx, cancel := k.ctx(r)
	defer cancel()
	recs, err := t.keys.List(ctx, d.Tenant, etcdstore.ListOptions{State: etcdstore.State(d.State), After: after, Limit: consolePageSize})
	if err != nil {
		if len(recs) == 0 {
			k.failFor(w, r, err)
			return
		}
		d.Err = err.Error()
	}
	for _, rec := range recs {
		d.Records = append(d.Records, view(rec))
	}
	if len(recs) == consolePageSize {
		last := recs[len(recs)-1].Key
		v := url.Values{"tenant": {d.Tenant}, "state": {d.State}, "after_tenant": {last.Tenant}, "after_key": {last.ID}}
		d.Next = template.URL("/console/keys?" + v.Encode())
	}
	k.render(w, r, http.StatusOK, "keys", page{Title: "Keys", Nav: "keys", Data: d})
}

// keyOf reads the tenant and key of a query or form.
func keyOf(v url.Values, name string) (etcdstore.Key, error) {
	key := etcdstore.Key{Tenant: v.Get("tenant"), ID: v.Get(name)}
	if key.Tenant == "" {
		key.Tenant = etcdstore.DefaultTenant
	}
	if err := key.Validate(); err != nil {
		return key, err
	}
	return key, nil
}

type keyData struct {
	R          recordView
	Key        etcdstore.Key
	Alive      string // the owner's session: alive, gone, or why it is not known
	Headers    []header
	Hidden     []string // saved headers the replay policy now withholds
	Preview    string
	Truncated  bool
	Checkpoint string
}

type header struct{ Name, Value string }

const consolePreview = 4 << 10

func (k *console) key(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := k.ctx(r)
	defer cancel()
	t, key, rec, ok := k.record(ctx, w, r, r.URL.Query(), "key")
	if !ok {
		return
	}
	d := keyData{R: view(rec), Key: key}
	if rec.State == etcdstore.InFlight {
		d.Alive = k.ownerAlive(ctx, t, rec.Owner)
	}
	if len(rec.Checkpoint) > 0 {
		d.Checkpoint = oneLine(printable(rec.Checkpoint), 400)
	}
	if o := rec.Outcome; o != nil {
		keep := k.replayPolicy()
		names := make([]string, 0, len(o.Header))
		for n := range o.Header {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			if !keep(n) {
				d.Hidden = append(d.Hidden, n)
				continue
			}
			for _, v := range o.Header[n] {
				d.Headers = append(d.Headers, header{n, v})
			}
		}
		b := o.Body
		if len(b) > consolePreview {
			n := consolePreview
			for n > consolePreview-utf8.UTFMax && !utf8.RuneStart(b[n]) {
				n-- // not inside a character: a text body stays text
			}
			b, d.Truncated = b[:n], true
		}
		d.Preview = printable(b)
	}
	k.render(w, r, http.StatusOK, "key", page{Title: "Key " + key.ID, Nav: "keys", Data: d})
}

// record reads the record the query names (its tenant and the field
// holding the key or job id), answering the request itself when it cannot.
func (k *console) record(ctx context.Context, w http.ResponseWriter, r *http.Request, q url.Values, field string) (jobsTarget, etcdstore.Key, *etcdstore.Record, bool) {
	key, err := keyOf(q, field)
	if err != nil {
		k.fail(w, r, http.StatusBadRequest, err)
		return jobsTarget{}, key, nil, false
	}
	t, _, err := k.clusters()
	if err != nil {
		k.failFor(w, r, err)
		return jobsTarget{}, key, nil, false
	}
	rec, err := t.keys.Get(ctx, key)
	if err != nil {
		k.failFor(w, r, err)
		return jobsTarget{}, key, nil, false
	}
	return t, key, rec, true
}

// ownerAlive says whether an in-flight record's owner session lives.
func (k *console) ownerAlive(ctx context.Context, t jobsTarget, owner string) string {
	switch owner {
	case "":
		return "none: the claim was abandoned for the next claimant to resume"
	case etcdstore.DeadlineOwner:
		return "none: a worker API claim, live until its deadline (renewals move it)"
	}
	var errs []string
	up, down := connected(t)
	errs = append(errs, down...)
	for _, c := range up.clusters {
		alive, err := storex.OwnerAlive(c.adm, ctx, owner)
		switch {
		case err != nil:
			errs = append(errs, err.Error())
		case alive:
			return "alive"
		}
	}
	if len(errs) > 0 {
		return "not known: " + strings.Join(errs, "; ")
	}
	return "gone: the next request for the key takes the claim over"
}

// replayPolicy says which saved headers a replay sends, as the edge's
// --replay-deny-headers and --replay-allow-headers say.
func (k *console) replayPolicy() func(name string) bool {
	c := k.s.cfg
	deny, allow := map[string]bool{}, map[string]bool{}
	if !(len(c.replayDeny) == 1 && c.replayDeny[0] == "none") {
		for _, n := range c.replayDeny {
			deny[http.CanonicalHeaderKey(n)] = true
		}
	}
	for _, n := range c.replayAllow {
		allow[http.CanonicalHeaderKey(n)] = true
	}
	return func(n string) bool {
		n = http.CanonicalHeaderKey(n)
		return !deny[n] && (len(allow) == 0 || allow[n])
	}
}

// --- Jobs

type jobsData struct {
	Tenant, State string
	States        []jobs.State
	Jobs          []jobView
	More          bool
	Capped        bool // the scan stopped at consoleJobScan records
	Scan          int
	Schedules     []scheduleView
	SchedErr      string
}

var consoleJobStates = []jobs.State{jobs.Queued, jobs.Scheduled, jobs.Running, jobs.Waiting, jobs.Parked, jobs.Failed, jobs.Succeeded, jobs.Cancelled}

func (k *console) jobs(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	d := jobsData{Tenant: q.Get("tenant"), State: q.Get("state"), States: consoleJobStates, Scan: consoleJobScan}
	if d.Tenant == "" {
		d.Tenant = jobs.DefaultTenant
	}
	if err := etcdstore.ValidateTenant(d.Tenant); err != nil {
		k.fail(w, r, http.StatusBadRequest, fmt.Errorf("tenant: %w", err))
		return
	}
	if d.State != "" && !slices.Contains(consoleJobStates, jobs.State(d.State)) {
		k.fail(w, r, http.StatusBadRequest, fmt.Errorf("state %q: must be one of %v", d.State, consoleJobStates))
		return
	}
	t, _, err := k.clusters()
	if err != nil {
		k.failFor(w, r, err)
		return
	}
	ctx, cancel := k.ctx(r)
	defer cancel()
	js, scanned, err := listJobsScan(ctx, t.keys, d.Tenant, jobs.State(d.State), consolePageSize+1, consoleJobScan)
	if err != nil {
		k.failFor(w, r, err)
		return
	}
	d.Capped = scanned >= consoleJobScan && len(js) <= consolePageSize
	if len(js) > consolePageSize {
		js, d.More = js[:consolePageSize], true
	}
	// Parked jobs first: they wait for an operator, and in id order they
	// were buried among the others.
	slices.SortStableFunc(js, func(a, b *jobs.Job) int { return parkedFirst(a) - parkedFirst(b) })
	for _, j := range js {
		d.Jobs = append(d.Jobs, viewJob(j))
	}
	up, down := connected(t)
	infos, err := readSchedules(ctx, up, d.Tenant)
	if err != nil {
		down = append(down, err.Error())
	}
	d.SchedErr = strings.Join(down, "; ")
	d.Schedules = scheduleViews(infos, time.Now(), 3)
	k.render(w, r, http.StatusOK, "jobs", page{Title: "Jobs", Nav: "jobs", Data: d})
}

type jobData struct {
	J      jobView
	Retry  bool // the job can be retried (parked)
	Cancel bool // the job can be cancelled (queued, scheduled, parked)
}

func (k *console) job(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	if q.Get("tenant") == "" {
		q.Set("tenant", jobs.DefaultTenant)
	}
	ctx, cancel := k.ctx(r)
	defer cancel()
	_, key, rec, ok := k.record(ctx, w, r, q, "id")
	if !ok {
		return
	}
	j, err := jobs.FromRecord(rec, time.Now())
	if err != nil {
		k.failFor(w, r, err)
		return
	}
	d := jobData{J: viewJob(j), Retry: j.State == jobs.Parked}
	switch j.State {
	case jobs.Queued, jobs.Scheduled, jobs.Waiting, jobs.Parked:
		d.Cancel = true
	}
	k.render(w, r, http.StatusOK, "job", page{Title: "Job " + key.ID, Nav: "jobs", Data: d})
}

// --- Actions

type confirmData struct {
	Action, What, Tenant, ID, Warning string
	Back                              template.URL
}

// confirm asks before an action that cannot be undone.
func (k *console) confirm(w http.ResponseWriter, r *http.Request, action string) {
	q := r.URL.Query()
	d := confirmData{Action: action, Tenant: q.Get("tenant")}
	switch action {
	case "evict":
		key, err := keyOf(q, "key")
		if err != nil {
			k.fail(w, r, http.StatusBadRequest, err)
			return
		}
		d.Tenant, d.ID, d.What = key.Tenant, key.ID, "key"
		d.Back = template.URL("/console/key?" + url.Values{"tenant": {key.Tenant}, "key": {key.ID}}.Encode())
		d.Warning = "Its saved answer is forgotten: the next request with this key runs the work again, and a claim in flight loses its fence."
	case "cancel":
		if d.Tenant == "" {
			q.Set("tenant", jobs.DefaultTenant)
		}
		key, err := keyOf(q, "id")
		if err != nil {
			k.fail(w, r, http.StatusBadRequest, err)
			return
		}
		d.Tenant, d.ID, d.What = key.Tenant, key.ID, "job"
		d.Back = template.URL("/console/job?" + url.Values{"tenant": {key.Tenant}, "id": {key.ID}}.Encode())
		d.Warning = "Its remaining steps never run; its finished steps stay done (no compensation runs)."
	}
	k.render(w, r, http.StatusOK, "confirm", page{Title: "Confirm: " + action + " " + d.ID, Nav: map[string]string{"evict": "keys", "cancel": "jobs"}[action], Data: d})
}

// post runs an action: evict a key, retry or cancel a job. Each needs the
// page's CSRF token and a same-origin request, and is logged with who
// asked.
func (k *console) post(w http.ResponseWriter, r *http.Request) {
	if err := k.cop.Check(r); err != nil {
		k.s.log.Warn("console action refused: a cross-origin request", "path", r.URL.Path, "who", who(r), "remote", r.RemoteAddr,
			"origin", r.Header.Get("Origin"), "sec_fetch_site", r.Header.Get("Sec-Fetch-Site"))
		k.fail(w, r, http.StatusForbidden, fmt.Errorf("refused: %w", err))
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if err := r.ParseForm(); err != nil {
		k.fail(w, r, http.StatusBadRequest, err)
		return
	}
	if !k.validToken(r) {
		k.s.log.Warn("console action refused: no valid CSRF token", "path", r.URL.Path, "who", who(r), "remote", r.RemoteAddr)
		k.fail(w, r, http.StatusForbidden, errors.New("refused: the form's token is missing or stale; reload the page and try again"))
		return
	}
	action := strings.TrimPrefix(r.URL.Path, "/console/")
	f := r.PostForm
	if f.Get("tenant") == "" && action != "key/evict" {
		f.Set("tenant", jobs.DefaultTenant)
	}
	t, store, err := k.clusters()
	if err != nil {
		k.failFor(w, r, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 15*time.Second)
	defer cancel()
	var key etcdstore.Key
	var back string
	switch action {
	case "key/evict":
		if key, err = keyOf(f, "key"); err != nil {
			break
		}
		err = t.keys.Evict(ctx, key) // idem admin evict
		back = "/console/keys?" + k.doneQuery(url.Values{"tenant": {key.Tenant}}, "evicted "+key.Tenant+"/"+key.ID)
	case "job/signal":
		if key, err = keyOf(f, "id"); err != nil {
			break
		}
		event, payload := strings.TrimSpace(f.Get("event")), strings.TrimSpace(f.Get("payload"))
		if payload != "" && !json.Valid([]byte(payload)) {
			err = fmt.Errorf("%w: the payload is not JSON", jobs.ErrInvalid)
			break
		}
		var q *jobs.Queue
		if q, err = k.s.cfg.queue(store, key.Tenant); err != nil {
			break
		}
		err = q.Signal(ctx, key.ID, event, []byte(payload)) // idem jobs signal
		back = "/console/job?" + k.doneQuery(url.Values{"tenant": {key.Tenant}, "id": {key.ID}}, key.ID+" signalled "+event)
	case "job/retry", "job/cancel":
		if key, err = keyOf(f, "id"); err != nil {
			break
		}
		var q *jobs.Queue
		if q, err = k.s.cfg.queue(store, key.Tenant); err != nil {
			break
		}
		if action == "job/retry" {
			_, err = q.Retry(ctx, key.ID) // idem jobs retry
		} else {
			reason := strings.TrimSpace(f.Get("reason"))
			if reason == "" {
				reason = "cancelled by " + who(r) + " from the console"
			}
			_, err = q.Cancel(ctx, key.ID, reason) // idem jobs cancel
		}
		verb := map[string]string{"job/retry": "queued again", "job/cancel": "cancelled"}[action]
		back = "/console/job?" + k.doneQuery(url.Values{"tenant": {key.Tenant}, "id": {key.ID}}, key.ID+" "+verb)
	default:
		k.fail(w, r, http.StatusNotFound, fmt.Errorf("no action %q", action))
		return
	}
	args := []any{"action", action, "tenant", key.Tenant, "key", key.ID, "who", who(r), "remote", r.RemoteAddr}
	switch {
	case err != nil && outcomeUnknown(err):
		// It may have happened: say so, and never that it failed.
		k.s.log.Warn("console action outcome unknown", append(args, "err", err)...)
		k.fail(w, r, httpStatusOf(err), fmt.Errorf("%s %s/%s may have happened: %w. Look at it again before you repeat it", action, key.Tenant, key.ID, err))
		return
	case err != nil:
		k.s.log.Warn("console action refused", append(args, "err", err)...)
		k.failFor(w, r, fmt.Errorf("%s %s/%s was not done: %w", action, key.Tenant, key.ID, err))
		return
	}
	k.s.log.Info("console action", args...)
	http.Redirect(w, r, back, http.StatusSeeOther)
}

// token returns the page's CSRF token: a MAC of the browser's console
// cookie (set here when it has none) under the process's secret. A form
// posted from another site has neither the cookie (SameSite=Strict) nor the
// token; the cross-origin check refuses it before.
func (k *console) token(w http.ResponseWriter, r *http.Request) string {
	c, err := r.Cookie(consoleCookie)
	if err != nil || len(c.Value) != 64 {
		b := make([]byte, 32)
		rand.Read(b)
		c = &http.Cookie{Name: consoleCookie, Value: hex.EncodeToString(b), Path: "/console/", HttpOnly: true,
			SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil}
		http.SetCookie(w, c)
	}
	return k.mac(c.Value)
}

// doneQuery is the query of the page an action redirects to, with the message
// it shows and its MAC: a link written by someone else shows none.
func (k *console) doneQuery(v url.Values, msg string) string {
	v.Set("done", msg)
	v.Set("sig", k.mac("done\x00"+msg))
	return v.Encode()
}

// hostAllowed guards against DNS rebinding: a page of another site whose
// name comes to resolve to the admin listener is same-origin to the
// browser, so neither the CSRF token nor the cross-origin check stops it;
// its Host is its own name. Over plain HTTP, the console answers only to an
// IP address, localhost, or a name of --console-hosts. Over TLS the
// browser checks the certificate's names, which another site's name is
// not among.
func (k *console) hostAllowed(r *http.Request) bool {
	if r.TLS != nil {
		return true
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.Trim(host, "[]"), ".")
	if net.ParseIP(host) != nil || strings.EqualFold(host, "localhost") {
		return true
	}
	for _, h := range k.s.cfg.consoleHosts {
		if strings.EqualFold(h, host) {
			return true
		}
	}
	return false
}

func (k *console) mac(cookie string) string {
	m := hmac.New(sha256.New, k.secret)
	m.Write([]byte(cookie))
	return hex.EncodeToString(m.Sum(nil))
}

func (k *console) validToken(r *http.Request) bool {
	c, err := r.Cookie(consoleCookie)
	if err != nil || c.Value == "" {
		return false
	}
	got := r.PostForm.Get("csrf")
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(k.mac(c.Value))) == 1
}

// who names the person behind a request: the subject of the client
// certificate the admin listener verified, or "anonymous" without one.
func who(r *http.Request) string {
	if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 && len(r.TLS.VerifiedChains[0]) > 0 {
		cert := r.TLS.VerifiedChains[0][0]
		if cn := cert.Subject.CommonName; cn != "" {
			return cn
		}
		return cert.Subject.String()
	}
	return "anonymous"
}

func consoleWhen(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// consoleAgo writes a duration the way a person reads it: 3m20s, 4h10m, 2d3h.
func consoleAgo(d time.Duration) string {
	neg := d < 0
	if neg {
		d = -d
	}
	var s string
	switch {
	case d < time.Minute:
		s = strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		s = fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		s = fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		s = fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
	}
	if neg {
		return "-" + s
	}
	return s
}

// adminIndex lists the admin listener's pages, the console among them
// when it is on.
func (s *server) adminIndex(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "idem admin listener")
	fmt.Fprintln(w, "  /livez         the process runs")
	fmt.Fprintln(w, "  /readyz        idem can serve keyed requests")
	fmt.Fprintln(w, "  /metrics       Prometheus metrics")
	if s.cfg.pprof {
		fmt.Fprintln(w, "  /debug/pprof/  Go profiles")
	} else {
		fmt.Fprintln(w, "  /debug/pprof/  off (idem serve --pprof turns it on)")
	}
	if s.console != nil {
		fmt.Fprintln(w, "  /console/      the console: keys, jobs, schedules and the cluster")
	} else {
		fmt.Fprintln(w, "  /console/      off (idem serve --console turns it on)")
	}
}

// parkedFirst orders the jobs list: parked ones (waiting for an operator)
// before the others.
func parkedFirst(j *jobs.Job) int {
	if j.State == jobs.Parked {
		return 0
	}
	return 1
}
