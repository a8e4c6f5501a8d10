package cluster_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/etcdtest"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/storex"
	"github.com/idem-dev/idem/jobs"
)

// Jobs across three data centres: a three-member cluster whose members are
// 50 ms apart, in each data centre a scheduler (in this process) and a
// worker (a real process), submitted jobs and a schedule's occurrences
// running all along, every step acting at a fenced sink that applies it once
// per step key. The faults: a worker killed mid-step, a worker paused
// (SIGSTOP) mid-step past its session's TTL, and a data centre cut off
// (its member isolated, its worker's link to the sink held, as TCP holds
// what it cannot deliver) for longer than the TTL.
//
// Each data centre is a zone (jobs.WithZone): a job prefers a worker of
// the data centre that submitted it. Orders run under a per-merchant limit
// of one at a time (jobs.Limit), all through the faults. Before them, a
// refund naps durably (Run.Sleep) across the kill of the worker that
// started its nap, then awaits its approval (Run.Await), signalled twice
// at once from two other data centres.
//
// At the end: every job and every occurrence finished; each step applied
// once at the sink, and its etcd effect written once; no finished step ran
// again under a later claim (each takeover resumed at the first unfinished
// step); the late calls of the paused worker and of the cut-off data
// centre were refused by the sink's fencing; every write that finished an
// order's step held one of its merchant's slots (from etcd's history); the
// refund woke no earlier than its nap asked and got the approval once.
// Figures logged: step runs, the workers' Txns per step run against the
// least an uninterrupted run sends, the share of step runs in the data
// centre that submitted their job, and the most slots a merchant held.
func TestJobsAcrossThreeDataCentres(t *testing.T) {
	if testing.Short() {
		t.Skip("fault scenarios skipped in -short mode")
	}
	start := time.Now()
	c, err := etcdtest.New(t.TempDir(), 3, etcdtest.Options{Proxies: true, TickMs: 100, ElectionMs: 1000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	for _, m := range c.Members {
		m.PeerProxy.Delay(25*time.Millisecond, 2*time.Millisecond) // 50 ms between data centres
	}
	prefix := fmt.Sprintf("/idem-jobs-%d/", time.Now().UnixNano())
	admin := c.MustClient(t) // the test's own view, on every member directly
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rev0, err := admin.Get(ctx, "/none")
	if err != nil {
		t.Fatal(err)
	}
	hist := admin.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev0.Header.Revision+1))

	sk := newStepSink(t)
	var sinkLinks []*etcdtest.Proxy
	dcs := []string{"dc0", "dc1", "dc2"}
	for range dcs {
		p, err := etcdtest.NewProxy(strings.TrimPrefix(sk.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		sinkLinks = append(sinkLinks, p)
	}
	env := func(i int) []string {
		return []string{"IDEM_CLUSTER_JOBWORKER=1", "JOBS_DC=" + dcs[i], "JOBS_ENDPOINTS=" + c.Members[i].ClientProxy.URL(),
			"JOBS_PREFIX=" + prefix, "JOBS_SINK=" + sinkLinks[i].URL()}
	}
	steps := make(chan stepLine, 4096) // every step any worker starts
	workers := make([]*jobWorker, 3)
	for i := range workers {
		workers[i] = startJobWorker(t, i, env(i), steps)
	}
	// nextStep returns the next step a worker starts from now on. The
	// faults hit whichever worker is busy: the workers of the leader's data
	// centre win most races for a job (their claims commit a round trip
	// sooner), so the others may be idle.
	nextStep := func() stepLine {
		t.Helper()
		for drained := false; !drained; {
			select {
			case <-steps:
			default:
				drained = true
			}
		}
		select {
		case s := <-steps:
			return s
		case <-time.After(60 * time.Second):
			t.Fatal("no worker started a step for a minute")
			return stepLine{}
		}
	}

	// A queue and a scheduler per data centre, each on its own member.
	var queues []*jobs.Queue
	var scheds []*jobs.Scheduler
	schedule := jobs.Schedule{Name: "reconcile", Every: time.Second, Kind: "report", CatchUp: jobs.CatchUpAll, MaxCatchUp: 100}
	for i := range dcs {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{c.Members[i].ClientProxy.URL()}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cli.Close() })
		st, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(sessionTTL), etcdstore.WithRequestTimeout(requestTimeout))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		q, err := jobs.New(st, jobs.WithZone(dcs[i]))
		if err != nil {
			t.Fatal(err)
		}
		queues = append(queues, q)
		s, err := jobs.NewScheduler(q, []jobs.Schedule{schedule})
		if err != nil {
			t.Fatal(err)
		}
		scheds = append(scheds, s)
	}
	closeScheds := sync.OnceFunc(func() {
		for _, s := range scheds {
			s.Close()
		}
	})
	t.Cleanup(closeScheds)

	// Orders are submitted all along, each through some data centre,
	// retried (through the next one) until it is in.
	const orders, merchants = 80, 8
	submitted := make(chan struct{})
	go func() {
		defer close(submitted)
		for n := 0; n < orders && ctx.Err() == nil; n++ {
			id := fmt.Sprintf("order-%03d", n)
			for try := 0; ctx.Err() == nil; try++ {
				sctx, scancel := context.WithTimeout(ctx, 3*time.Second)
				_, err := queues[(n+try)%3].Submit(sctx, id, "order", []byte(fmt.Sprintf(`{"order":%d,"merchant":"m%d"}`, n, n%merchants)))
				scancel()
				if err == nil {
					break
				}
			}
			time.Sleep(200 * time.Millisecond) // the arrival rate of orders, not synchronisation
		}
	}()
	// waitDone waits until job id succeeded, seen from data centre i.
	waitDone := func(i int, id string) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, 90*time.Second)
		defer wcancel()
		j, err := queues[i].Wait(wctx, id)
		if err != nil || j.State != jobs.Succeeded {
			t.Fatalf("job %s (seen from %s): %+v, %v\nthe workers' completers:\n%s", id, dcs[i], j, err, explain(id))
		}
	}
	// ownerGone waits until a worker's session is gone, seen from member i
	// (one that is not cut off: a watch on a member that is would wait for
	// the cut to heal).
	memberClients := make([]*clientv3.Client, 3)
	for i, m := range c.Members {
		memberClients[i] = c.MustClient(t, m.ClientURL)
	}
	ownerGone := func(i int, owner string) {
		t.Helper()
		key := prefix + "o/" + owner
		admin := memberClients[i]
		resp, err := admin.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return
		}
		for wr := range admin.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1)) {
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					return
				}
			}
		}
		t.Fatalf("the session of %s did not end", owner)
	}

	// 0. A refund naps across a worker kill, then waits for its approval,
	// which is sent twice, from two data centres at once (a retried
	// signal).
	if _, err := queues[0].Submit(ctx, "refund-1", "refund", []byte(`"42 EUR"`)); err != nil {
		t.Fatal(err)
	}
	waitState := func(id string, ok func(*jobs.Job) bool) *jobs.Job {
		t.Helper()
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) { // polls a state
			if j, err := queues[0].Get(ctx, id); err == nil && ok(j) {
				return j
			}
		}
		j, err := queues[0].Get(ctx, id)
		t.Fatalf("%s never reached the state waited for: %+v %v\nthe workers' completers:\n%s", id, j, err, explain(id))
		return nil
	}
	waitState("refund-1", func(j *jobs.Job) bool { return j.State == jobs.Scheduled }) // asleep: its wake-up time saved
	napper := firstLine("refund-1", "nap")
	workers[napper.dc].cmd.Process.Kill()
	workers[napper.dc].cmd.Wait()
	workers[napper.dc] = startJobWorker(t, napper.dc, env(napper.dc), steps)
	waitState("refund-1", func(j *jobs.Job) bool { return j.State == jobs.Waiting && j.Awaiting == "approved" })
	var signals sync.WaitGroup
	sigErrs := make([]error, 2)
	for i, from := range []int{1, 2} {
		signals.Go(func() { sigErrs[i] = queues[from].Signal(ctx, "refund-1", "approved", []byte(`"ada"`)) })
	}
	signals.Wait()
	if sigErrs[0] != nil || sigErrs[1] != nil {
		t.Fatalf("the approval, sent from %s and %s: %v", dcs[1], dcs[2], sigErrs)
	}
	waitDone(0, "refund-1")
	if j, _ := queues[0].Get(ctx, "refund-1"); string(j.Output("approval")) != `"ada"` {
		t.Fatalf("refund-1's approval step returned %q; want the event's payload", j.Output("approval"))
	}
	t.Logf("a refund napped %v across the kill of %s's worker, then got its approval, sent from %s and %s at once, once",
		napFor, dcs[napper.dc], dcs[1], dcs[2])

	// 1. A worker is killed mid-step; it restarts at once, as a supervisor
	// would restart it. The job is resumed by whichever worker claims it
	// once the dead one's session expires.
	killed := nextStep()
	workers[killed.dc].cmd.Process.Kill()
	workers[killed.dc].cmd.Wait()
	workers[killed.dc] = startJobWorker(t, killed.dc, env(killed.dc), steps)
	waitDone((killed.dc+1)%3, killed.job)
	t.Logf("killed %s's worker in %s/%s (token %d): resumed", dcs[killed.dc], killed.job, killed.step, killed.token)

	// 2. A worker is paused mid-step past its session's TTL, until its job
	// was taken over and finished elsewhere; then it wakes up and carries on
	// with its step, late.
	paused := nextStep()
	pw := workers[paused.dc]
	pw.cmd.Process.Signal(syscall.SIGSTOP)
	ownerGone((paused.dc+1)%3, pw.owner)
	waitDone((paused.dc+1)%3, paused.job)
	pw.cmd.Process.Signal(syscall.SIGCONT)
	t.Logf("paused %s's worker in %s/%s (token %d) past its lease: resumed elsewhere", dcs[paused.dc], paused.job, paused.step, paused.token)

	// 3. A data centre is cut off while its worker is mid-step: its member
	// from the others, its worker's calls to the sink held until the cut
	// heals; longer than the TTL, until its job was finished elsewhere.
	cut := nextStep()
	leader := c.Leader()
	if err := c.Isolate(cut.dc); err != nil {
		t.Fatal(err)
	}
	sinkLinks[cut.dc].Hold()
	if err := c.WaitIsolated(ctx, cut.dc); err != nil {
		t.Fatal(err)
	}
	cutAt := time.Now()
	ownerGone((cut.dc+1)%3, workers[cut.dc].owner)
	waitDone((cut.dc+1)%3, cut.job)
	c.Heal()
	sinkLinks[cut.dc].Heal()
	if _, err := c.WaitLeader(ctx, c.All()); err != nil {
		t.Fatal(err)
	}
	t.Logf("cut %s off (the leader's data centre: %v) in %s/%s (token %d) for %v: resumed elsewhere",
		dcs[cut.dc], leader == cut.dc, cut.job, cut.step, cut.token, time.Since(cutAt).Round(time.Millisecond))

	<-submitted
	// The schedulers run a few more occurrences after the faults.
	schedAdmin, err := etcdstore.NewAdmin(admin, etcdstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	cursor := func() time.Time {
		infos, err := jobs.Schedules(ctx, schedAdmin, "")
		if err != nil || len(infos) != 1 {
			t.Fatalf("schedules: %v, %v", infos, err)
		}
		return infos[0].Last
	}
	until := cursor().Add(3 * time.Second)
	ckey := prefix + "j/s/" + jobs.DefaultTenant + "/" + schedule.Name
	for wr := range admin.Watch(ctx, ckey) {
		if wr.Err() != nil {
			t.Fatal(wr.Err())
		}
		if !cursor().Before(until) {
			break
		}
	}
	closeScheds()

	// Every job ends.
	recs, err := queues[0].List(ctx, jobs.ListOptions{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var ids, occurrences []string
	for _, j := range recs {
		ids = append(ids, j.Key.ID)
		if strings.HasPrefix(j.Key.ID, schedule.Name+"@") {
			occurrences = append(occurrences, j.Key.ID)
		}
	}
	for _, id := range ids {
		waitDone(0, id)
	}
	// The occurrences have no gap: each second from the first to the last.
	sort.Strings(occurrences)
	first, _ := time.Parse("2006-01-02T15:04:05Z", strings.TrimPrefix(occurrences[0], schedule.Name+"@"))
	for i, id := range occurrences {
		if want := jobs.OccurrenceID(schedule.Name, first.Add(time.Duration(i)*time.Second)); id != want {
			t.Fatalf("occurrence %d is %s; want %s: a second was skipped or doubled", i, id, want)
		}
	}
	if len(ids)-len(occurrences)-1 != orders {
		t.Fatalf("%d orders in the queue; want %d", len(ids)-len(occurrences)-1, orders)
	}

	// The history of every job record, up to a sentinel.
	end := prefix + "zz-end"
	if _, err := admin.Put(ctx, end, ""); err != nil {
		t.Fatal(err)
	}
	versions := map[string][]*etcdstore.Record{}
	type slotEv struct {
		rev      int64
		name     string
		job      string // "" : freed
		token    int64
		merchant string
	}
	var slotEvs []slotEv
	slotPrefix := prefix + "j/l/" + jobs.DefaultTenant + "/merchant/"
	dec, err := etcdstore.NewAdmin(admin, etcdstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	tenant := prefix + "k/" + jobs.DefaultTenant + "/"
history:
	for wr := range hist {
		if wr.Err() != nil {
			t.Fatal(wr.Err())
		}
		for _, ev := range wr.Events {
			k := string(ev.Kv.Key)
			if k == end {
				break history
			}
			if rest, ok := strings.CutPrefix(k, slotPrefix); ok {
				merchant, _, _ := strings.Cut(rest, "/")
				se := slotEv{rev: ev.Kv.ModRevision, name: rest, merchant: merchant}
				if ev.Type == mvccpb.PUT {
					var h struct {
						Job   string `json:"job"`
						Token int64  `json:"token"`
					}
					if err := json.Unmarshal(ev.Kv.Value, &h); err != nil {
						t.Fatalf("slot %s: %v", rest, err)
					}
					se.job, se.token = h.Job, h.Token
				}
				slotEvs = append(slotEvs, se)
				continue
			}
			if !strings.HasPrefix(k, tenant) || ev.Type != mvccpb.PUT {
				continue
			}
			rec, err := storex.DecodeRecord(dec, ev.Kv)
			if err != nil {
				t.Fatal(err)
			}
			versions[rec.Key.ID] = append(versions[rec.Key.ID], rec)
		}
	}

	// Each step applied once; no finished step ran again under a later
	// claim; the late calls were refused.
	calls := sk.snapshot()
	var takeovers, reruns, nsteps int
	for _, id := range ids {
		finishedBy := map[string]fencing.Token{}
		claims := map[fencing.Token]bool{}
		for _, rec := range versions[id] {
			claims[rec.Token] = true
			j, err := jobs.FromRecord(rec, time.Now())
			if err != nil {
				t.Fatalf("%s at revision %d: %v", id, rec.Revision, err)
			}
			for _, s := range j.Steps {
				if _, ok := finishedBy[s.Name]; s.Finished && !ok {
					finishedBy[s.Name] = s.Token
				}
			}
		}
		takeovers += len(claims) - 2 // the enqueue, and the first attempt's claim
		kind := "order"
		switch {
		case strings.HasPrefix(id, schedule.Name+"@"):
			kind = "report"
		case strings.HasPrefix(id, "refund-"):
			kind = "refund"
		}
		for _, step := range stepNames(kind) {
			nsteps++
			by, ok := finishedBy[step]
			if !ok {
				t.Errorf("%s: step %s never finished", id, step)
				continue
			}
			if step == "nap" || step == "approval" {
				continue // no call to the sink
			}
			cs := calls["jobs:"+id+"."+step]
			applied := 0
			for _, cl := range cs {
				if cl.result == "applied" {
					applied++
				}
				if cl.token > by {
					t.Errorf("%s: step %s ran again under token %d (%s) after token %d finished it", id, step, cl.token, cl.dc, by)
				}
			}
			if applied != 1 {
				t.Errorf("%s: step %s applied %d times at the sink: %+v", id, step, applied, cs)
			}
			if len(cs) > 1 {
				reruns++
			}
		}
		if kind == "order" {
			resp, err := admin.Get(ctx, "/jobs-effects"+prefix+id)
			if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Version != 1 {
				t.Errorf("%s: the ship step's etcd effect: %v, %v; want written once", id, resp, err)
			}
		}
	}
	lateRefused := map[string]int{}
	for _, cs := range calls {
		for _, cl := range cs {
			if cl.result == "fenced" {
				lateRefused[cl.dc]++
			}
		}
	}
	if lateRefused[dcs[paused.dc]] == 0 {
		t.Errorf("INVALID: no late call of the paused worker (%s) reached the sink: %v", dcs[paused.dc], lateRefused)
	}
	if lateRefused[dcs[cut.dc]] == 0 {
		t.Errorf("INVALID: no late call of the cut-off data centre (%s) reached the sink: %v", dcs[cut.dc], lateRefused)
	}
	if takeovers < 3 {
		t.Errorf("INVALID: %d takeovers; the three faults should each have caused one", takeovers)
	}
	// The limit: every write that finished a step of an order found one of
	// its merchant's slots holding the order and the token of the claim
	// that wrote it; and how many slots a merchant ever held at once.
	heldAt := func(merchant string, rev int64) map[string]slotEv {
		held := map[string]slotEv{}
		for _, se := range slotEvs {
			if se.rev > rev {
				break
			}
			if se.merchant != merchant {
				continue
			}
			if se.job == "" {
				delete(held, se.name)
			} else {
				held[se.name] = se
			}
		}
		return held
	}
	for _, id := range ids {
		if !strings.HasPrefix(id, "order-") {
			continue
		}
		n, _ := strconv.Atoi(strings.TrimPrefix(id, "order-"))
		merchant := fmt.Sprintf("m%d", n%merchants)
		finished := map[string]bool{}
		for _, rec := range versions[id] {
			j, _ := jobs.FromRecord(rec, time.Now())
			for _, s := range j.Steps {
				if !s.Finished || finished[s.Name] {
					continue
				}
				finished[s.Name] = true
				if s.Token != rec.Token {
					continue
				}
				ok := false
				for _, se := range heldAt(merchant, rec.Revision) {
					ok = ok || se.job == id && se.token == int64(s.Token)
				}
				if !ok {
					t.Errorf("%s finished %s at revision %d under token %d without a slot of merchant %s", id, s.Name, rec.Revision, s.Token, merchant)
				}
			}
		}
	}
	highWater := 0
	held := map[string]map[string]bool{}
	for _, se := range slotEvs {
		if held[se.merchant] == nil {
			held[se.merchant] = map[string]bool{}
		}
		if se.job == "" {
			delete(held[se.merchant], se.name)
		} else {
			held[se.merchant][se.name] = true
		}
		highWater = max(highWater, len(held[se.merchant]))
	}
	if highWater != 1 {
		t.Errorf("a merchant held %d slots at once; the limit is 1 (and every merchant reached it)", highWater)
	}
	// The refund slept no less than it asked, across the kill.
	workerLog.mu.Lock()
	lines := slices.Clone(workerLog.lines)
	var txns int64
	for _, w := range workerLog.workers {
		txns += w.txns.Load()
	}
	workerLog.mu.Unlock()
	var naps []time.Time
	for _, l := range lines {
		if l.job == "refund-1" && l.step == "nap" && !l.done {
			naps = append(naps, l.at)
		}
	}
	if len(naps) < 2 || naps[len(naps)-1].Sub(naps[0]) < napFor {
		t.Errorf("refund-1's nap started at %v: it woke before its %v were over", naps, napFor)
	}
	// Where the steps ran, against the data centre that submitted their
	// job; and what they cost in Txns, against the least an uninterrupted
	// run would send (a claim, a write per step, the last step's ops in a
	// checkpoint of their own, and an order's slot taken and freed).
	zoneOf := map[string]string{}
	var least int
	for _, j := range recs {
		zoneOf[j.Key.ID] = j.Zone
		switch {
		case strings.HasPrefix(j.Key.ID, "order-"):
			least += 1 + 3 + 1 + 2
		case strings.HasPrefix(j.Key.ID, schedule.Name+"@"):
			least += 1 + 2
		default:
			least += 1 + 3 + 4 // a refund: claim, nap checkpoint, given back and claimed again, the approval saved
		}
	}
	runs, inZone := 0, 0
	perDC := map[string]int{}
	for _, l := range lines {
		if l.done {
			continue
		}
		runs++
		perDC[dcs[l.dc]]++
		if zoneOf[l.job] == dcs[l.dc] {
			inZone++
		}
	}
	t.Logf("figures: %d step runs (%d steps); %d Txns from the workers, %.2f per step run (least: %.2f); %.0f%% of step runs in the data centre that submitted the job, by data centre %v; a merchant's slots held at once at most %d (limit 1)",
		runs, nsteps, txns, float64(txns)/float64(runs), float64(least)/float64(nsteps), 100*float64(inZone)/float64(runs), perDC, highWater)
	t.Logf("%d orders and %d occurrences, %d steps: all finished, each step applied once; %d takeovers, %d steps called more than once (unfinished when their worker stopped), late calls refused by fencing %v; %v",
		orders, len(occurrences), nsteps, takeovers, reruns, lateRefused, time.Since(start).Round(time.Second))
}

// stepNames are the steps of a kind of the scenario.
func stepNames(kind string) []string {
	switch kind {
	case "report":
		return []string{"gather", "send"}
	case "refund":
		return []string{"nap", "approval", "pay"}
	}
	return []string{"reserve", "charge", "ship"}
}

// napFor is how long a refund sleeps before it waits for its approval.
const napFor = 3 * time.Second

// firstLine returns the first start of step of job any worker printed.
func firstLine(job, step string) workerLine {
	workerLog.mu.Lock()
	defer workerLog.mu.Unlock()
	for _, l := range workerLog.lines {
		if l.job == job && l.step == step && !l.done {
			return l
		}
	}
	return workerLine{dc: -1}
}

// runJobWorker is a data centre's worker process: it runs the scenario's
// kinds with a completer until its stdin closes.
func runJobWorker() int {
	ctx := context.Background()
	dc, sinkURL, prefix := os.Getenv("JOBS_DC"), os.Getenv("JOBS_SINK"), os.Getenv("JOBS_PREFIX")
	// Every Txn this worker sends (a batch of the group commit counts
	// once: one round trip), reported every 200 ms.
	var txns atomic.Int64
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if method == "/etcdserverpb.KV/Txn" {
			txns.Add(1)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{os.Getenv("JOBS_ENDPOINTS")}, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(count)}})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer cli.Close()
	store, err := etcdstore.New(ctx, cli, etcdstore.WithPrefix(prefix), etcdstore.WithSessionTTL(sessionTTL), etcdstore.WithRequestTimeout(requestTimeout))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer store.Close()
	q, err := jobs.New(store, jobs.WithLogger(storeLogger()), jobs.WithZone(dc))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	var out sync.Mutex
	say := func(format string, args ...any) {
		out.Lock()
		defer out.Unlock()
		fmt.Printf(format+"\n", args...)
	}
	go func() {
		for range time.Tick(200 * time.Millisecond) {
			say("txns %d", txns.Load())
		}
	}()
	step := func(name string) jobs.Step {
		return jobs.Step{Name: name, Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			say("step %s %s %d", r.Key().ID, name, r.Token())
			defer say("done %s %s %d", r.Key().ID, name, r.Token())
			time.Sleep(time.Duration(100+rand.IntN(300)) * time.Millisecond) // the step's work, not synchronisation
			if name == "ship" {
				r.Commit(clientv3.OpPut("/jobs-effects"+prefix+r.Key().ID, strconv.FormatInt(int64(r.Token()), 10)))
			}
			// A worker that does not notice it lost its claim: the call
			// goes out whatever happened meanwhile, and fencing refuses it.
			return nil, callSink(context.WithoutCancel(ctx), sinkURL, dc, r)
		}}
	}
	// A refund waits durably: a nap, then an approval (an event), then the
	// payment.
	refund := []jobs.Step{
		{Name: "nap", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			say("step %s nap %d", r.Key().ID, r.Token())
			return nil, r.Sleep(napFor)
		}},
		{Name: "approval", Run: func(ctx context.Context, r *jobs.Run) ([]byte, error) {
			say("step %s approval %d", r.Key().ID, r.Token())
			return r.Await("approved", 2*time.Minute)
		}},
		step("pay"),
	}
	kinds := []jobs.Kind{
		{Name: "order", MaxAttempts: 20, Backoff: 100 * time.Millisecond, Steps: []jobs.Step{step("reserve"), step("charge"), step("ship")},
			Limits: []jobs.Limit{{Name: "merchant", Key: jobs.ParamKey("merchant"), Concurrency: 1}}},
		{Name: "report", MaxAttempts: 20, Backoff: 100 * time.Millisecond, Steps: []jobs.Step{step("gather"), step("send")}},
		{Name: "refund", MaxAttempts: 20, Backoff: 100 * time.Millisecond, Steps: refund},
	}
	// Four jobs at once: with two, the workers ran near saturation (the
	// steps' work and the 3-DC round trips kept 5.4 of the 6 slots busy on
	// an idle machine), and on a loaded one the refund waited a minute
	// behind the occurrences due before it (the completers' Explain: no
	// slot free on any worker, the refund queued).
	w, err := jobs.NewWorker(q, kinds, jobs.Concurrency(4))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("ready", store.Owner())
	// Until stdin closes: "explain ID" asks what the completer knows of a
	// job (the test asks when a job does not run).
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if id, ok := strings.CutPrefix(in.Text(), "explain "); ok {
			say("explain %s %s", id, strconv.Quote(w.Explain(id)))
		}
	}
	w.Close()
	return 0
}

