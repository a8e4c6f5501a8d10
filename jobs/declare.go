package jobs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/canonjson"
	"github.com/idem-dev/idem/internal/storex"
)

// Declaration is a kind as data: its steps, retry policy and deadline,
// declared once (Queue.Declare, the worker API's PUT /v1/jobs/kinds/{kind},
// idem jobs kinds apply) and run by workers in any language through a Hub,
// or bound to Go functions (Declaration.Bind). Durations are Go duration
// strings ("30s", "5m").
type Declaration struct {
	Name        string            `json:"name"`
	Steps       []StepDeclaration `json:"steps"`
	MaxAttempts int               `json:"max_attempts,omitempty"`
	Backoff     string            `json:"backoff,omitempty"`
	MaxBackoff  string            `json:"max_backoff,omitempty"`
	Deadline    string            `json:"deadline,omitempty"`
	// TaskTimeout is how long a worker may stay silent in a step (no call
	// on its task) before it counts as dead: the attempt ends as a crashed
	// worker's does (default 30 s; a worker renews at a third of it).
	TaskTimeout string `json:"task_timeout,omitempty"`
	// Limits bound how many of the kind's jobs that share a parameter's
	// value run at once, or start per second (Limit, with ParamKey).
	Limits []LimitDeclaration `json:"limits,omitempty"`
	// Schedules submit the kind's jobs on a schedule (Schedule): idem
	// serve runs them, in every process of a deployment, each occurrence
	// once.
	Schedules []ScheduleDeclaration `json:"schedules,omitempty"`
}

// ScheduleDeclaration is a Schedule of a declared kind: Cron (in
// Location, default UTC) or Every, fixed Params (default
// {"schedule","occurrence"}), and its policies.
type ScheduleDeclaration struct {
	Name     string          `json:"name"`
	Cron     string          `json:"cron,omitempty"`
	Every    string          `json:"every,omitempty"`
	Location string          `json:"location,omitempty"`
	Params   json.RawMessage `json:"params,omitempty"`
	// CatchUp: "latest" (default), "all" or "none".
	CatchUp string `json:"catch_up,omitempty"`
	// Overlap: "allow-all" (default), "skip" or "buffer-one".
	Overlap    string `json:"overlap,omitempty"`
	Lateness   string `json:"lateness,omitempty"`
	MaxCatchUp int    `json:"max_catch_up,omitempty"`
}

// schedule returns the Schedule sd declares for kind, checked against
// retention.
func (sd ScheduleDeclaration) schedule(kind string, retention time.Duration) (Schedule, error) {
	sc := Schedule{Name: sd.Name, Cron: sd.Cron, Kind: kind, MaxCatchUp: sd.MaxCatchUp}
	var err error
	if sc.Every, err = duration("every", sd.Every); err != nil {
		return sc, fmt.Errorf("kind %s, schedule %s: %w", kind, sd.Name, err)
	}
	if sc.Lateness, err = duration("lateness", sd.Lateness); err != nil {
		return sc, fmt.Errorf("kind %s, schedule %s: %w", kind, sd.Name, err)
	}
	if sd.Location != "" {
		if sc.Location, err = time.LoadLocation(sd.Location); err != nil {
			return sc, fmt.Errorf("%w: kind %s, schedule %s: location %q: %v", ErrInvalid, kind, sd.Name, sd.Location, err)
		}
	}
	if len(sd.Params) > 0 {
		if !json.Valid(sd.Params) {
			return sc, fmt.Errorf("%w: kind %s, schedule %s: params are not JSON", ErrInvalid, kind, sd.Name)
		}
		params := slices.Clone([]byte(sd.Params))
		sc.Params = func(time.Time) []byte { return params }
	}
	if sd.CatchUp != "" {
		if sc.CatchUp, err = parseCatchUp(sd.CatchUp); err != nil {
			return sc, fmt.Errorf("kind %s, schedule %s: %w", kind, sd.Name, err)
		}
	}
	if sd.Overlap != "" {
		if sc.Overlap, err = ParseOverlap(sd.Overlap); err != nil {
			return sc, fmt.Errorf("kind %s, schedule %s: %w", kind, sd.Name, err)
		}
	}
	if err := sc.validate(retention); err != nil {
		return sc, fmt.Errorf("kind %s: %w", kind, err)
	}
	return sc, nil
}

