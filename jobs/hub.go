package jobs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"
)

// Hub runs the declared kinds of a queue's tenant (Queue.Declare) for
// workers in other processes and languages: the worker API's
// /v1/work routes are its clients. It is a Worker like any other: the
// same engine claims each job, counts its attempts, applies its kind's
// limits, retries, backoff and parking, saves each step's recovery point
// fenced by the claim's token, and ends it. Only a worker step's Run is
// different: it hands the step to a remote worker as a Task and waits for
// what that worker reports (Hub.Report): its output, its failure, or a
// sleep or await, which the step's Run makes as a Go step would
// (Run.Sleep, Run.Await).
//
// A Hub claims a job only while a worker of its kind waits for one
// (Hub.Next) that no other starting attempt counts on; that worker gets
// the attempt's first step (a worker of several kinds is counted on once).
// Any process's hub takes a report: one that did not hand the task out
// relays it through etcd to the one that did (relay.go). A worker that stays silent in a step for its kind's task timeout
// counts as dead: its attempt ends as a crashed Go worker's does, and the
// job is resumed from its last recovery point. A report whose reply was
// lost, sent again with the same sequence number, is answered as before
// and applied once.
type Hub struct {
	id    string // names its tasks: a report another process gets is relayed here
	q     *Queue
	conc  int
	drain time.Duration

	mu      sync.Mutex
	w       *Worker
	decls   map[string]Declaration // the kinds w runs
	loaded  time.Time              // when decls were last read
	closed  bool
	resv    map[string]*poll // the waiting worker each starting attempt counts on, by job
	held    map[string]int   // attempts running, by kind
	busy    map[string]int   // of those, the ones whose step a worker runs now
	polls   []*poll          // waiting, oldest first
	pending []*task          // offered, not taken yet
	tasks   map[string]*task // open, by id
	retired map[string]*task // ended, kept a while to answer retries

	old       []*Worker          // replaced by newer declarations, ending their running attempts (h.mu)
	answering sync.WaitGroup     // relayed reports being answered
	stop      context.CancelFunc // ends serveRelays
	relays    chan struct{}      // closed when serveRelays has returned
}

// Task is a step handed to a remote worker.
type Task struct {
	ID           string            `json:"task"`
	Job          string            `json:"job"`
	Kind         string            `json:"kind"`
	Step         string            `json:"step"`
	Attempt      int               `json:"attempt"`
	Token        string            `json:"token"`
	StepKey      string            `json:"step_key"`
	Compensating bool              `json:"compensating,omitempty"`
	Params       []byte            `json:"-"`
	Outputs      map[string][]byte `json:"-"`
	// Timeout: a worker silent this long counts as dead.
	Timeout time.Duration `json:"-"`
}

// Report is what a worker says of its task: Op "sleep" (For or Until),
// "await" (Event, For as its timeout), "done" (Output), "fail" (Error) or
// "renew". Seq numbers a task's reports from 1 (renewals excepted): a
// report sent again with the same Seq is answered as the first time.
type Report struct {
	Seq    int
	Op     string
	For    time.Duration
	Until  time.Time
	Event  string
	Output []byte
	Error  string
}

// Answer is the hub's reply to a report. Result: "continue" (a sleep that
// is over: go on with the step), "suspended" (the job waits: stop the
// step; it runs again from its start when the wait is over), "event" (an
// await's Payload), "timeout" (an await's event did not come), "accepted"
// (a done or fail, handed to the engine), "renewed".
type Answer struct {
	Result  string `json:"result"`
	Payload []byte `json:"-"`
	Error   string `json:"error,omitempty"` // a "failed" answer's: the step was not let go on
}

// ErrTaskGone is returned by Hub.Report for a task that is not open: its
// attempt ended (the worker was silent past its timeout, the claim was
// lost, the job was given back), or this process restarted. The worker
// stops the step; the job resumes from its last recovery point.
var ErrTaskGone = errors.New("task gone")

// errWorkerLost ends an attempt whose remote worker stayed silent past
// its task's timeout: as a crashed worker's, counted when the job is
// claimed again, not as a failure of its step.
var errWorkerLost = errors.New("the worker running the step stopped answering")

// errNoTaker gives a job back uncounted: no worker took its step.
var errNoTaker = errors.New("no worker took the step")

type poll struct {
	kinds    []string
	got      chan *task // receives the task handed to it (buffered)
	resv     string     // the job whose attempt counts on it (gate), or ""
	resvKind string
}