func callSink(ctx context.Context, sinkURL, dc string, r *jobs.Run) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", sinkURL+"/effect?dc="+dc, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Idempotency-Key", r.StepKey())
	req.Header.Set("X-Job", r.Key().ID)
	fencing.SetHeader(req.Header, r.Token())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("sink: %s", resp.Status)
	}
	return nil
}

// stepSink is the downstream of every step: it applies a step once per
// step key (a repeat is answered as done), and refuses a token lower than
// the highest it has seen for the job.
type stepSink struct {
	*httptest.Server
	mu    sync.Mutex
	fence fencing.Checker
	done  map[string]bool
	calls map[string][]sinkCall
}

type sinkCall struct {
	dc     string
	token  fencing.Token
	result string // applied, repeat, fenced
}

func newStepSink(t *testing.T) *stepSink {
	s := &stepSink{done: map[string]bool{}, calls: map[string][]sinkCall{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, _, err := fencing.FromHeader(r.Header)
		if err != nil || tok == 0 {
			http.Error(w, "a step needs a fencing token", http.StatusBadRequest)
			return
		}
		key, job := r.Header.Get("Idempotency-Key"), r.Header.Get("X-Job")
		s.mu.Lock()
		defer s.mu.Unlock()
		call := sinkCall{dc: r.URL.Query().Get("dc"), token: tok}
		switch {
		case s.fence.Check(job, tok) != nil:
			call.result = "fenced"
			w.WriteHeader(http.StatusConflict)
		case s.done[key]:
			call.result = "repeat"
		default:
			call.result = "applied"
			s.done[key] = true
		}
		s.calls[key] = append(s.calls[key], call)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *stepSink) snapshot() map[string][]sinkCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string][]sinkCall, len(s.calls))
	for k, v := range s.calls {
		out[k] = append([]sinkCall(nil), v...)
	}
	return out
}