// parseCatchUp reads a CatchUp's String.
func parseCatchUp(s string) (CatchUp, error) {
	for c := CatchUpLatest; c <= CatchUpNone; c++ {
		if c.String() == s {
			return c, nil
		}
	}
	return 0, fmt.Errorf("%w: catch_up %q: latest, all or none", ErrInvalid, s)
}

// DeclaredSchedules returns the schedules of ds, checked against
// retention. Two schedules of one name are an error, as is one that does
// not check. What idem serve runs is RunnableSchedules.
func DeclaredSchedules(ds []Declaration, retention time.Duration) ([]Schedule, error) {
	out, errs := RunnableSchedules(ds, retention)
	if len(errs) > 0 {
		return nil, errs[0]
	}
	return out, nil
}

// RunnableSchedules returns the schedules of ds that can run, and why
// the others cannot: one that does not check against retention, or whose
// name a kind first by name declares too (two declarations made at once
// can both have it). One bad schedule never stops the others.
func RunnableSchedules(ds []Declaration, retention time.Duration) ([]Schedule, []error) {
	ds = slices.Clone(ds)
	slices.SortFunc(ds, func(a, b Declaration) int { return strings.Compare(a.Name, b.Name) })
	var out []Schedule
	var errs []error
	seen := map[string]string{}
	for _, d := range ds {
		for _, sd := range d.Schedules {
			sc, err := sd.schedule(d.Name, retention)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if k, ok := seen[sc.Name]; ok {
				errs = append(errs, fmt.Errorf("%w: schedule %s is declared by kinds %s and %s (%s's runs)", ErrInvalid, sc.Name, k, d.Name, k))
				continue
			}
			seen[sc.Name] = d.Name
			out = append(out, sc)
		}
	}
	return out, errs
}

// LimitDeclaration is a Limit of a declared kind, keyed by a field of the
// job's JSON parameters (ParamKey).
type LimitDeclaration struct {
	Name        string  `json:"name"`
	Param       string  `json:"param"`
	Concurrency int     `json:"concurrency,omitempty"`
	Rate        float64 `json:"rate,omitempty"`
	Burst       int     `json:"burst,omitempty"`
}

// StepDeclaration is one step of a declared kind. A step with Sleep or
// Await is run by idem itself (SleepStep, AwaitStep); any other by a
// worker.
type StepDeclaration struct {
	Name string `json:"name"`
	// OnError: "retry" (default), "fail" or "compensate".
	OnError string `json:"on_error,omitempty"`
	// Compensate: the worker undoes this step when a later one fails
	// with on_error "compensate" (its task has compensating set).
	Compensate bool   `json:"compensate,omitempty"`
	Sleep      string `json:"sleep,omitempty"`
	Await      string `json:"await,omitempty"`
	Timeout    string `json:"timeout,omitempty"` // an Await's
}

// DefaultTaskTimeout is how long a worker of a declared kind may stay
// silent in a step before it counts as dead.
const DefaultTaskTimeout = 30 * time.Second

// StepFunc runs a step of a declared kind bound to Go (Declaration.Bind).
type StepFunc func(ctx context.Context, r *Run) ([]byte, error)