type task struct {
	Task
	msgs    chan msg      // reports, to the step's Run
	taken   chan struct{} // closed when a worker takes it
	took    bool          // taken (h.mu)
	renewed time.Time
	gone    chan struct{}   // closed when its step's run ends
	answers map[int]*answer // by Seq
	last    int
	ended   bool
	endedAt time.Time
}

// answer is a report's answer, once done is closed.
type answer struct {
	done chan struct{}
	a    Answer
	err  error
}

type msg struct {
	r     Report
	reply chan Answer
}

// HubOption configures a Hub.
type HubOption func(*Hub) error

// HubConcurrency sets how many jobs the hub runs at once (default 64).
func HubConcurrency(n int) HubOption {
	return func(h *Hub) error {
		if n < 1 {
			return fmt.Errorf("%w: hub concurrency %d is under 1", ErrInvalid, n)
		}
		h.conc = n
		return nil
	}
}

// HubDrainTimeout sets how long Close lets running steps go on before it
// gives their jobs back (default 30 s, as a Worker's DrainTimeout).
func HubDrainTimeout(d time.Duration) HubOption {
	return func(h *Hub) error {
		if d < 0 {
			return fmt.Errorf("%w: drain timeout %v is negative", ErrInvalid, d)
		}
		h.drain = d
		return nil
	}
}

// NewHub returns a hub for q's declared kinds. It claims nothing until a
// worker asks (Next).
func NewHub(q *Queue, opts ...HubOption) (*Hub, error) {
	if q == nil {
		return nil, fmt.Errorf("new hub: %w: nil queue", ErrInvalid)
	}
	h := &Hub{q: q, conc: 64, drain: 30 * time.Second, resv: map[string]*poll{}, held: map[string]int{}, busy: map[string]int{}, tasks: map[string]*task{}, retired: map[string]*task{}}
	for _, o := range opts {
		if err := o(h); err != nil {
			return nil, fmt.Errorf("new hub: %w", err)
		}
	}
	h.id = newHubID()
	h.relays = make(chan struct{})
	ctx, stop := context.WithCancel(context.Background())
	h.stop = stop
	if q.store == nil {
		close(h.relays)
	} else {
		go func() { defer close(h.relays); h.serveRelays(ctx) }()
	}
	return h, nil
}

// Close stops the hub's worker: running attempts are given back (their
// tasks end), and Next returns at once.
func (h *Hub) Close() error {
	h.mu.Lock()
	h.closed = true
	w := h.w
	h.w = nil
	polls := h.polls
	h.polls = nil
	clear(h.resv)
	old := h.old
	h.old = nil
	h.mu.Unlock()
	for _, p := range polls {
		close(p.got)
	}
	var wg sync.WaitGroup
	for _, o := range append(old, w) {
		if o != nil {
			wg.Go(func() { o.Close() })
		}
	}
	wg.Wait()
	// Relayed reports are answered while the steps drain: a worker behind
	// a load balancer reports through any process.
	h.stop()
	<-h.relays
	h.answering.Wait()
	return nil
}