// jobWorker is a running worker process.
type jobWorker struct {
	cmd       *exec.Cmd
	owner     string
	txns      atomic.Int64 // the Txns it last said it sent
	dc        int
	stdin     io.WriteCloser
	explained chan string // its answers to "explain ID"
}

// explain asks every worker still running what its completer knows of job
// id: said when a job does not run, to tell why.
func explain(id string) string {
	workerLog.mu.Lock()
	ws := slices.Clone(workerLog.workers)
	workerLog.mu.Unlock()
	var out []string
	for _, w := range ws {
		if w.cmd.ProcessState != nil {
			continue // exited
		}
		if _, err := fmt.Fprintf(w.stdin, "explain %s\n", id); err != nil {
			continue
		}
		select {
		case a := <-w.explained:
			out = append(out, fmt.Sprintf("worker of dc%d (%s): %s", w.dc, w.owner, a))
		case <-time.After(5 * time.Second):
			out = append(out, fmt.Sprintf("worker of dc%d (%s): no answer (stopped?)", w.dc, w.owner))
		}
	}
	return strings.Join(out, "\n")
}

// workerLog is every step start and end the workers printed, as the test
// received them, and every worker process started.
var workerLog struct {
	mu      sync.Mutex
	lines   []workerLine
	workers []*jobWorker
}