// ParseDeclaration reads a declaration from JSON, refusing unknown and
// repeated members, and checks it.
func ParseDeclaration(b []byte) (Declaration, error) {
	var d Declaration
	if _, err := canonjson.Canonical(b); err != nil && json.Valid(b) {
		return d, fmt.Errorf("%w: kind declaration: %v", ErrInvalid, err) // a member named twice
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		return d, fmt.Errorf("%w: kind declaration: %v", ErrInvalid, err)
	}
	if dec.More() {
		return d, fmt.Errorf("%w: kind declaration: more than one JSON value", ErrInvalid)
	}
	if _, err := d.kind(nil, func(string, bool) StepFunc { return nil }, time.Duration(1<<62)); err != nil {
		return d, err
	}
	return d, nil
}

// Check checks d as Queue.Declare does, against a store's retention.
func (d Declaration) Check(retention time.Duration) error {
	_, err := d.kind(nil, func(string, bool) StepFunc { return nil }, retention)
	return err
}

// Bind returns the declared kind with Go functions for its worker steps
// (every step without sleep or await needs one, and a step declared with
// compensate its undo in undo), checked as NewWorker checks a Kind.
func (d Declaration) Bind(run map[string]StepFunc, undo map[string]func(ctx context.Context, r *Run) error) (Kind, error) {
	for name := range run {
		if !slices.ContainsFunc(d.Steps, func(s StepDeclaration) bool { return s.Name == name && s.Sleep == "" && s.Await == "" }) {
			return Kind{}, fmt.Errorf("%w: kind %s has no worker step %q", ErrInvalid, d.Name, name)
		}
	}
	if undo == nil {
		undo = map[string]func(context.Context, *Run) error{}
	}
	return d.kind(undo, func(name string, _ bool) StepFunc { return run[name] }, time.Duration(1<<62))
}

// duration parses a declared duration ("" is 0).
func duration(what, s string) (time.Duration, error) {
	if s == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%w: %s %q is not a duration such as \"30s\"", ErrInvalid, what, s)
	}
	return d, nil
}

// taskTimeout returns the declaration's task timeout, or the default.
func (d Declaration) taskTimeout() time.Duration {
	t, err := duration("task_timeout", d.TaskTimeout)
	if err != nil || t == 0 {
		return DefaultTaskTimeout
	}
	return t
}