// refresh reads the declarations again when kinds names one the hub does
// not run, or a second after the last read, and starts a worker for them
// when they changed (the old one drains in the background). It answers
// ErrUnknownKind for a kind nobody declared.
func (h *Hub) refresh(ctx context.Context, kinds []string) error {
	h.mu.Lock()
	known := !slices.ContainsFunc(kinds, func(k string) bool { _, ok := h.decls[k]; return !ok })
	fresh := h.q.clock.Now().Sub(h.loaded) < time.Second
	h.mu.Unlock()
	if known && fresh {
		return nil
	}
	ds, err := h.q.Declared(ctx)
	if err != nil {
		return err
	}
	decls := map[string]Declaration{}
	for _, d := range ds {
		decls[d.Name] = d
	}
	for _, k := range kinds {
		if _, ok := decls[k]; !ok {
			return fmt.Errorf("%w: %s is not declared in tenant %s", ErrUnknownKind, k, h.q.tenant)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.loaded = h.q.clock.Now()
	if h.closed || same(h.decls, decls) {
		return nil
	}
	var ks []Kind
	for _, d := range ds {
		k, err := d.kind(nil, h.stepFunc(d), h.q.retention())
		if err != nil {
			// Declared under another retention: skipped, and said.
			h.q.log.Error("idem: a declared kind cannot run here", "kind", d.Name, "err", err)
			delete(decls, d.Name)
			continue
		}
		ks = append(ks, k)
	}
	w, err := NewWorker(h.q, ks, Concurrency(h.conc), DrainTimeout(h.drain), withGate(h.gate, h.ungate))
	if err != nil {
		return err
	}
	if old := h.w; old != nil {
		// Its running attempts finish under the declarations they
		// started with (their tasks are this hub's): it starts no more.
		h.old = append(h.old, old)
		go func() {
			old.closeWhenIdle()
			h.mu.Lock()
			h.old = slices.DeleteFunc(h.old, func(w *Worker) bool { return w == old })
			h.mu.Unlock()
		}()
	}
	h.w, h.decls = w, decls
	return nil
}

func same(a, b map[string]Declaration) bool {
	if len(a) != len(b) || a == nil {
		return false
	}
	for n, d := range a {
		e, ok := b[n]
		if !ok || fmt.Sprint(d) != fmt.Sprint(e) {
			return false
		}
	}
	return true
}

// worker returns the worker that runs the hub's declarations now (nil
// before a worker asked for a step).
func (h *Hub) worker() *Worker {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.w
}

// gate reports whether the completer may claim job (of kind): a waiting
// worker of the kind is free (no attempt counts on it) beyond the running
// attempts of the kind that need one and count on none (between steps).
// It counts on that worker for the job until the attempt's first step
// goes to it, or the attempt ends (ungate). A worker of several kinds is
// counted on once.
func (h *Hub) gate(kind, job string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	var free *poll
	nfree, counted := 0, 0
	for _, p := range h.polls {
		switch {
		case p.resvKind == kind:
			counted++
		case p.resv == "" && slices.Contains(p.kinds, kind):
			if free == nil {
				free = p
			}
			nfree++
		}
	}
	if nfree <= h.held[kind]-h.busy[kind]-counted {
		return false
	}
	free.resv, free.resvKind = job, kind
	h.resv[job] = free
	h.held[kind]++
	return true
}

func (h *Hub) ungate(kind, job string) {
	h.mu.Lock()
	if h.held[kind]--; h.held[kind] <= 0 {
		delete(h.held, kind)
	}
	if p := h.resv[job]; p != nil {
		p.resv, p.resvKind = "", ""
		delete(h.resv, job)
	}
	w := h.w
	h.mu.Unlock()
	if w != nil {
		// A place freed: the worker of the current declarations may start
		// a job (the attempt that ended may have been an older worker's).
		w.wake()
	}
}

// Next waits until a step of one of kinds is due and returns it as a task
// for the caller to run, or nil when ctx ends first.
func (h *Hub) Next(ctx context.Context, kinds []string) (*Task, error) {
	if len(kinds) == 0 {
		return nil, fmt.Errorf("next: %w: no kinds", ErrInvalid)
	}
	if err := h.refresh(ctx, kinds); err != nil {
		return nil, fmt.Errorf("next: %w", err)
	}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil, fmt.Errorf("next: %w: the hub is closed", ErrInvalid)
	}
	for i, t := range h.pending {
		if slices.Contains(kinds, t.Kind) {
			h.pending = slices.Delete(h.pending, i, i+1)
			h.take(t)
			h.mu.Unlock()
			return t.copy(), nil
		}
	}
	p := &poll{kinds: slices.Clone(kinds), got: make(chan *task, 1)}
	h.polls = append(h.polls, p)
	w := h.w
	h.mu.Unlock()
	if w != nil {
		w.wake()
	}
	select {
	case t, ok := <-p.got:
		if !ok {
			return nil, fmt.Errorf("next: %w: the hub is closed", ErrInvalid)
		}
		return t.copy(), nil
	case <-ctx.Done():
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if i := slices.Index(h.polls, p); i >= 0 {
		h.unpoll(i)
		return nil, nil
	}
	// Handed a task as ctx ended: it is the caller's.
	if t, ok := <-p.got; ok {
		return t.copy(), nil
	}
	return nil, nil
}

// unpoll removes waiting poll i (h.mu held): an attempt that counted on
// it counts on none now.
func (h *Hub) unpoll(i int) {
	if p := h.polls[i]; p.resv != "" {
		delete(h.resv, p.resv)
	}
	h.polls = slices.Delete(h.polls, i, i+1)
}

// take marks t taken (h.mu held): its attempt is busy until t retires.
func (h *Hub) take(t *task) {
	t.renewed = h.q.clock.Now()
	close(t.taken)
	t.took = true
	h.busy[t.Kind]++
}

func (t *task) copy() *Task {
	c := t.Task
	return &c
}

// offer hands t to a waiting worker, or queues it for the next.
func (h *Hub) offer(t *task) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.tasks[t.ID] = t
	if p := h.resv[t.Job]; p != nil {
		if i := slices.Index(h.polls, p); i >= 0 {
			// The worker its attempt counted on.
			h.unpoll(i)
			h.take(t)
			p.got <- t
			return
		}
		delete(h.resv, t.Job)
	}
	for i, p := range h.polls {
		if p.resv == "" && slices.Contains(p.kinds, t.Kind) {
			h.unpoll(i)
			h.take(t)
			p.got <- t
			return
		}
	}
	h.pending = append(h.pending, t)
}

// stepFunc returns the Run of d's worker steps: each hands its step to a
// remote worker and does what it reports.
func (h *Hub) stepFunc(d Declaration) func(string, bool) StepFunc {
	timeout := d.taskTimeout()
	return func(name string, compensating bool) StepFunc {
		if compensating && !slices.ContainsFunc(d.Steps, func(s StepDeclaration) bool { return s.Name == name && s.Compensate }) {
			return nil
		}
		return func(ctx context.Context, r *Run) ([]byte, error) { return h.remote(ctx, r, timeout) }
	}
}

// remote runs r's step on a remote worker.
func (h *Hub) remote(ctx context.Context, r *Run, timeout time.Duration) ([]byte, error) {
	t := &task{Task: Task{ID: h.id + "-" + newTaskID(), Job: r.Key().ID, Kind: r.Kind(), Step: r.Step(), Attempt: r.Attempt(),
		Token: strconv.FormatUint(uint64(r.Token()), 10), StepKey: r.StepKey(), Compensating: r.Compensating(),
		Params: r.Params(), Outputs: map[string][]byte{}, Timeout: timeout},
		msgs: make(chan msg), taken: make(chan struct{}), gone: make(chan struct{}), answers: map[int]*answer{}}
	for _, d := range r.st.Done {
		t.Outputs[d.Name] = d.Output
	}
	h.offer(t)
	defer h.retire(t)
	clk := h.q.clock
	// Not taken within its timeout: the worker that waited went away.
	// Given back uncounted, for the next worker that asks.
	untaken, cancel := clk.WithTimeout(ctx, timeout)
	err := clk.Wait(untaken, t.taken)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, errNoTaker
	}
	for {
		h.mu.Lock()
		left := t.renewed.Add(timeout).Sub(clk.Now())
		h.mu.Unlock()
		if left <= 0 {
			h.q.log.Info("idem: a worker went silent in a step; its attempt ends as a dead worker's", "job", r.Key().Digest(), "step", r.Step(), "timeout", timeout)
			return nil, fmt.Errorf("step %s: %w (silent for %v)", r.Step(), errWorkerLost, timeout)
		}
		silent, cancel := clk.WithTimeout(ctx, left)
		var m msg
		select {
		case m = <-t.msgs:
		case <-silent.Done():
		}
		cancel()
		if m.reply == nil { // silent until now, or ctx ended
			if ctx.Err() != nil {
				return nil, context.Cause(ctx)
			}
			continue // look at the renewal time again
		}
		out, err, end := h.handle(r, m)
		if end {
			return out, err
		}
	}
}