type workerLine struct {
	at        time.Time
	dc        int
	done      bool // the step's end (else its start)
	job, step string
	token     int64
}

// stepLine is a step a worker started.
type stepLine struct {
	dc        int
	job, step string
	token     int64
}

// startJobWorker starts data centre dc's worker process, which reports the
// steps it starts on steps.
func startJobWorker(t *testing.T, dc int, env []string, steps chan<- stepLine) *jobWorker {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &jobWorker{cmd: cmd, dc: dc, stdin: stdin, explained: make(chan string, 1)}
	workerLog.mu.Lock()
	workerLog.workers = append(workerLog.workers, w)
	workerLog.mu.Unlock()
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			switch {
			case len(f) == 2 && f[0] == "ready":
				ready <- f[1]
			case len(f) >= 3 && f[0] == "explain":
				if a, err := strconv.Unquote(strings.TrimPrefix(sc.Text(), "explain "+f[1]+" ")); err == nil {
					select {
					case w.explained <- a:
					default:
					}
				}
			case len(f) == 2 && f[0] == "txns":
				n, _ := strconv.ParseInt(f[1], 10, 64)
				w.txns.Store(n)
			case len(f) == 4 && (f[0] == "step" || f[0] == "done"):
				tok, _ := strconv.ParseInt(f[3], 10, 64)
				workerLog.mu.Lock()
				workerLog.lines = append(workerLog.lines, workerLine{time.Now(), dc, f[0] == "done", f[1], f[2], tok})
				workerLog.mu.Unlock()
				if f[0] == "done" {
					continue
				}
				select {
				case steps <- stepLine{dc, f[1], f[2], tok}:
				default: // nobody is waiting for old steps
				}
			}
		}
		close(ready)
	}()
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Signal(syscall.SIGCONT)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	select {
	case owner, ok := <-ready:
		if !ok {
			t.Fatal("the worker exited before it was ready")
		}
		w.owner = owner
	case <-time.After(60 * time.Second):
		t.Fatal("the worker did not start")
	}
	return w
}