// kind builds the Kind d declares: worker steps' Run from step, their
// Compensate from undo (or, with undo nil, from step with compensating
// set), and checks it against retention.
func (d Declaration) kind(undo map[string]func(context.Context, *Run) error, step func(name string, compensating bool) StepFunc, retention time.Duration) (Kind, error) {
	k := Kind{Name: d.Name, MaxAttempts: d.MaxAttempts}
	var err error
	if k.Backoff, err = duration("backoff", d.Backoff); err != nil {
		return Kind{}, fmt.Errorf("kind %s: %w", d.Name, err)
	}
	if k.MaxBackoff, err = duration("max_backoff", d.MaxBackoff); err != nil {
		return Kind{}, fmt.Errorf("kind %s: %w", d.Name, err)
	}
	if k.Deadline, err = duration("deadline", d.Deadline); err != nil {
		return Kind{}, fmt.Errorf("kind %s: %w", d.Name, err)
	}
	tt, err := duration("task_timeout", d.TaskTimeout)
	if err != nil {
		return Kind{}, fmt.Errorf("kind %s: %w", d.Name, err)
	}
	if d.TaskTimeout != "" && tt < time.Second {
		return Kind{}, fmt.Errorf("%w: kind %s: task_timeout %v is under a second", ErrInvalid, d.Name, tt)
	}
	if tt >= retention/2 {
		return Kind{}, fmt.Errorf("%w: kind %s: task_timeout %v is past half the store's retention (%v): a silent worker would hold its job past it", ErrInvalid, d.Name, tt, retention)
	}
	for _, l := range d.Limits {
		if l.Param == "" {
			return Kind{}, fmt.Errorf("%w: kind %s: limit %s names no param (the parameter whose value it limits)", ErrInvalid, d.Name, l.Name)
		}
		k.Limits = append(k.Limits, Limit{Name: l.Name, Key: ParamKey(l.Param), Concurrency: l.Concurrency, Rate: l.Rate, Burst: l.Burst})
	}
	for i, s := range d.Steps {
		var on OnError
		switch s.OnError {
		case "", "retry":
			on = Retry
		case "fail":
			on = Fail
		case "compensate":
			on = Compensate
		default:
			return Kind{}, fmt.Errorf("%w: kind %s, step %d: on_error %q is not retry, fail or compensate", ErrInvalid, d.Name, i, s.OnError)
		}
		sleep, err := duration("sleep", s.Sleep)
		if err != nil {
			return Kind{}, fmt.Errorf("kind %s, step %s: %w", d.Name, s.Name, err)
		}
		timeout, err := duration("timeout", s.Timeout)
		if err != nil {
			return Kind{}, fmt.Errorf("kind %s, step %s: %w", d.Name, s.Name, err)
		}
		switch {
		case s.Sleep != "" && s.Await != "":
			return Kind{}, fmt.Errorf("%w: kind %s, step %s: both sleep and await", ErrInvalid, d.Name, s.Name)
		case s.Timeout != "" && s.Await == "":
			return Kind{}, fmt.Errorf("%w: kind %s, step %s: a timeout without await", ErrInvalid, d.Name, s.Name)
		case s.Compensate && (s.Sleep != "" || s.Await != ""):
			return Kind{}, fmt.Errorf("%w: kind %s, step %s: only a worker step has a compensation", ErrInvalid, d.Name, s.Name)
		case s.Sleep != "":
			st := SleepStep(s.Name, sleep)
			st.OnError = on
			k.Steps = append(k.Steps, st)
			continue
		case s.Await != "":
			if err := validName(s.Await, 64, true); err != nil {
				return Kind{}, fmt.Errorf("%w: kind %s, step %s: event name %q: %v", ErrInvalid, d.Name, s.Name, s.Await, err)
			}
			k.Steps = append(k.Steps, AwaitStep(s.Name, s.Await, timeout, on))
			continue
		}
		st := Step{Name: s.Name, OnError: on, Run: step(s.Name, false)}
		if st.Run == nil && step(s.Name, true) == nil && undo == nil {
			// ParseDeclaration: checked without functions.
			st.Run = func(context.Context, *Run) ([]byte, error) { return nil, errors.New("unbound") }
		}
		if s.Compensate {
			if undo != nil {
				st.Compensate = undo[s.Name]
				if st.Compensate == nil {
					return Kind{}, fmt.Errorf("%w: kind %s, step %s declares a compensation and none is bound", ErrInvalid, d.Name, s.Name)
				}
			} else if f := step(s.Name, true); f != nil {
				st.Compensate = func(ctx context.Context, r *Run) error { _, err := f(ctx, r); return err }
			}
		}
		k.Steps = append(k.Steps, st)
	}
	if err := k.validate(retention); err != nil {
		return Kind{}, err
	}
	if _, err := DeclaredSchedules([]Declaration{d}, retention); err != nil {
		return Kind{}, err
	}
	return k, nil
}

// declName names the value that holds a tenant's declared kinds, all in
// one (a JSON object by kind name): a declaration is checked against the
// others and written in one compare-and-set, so two made at once cannot
// both take one schedule name.
func declName(tenant string) string { return "d/" + tenant }

// declared reads the tenant's declarations and the value's revision.
func (q *Queue) declared(ctx context.Context) (map[string]Declaration, int64, error) {
	v, err := storex.GetValue(q.store, ctx, declName(q.tenant))
	if err != nil {
		return nil, 0, err
	}
	m, err := decodeDeclarations(v.Value)
	if err != nil {
		return nil, 0, fmt.Errorf("the declared kinds of tenant %s: %w", q.tenant, err)
	}
	return m, v.Revision, nil
}