// handle does what report m says within the step's run, and answers it.
func (h *Hub) handle(r *Run, m msg) (out []byte, err error, end bool) {
	var a Answer
	switch m.r.Op {
	case "sleep":
		until := m.r.Until
		if until.IsZero() {
			err = r.Sleep(m.r.For)
		} else {
			err = r.SleepUntil(until)
		}
		switch {
		case err == nil:
			a.Result = "continue"
		case errors.Is(err, ErrSuspended):
			a.Result, end = "suspended", true
		default:
			a.Result, a.Error, end = "failed", err.Error(), true
		}
	case "await":
		var p []byte
		p, err = r.Await(m.r.Event, m.r.For)
		switch {
		case err == nil:
			a.Result, a.Payload = "event", p
		case errors.Is(err, ErrTimeout):
			a.Result, err = "timeout", nil
		case errors.Is(err, ErrSuspended):
			a.Result, end = "suspended", true
		default:
			a.Result, a.Error, end = "failed", err.Error(), true
		}
	case "done":
		a.Result, out, end = "accepted", m.r.Output, true
	case "fail":
		a.Result, err, end = "accepted", errors.New(m.r.Error), true
	}
	m.reply <- a
	return out, err, end
}

// retire ends t: later reports get its answers, or ErrTaskGone.
func (h *Hub) retire(t *task) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if i := slices.Index(h.pending, t); i >= 0 {
		h.pending = slices.Delete(h.pending, i, i+1)
	}
	delete(h.tasks, t.ID)
	if t.took {
		if h.busy[t.Kind]--; h.busy[t.Kind] <= 0 {
			delete(h.busy, t.Kind)
		}
	}
	t.ended, t.endedAt = true, h.q.clock.Now()
	close(t.gone)
	h.retired[t.ID] = t
	for id, o := range h.retired {
		if h.q.clock.Now().Sub(o.endedAt) > 2*o.Timeout {
			delete(h.retired, id)
		}
	}
}

// Report delivers a worker's report on task id and returns the hub's
// answer. A report whose Seq was answered before gets that answer again
// and changes nothing (its reply was lost), as does one sent while the
// first is still being answered; one that skips a Seq is refused
// (ErrInvalid). Every report renews the task.
func (h *Hub) Report(ctx context.Context, id string, rep Report) (Answer, error) {
	switch rep.Op {
	case "renew", "sleep", "await", "done", "fail":
	default:
		return Answer{}, fmt.Errorf("report: %w: op %q is not renew, sleep, await, done or fail", ErrInvalid, rep.Op)
	}
	if rep.Op != "renew" && rep.Seq < 1 {
		return Answer{}, fmt.Errorf("report: %w: seq %d: a task's reports are numbered from 1", ErrInvalid, rep.Seq)
	}
	if err := h.checkReport(rep); err != nil {
		return Answer{}, err
	}
	h.mu.Lock()
	t := h.tasks[id]
	if t == nil {
		t = h.retired[id]
	}
	if t == nil {
		h.mu.Unlock()
		return h.relay(ctx, id, rep) // handed out by another process's hub
	}
	if p := t.answers[rep.Seq]; p != nil && rep.Op != "renew" {
		h.mu.Unlock()
		select {
		case <-p.done: // answered before: its reply was lost
			return p.a, p.err
		case <-ctx.Done():
			return Answer{}, ctx.Err()
		}
	}
	if t.ended {
		h.mu.Unlock()
		return Answer{}, fmt.Errorf("task %s: %w", id, ErrTaskGone)
	}
	t.renewed = h.q.clock.Now()
	if rep.Op == "renew" {
		h.mu.Unlock()
		return Answer{Result: "renewed"}, nil
	}
	if rep.Seq != t.last+1 {
		last := t.last
		h.mu.Unlock()
		return Answer{}, fmt.Errorf("report: %w: seq %d follows %d", ErrInvalid, rep.Seq, last)
	}
	p := &answer{done: make(chan struct{})}
	t.answers[rep.Seq], t.last = p, rep.Seq
	h.mu.Unlock()
	m := msg{r: rep, reply: make(chan Answer, 1)}
	select {
	case t.msgs <- m:
		// Once delivered, the step's Run answers it (it may write to
		// etcd first): wait for it whatever ctx says, so that the
		// answer is kept for a retry.
		p.a = <-m.reply
	case <-t.gone:
		p.err = fmt.Errorf("task %s: %w", id, ErrTaskGone)
	case <-ctx.Done():
		// Not delivered: as if never sent.
		h.mu.Lock()
		delete(t.answers, rep.Seq)
		if t.last == rep.Seq {
			t.last = rep.Seq - 1
		}
		h.mu.Unlock()
		p.err = ctx.Err()
	}
	close(p.done)
	return p.a, p.err
}

// checkReport refuses a report that cannot be applied as sent (nothing
// changes): a sleep or an await past half the retention, an event name
// that is none.
func (h *Hub) checkReport(rep Report) error {
	half := h.q.retention() / 2
	switch rep.Op {
	case "sleep":
		d := rep.For
		if !rep.Until.IsZero() {
			d = rep.Until.Sub(h.q.clock.Now())
		}
		switch {
		case rep.For < 0:
			return fmt.Errorf("report: %w: a negative sleep", ErrInvalid)
		case d >= half:
			return fmt.Errorf("report: %w: a sleep of %v is past half the store's retention (%v)", ErrInvalid, d.Round(time.Second), half)
		}
	case "await":
		if err := validName(rep.Event, 64, true); err != nil {
			return fmt.Errorf("report: %w: event name %q: %v", ErrInvalid, rep.Event, err)
		}
		if rep.For < 0 || rep.For >= half {
			return fmt.Errorf("report: %w: an await's timeout must be 0 or under half the store's retention (%v)", ErrInvalid, half)
		}
	}
	return nil
}

func newTaskID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