func decodeDeclarations(b []byte) (map[string]Declaration, error) {
	m := map[string]Declaration{}
	if len(b) == 0 {
		return m, nil
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	return m, nil
}

// updateDeclared applies change to the tenant's declarations and writes
// them if they changed, by compare-and-set, reading again until it lands.
func (q *Queue) updateDeclared(ctx context.Context, change func(map[string]Declaration) error) error {
	for {
		m, rev, err := q.declared(ctx)
		if err != nil {
			return err
		}
		before, _ := json.Marshal(m)
		if err := change(m); err != nil {
			return err
		}
		after, err := json.Marshal(m)
		if err != nil {
			return err
		}
		if bytes.Equal(before, after) {
			return nil // so already (a retry whose reply was lost, say)
		}
		var ok bool
		if len(m) == 0 {
			ok, err = storex.DeleteValue(q.store, ctx, declName(q.tenant), rev)
		} else {
			_, ok, err = storex.SetValue(q.store, ctx, declName(q.tenant), after, rev)
		}
		if errors.Is(err, etcdstore.ErrUnavailable) && ctx.Err() == nil {
			continue // its outcome is unknown: read it again
		}
		if err != nil || ok {
			return err
		}
	}
}

// Declare stores kind d for the queue's tenant, replacing an earlier
// declaration of the same name: hubs run the new one from their next look
// (jobs already running finish their attempt under the old). It is checked
// first, against the store's retention and the tenant's other kinds (a
// schedule name is the tenant's); a bad declaration changes nothing.
func (q *Queue) Declare(ctx context.Context, d Declaration) error {
	if q.store == nil {
		return fmt.Errorf("declare: %w: declared kinds need one etcd cluster, not a shard set", ErrInvalid)
	}
	if err := d.Check(q.retention()); err != nil {
		return fmt.Errorf("declare: %w", err)
	}
	// Stored as it reads back (a round trip through JSON).
	b, err := json.Marshal(d)
	if err != nil {
		return fmt.Errorf("declare: %w", err)
	}
	var stored Declaration
	if err := json.Unmarshal(b, &stored); err != nil {
		return fmt.Errorf("declare: %w", err)
	}
	err = q.updateDeclared(ctx, func(m map[string]Declaration) error {
		for _, sd := range d.Schedules {
			for _, o := range m {
				if o.Name != d.Name && slices.ContainsFunc(o.Schedules, func(x ScheduleDeclaration) bool { return x.Name == sd.Name }) {
					return fmt.Errorf("%w: schedule %s is kind %s's already (a schedule's name is its tenant's)", ErrInvalid, sd.Name, o.Name)
				}
			}
		}
		m[d.Name] = stored
		all := make([]Declaration, 0, len(m))
		for _, o := range m {
			all = append(all, o)
		}
		_, err := DeclaredSchedules(all, q.retention())
		return err
	})
	if err != nil {
		return fmt.Errorf("declare %s: %w", d.Name, err)
	}
	return nil
}

// Declared returns the tenant's declared kinds, by name.
func (q *Queue) Declared(ctx context.Context) ([]Declaration, error) {
	if q.store == nil {
		return nil, nil
	}
	m, _, err := q.declared(ctx)
	if err != nil {
		return nil, fmt.Errorf("declared kinds: %w", err)
	}
	return sortedDeclarations(m), nil
}

func sortedDeclarations(m map[string]Declaration) []Declaration {
	var out []Declaration
	for _, d := range m {
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b Declaration) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Undeclare removes declared kind name (false: there was none). Its jobs
// stay; no hub runs them until it is declared again.
func (q *Queue) Undeclare(ctx context.Context, name string) (bool, error) {
	if q.store == nil {
		return false, nil
	}
	found := false
	err := q.updateDeclared(ctx, func(m map[string]Declaration) error {
		_, found = m[name]
		delete(m, name)
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("undeclare %s: %w", name, err)
	}
	return found, nil
}
