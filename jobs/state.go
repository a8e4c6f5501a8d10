package jobs

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/storex"
)

// state is a job's recovery point: what is saved as its record's
// checkpoint while it is in flight, and as its outcome once it ends. It is
// JSON, so that an operator reading etcd can read it too. Every field a
// worker needs to resume the job is here: its kind and parameters (anyone
// may resume it), the steps it finished (never run again), what to do next.
type state struct {
	// Format identifies a job's state among other checkpoints (1).
	Format int    `json:"idem_job"`
	Kind   string `json:"kind"`
	Params []byte `json:"params,omitempty"`
	// Submission is a nonce of the Submit that wrote the job: how a
	// submission retried after a lost reply knows the job as its own.
	Submission string `json:"submission,omitempty"`
	// Base is the record's takeover count before the job's first attempt:
	// attempt n is the claim whose takeover count is Base+n. Every
	// attempt starts with a takeover (a job is enqueued unclaimed), and a
	// takeover raises the count in the very write that claims, so an
	// attempt that crashed the worker is counted too.
	Base int `json:"base,omitempty"`
	// Steps are the kind's step names, as the last worker that ran the
	// job knew them (for display; resuming goes by Done's names).
	Steps []string `json:"steps,omitempty"`
	// Done are the finished steps, in the order they finished.
	Done []doneStep `json:"done,omitempty"`
	// Compensating is set once a step failed with policy Compensate: the
	// finished steps are being undone, last first. Failure says why.
	Compensating bool   `json:"compensating,omitempty"`
	Failure      string `json:"failure,omitempty"`
	// NotBefore (unix ms) holds the next attempt back: a retry after a
	// failure, or a job submitted to run later.
	NotBefore int64 `json:"not_before,omitempty"`
	// Parked is set when the job gave up (attempts exhausted): no worker
	// runs it until an operator retries or cancels it.
	Parked bool `json:"parked,omitempty"`
	// Errors are the last errors of failed attempts, oldest first.
	Errors []attemptError `json:"errors,omitempty"`
	// Outcome is set when the job ended: succeeded, failed or cancelled.
	Outcome State `json:"outcome,omitempty"`
	// Truncated says what was cut for the job's end to fit the record's
	// limit ("error", "errors", "failure", "output:<step>").
	Truncated []string `json:"truncated,omitempty"`
	// Waits are the durable waits (Run.Sleep, Run.Await) of the steps not
	// finished yet, in the order they were first reached: what each was
	// asked and, once decided, what it returned. A step's waits are
	// dropped with its checkpoint.
	Waits []wait `json:"waits,omitempty"`
	// Awaiting is the event the job was given back to wait for (with
	// NotBefore its timeout, or 0 for none).
	Awaiting string `json:"awaiting,omitempty"`
	// Limited names the limit and key (<limit>=<key>) whose slots were
	// all taken when the job was last tried: it waits for one (with
	// NotBefore when to look again).
	Limited string `json:"limited,omitempty"`
	// Zone is the zone of the process that submitted the job
	// (WithZone): a worker there is preferred while there is one.
	Zone string `json:"zone,omitempty"`
}

// wait is one durable wait of a step: the N-th call of Run.Sleep or
// Run.Await in a run of Step.
type wait struct {
	Step string `json:"step"`
	N    int    `json:"n"`
	// Until (unix ms, on the clock of the worker that reached the wait
	// first) is when a sleep ends, or an await times out (0: never).
	Until int64 `json:"until,omitempty"`
	// Event is the event an await waits for ("" for a sleep).
	Event string `json:"event,omitempty"`
	// Got is set once the event was received; Payload is what it carried.
	Got     bool   `json:"got,omitempty"`
	Payload []byte `json:"payload,omitempty"`
	// TimedOut is set once the await timed out: every later run of the
	// step sees the same.
	TimedOut bool `json:"timed_out,omitempty"`
}

type doneStep struct {
	Name        string `json:"name"`
	Token       int64  `json:"token"`
	At          int64  `json:"at"` // unix ms
	Output      []byte `json:"output,omitempty"`
	Compensated bool   `json:"compensated,omitempty"`
}

type attemptError struct {
	Attempt int    `json:"attempt"`
	Token   int64  `json:"token"`
	Step    string `json:"step,omitempty"`
	Err     string `json:"error"`
	At      int64  `json:"at"`
}

// maxErrors is how many attempt errors a job keeps.
const maxErrors = 10

// maxErrorLen bounds one saved error message.
const maxErrorLen = 1024

const stateFormat = 1

// marker starts every encoded state: how a job's checkpoint is told from
// any other.
var marker = []byte(`{"idem_job":`)

func (s *state) encode() []byte {
	s.Format = stateFormat
	b, err := json.Marshal(s)
	if err != nil {
		panic(fmt.Sprintf("jobs: encoding a job's state: %v", err)) // only plain fields
	}
	return b
}

// decodeState reads a job's state; ok is false for anything that is not one.
func decodeState(b []byte) (*state, error) {
	if !bytes.HasPrefix(b, marker) {
		return nil, ErrNotJob
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotJob, err)
	}
	if s.Format != stateFormat {
		return nil, fmt.Errorf("%w: job state format %d (this version reads %d)", ErrNotJob, s.Format, stateFormat)
	}
	return &s, nil
}

func (s *state) finished(step string) *doneStep {
	for i := range s.Done {
		if s.Done[i].Name == step {
			return &s.Done[i]
		}
	}
	return nil
}

func (s *state) addError(e attemptError) {
	if len(e.Err) > maxErrorLen {
		e.Err = e.Err[:maxErrorLen] + "..."
	}
	s.Errors = append(s.Errors, e)
	if len(s.Errors) > maxErrors {
		s.Errors = s.Errors[len(s.Errors)-maxErrors:]
	}
}

func (s *state) lastError() string {
	if len(s.Errors) == 0 {
		return ""
	}
	e := s.Errors[len(s.Errors)-1]
	if e.Step != "" {
		return fmt.Sprintf("step %s: %s", e.Step, e.Err)
	}
	return e.Err
}

// State is where a job stands.
type State string

// The states of a job. Queued, Scheduled and Parked jobs are in flight
// with no owner; Running ones are claimed by a worker; the last three are
// final.
const (
	// Queued: waiting for a worker to claim it.
	Queued State = "queued"
	// Scheduled: waiting for its time: a retry after a failed attempt,
	// a job submitted with RunAt, or a step's durable sleep (Run.Sleep).
	Scheduled State = "scheduled"
	// Waiting: a step waits for an event (Run.Await) that has not come;
	// NotBefore is when its wait times out, if it does.
	Waiting State = "waiting"
	// Running: claimed by a worker (whose session, or the claim's
	// deadline, may since have ended: the next worker takes it over).
	Running State = "running"
	// Parked: it failed MaxAttempts times; no worker runs it until an
	// operator retries (Queue.Retry) or cancels (Queue.Cancel) it.
	Parked State = "parked"
	// Succeeded: every step finished.
	Succeeded State = "succeeded"
	// Failed: a step failed with policy Fail or Compensate (after the
	// compensations ran).
	Failed State = "failed"
	// Cancelled: an operator cancelled it before it finished.
	Cancelled State = "cancelled"
)

// Final reports whether a job in state s has ended for good.
func (s State) Final() bool { return s == Succeeded || s == Failed || s == Cancelled }

// Job is a job as stored: its record decoded.
type Job struct {
	Key    etcdstore.Key
	Kind   string
	Params []byte
	State  State
	// Attempts is how many attempts were started, the running one
	// included.
	Attempts int
	// Steps are the job's steps, finished or not, as far as they are
	// known (a job no worker has run yet knows none).
	Steps []StepInfo
	// Err says why a job failed, was parked or cancelled; for a job
	// scheduled for a retry, the last attempt's error.
	Err string
	// Errors are the last errors of failed attempts, oldest first.
	Errors []AttemptError
	// Truncated says what was cut for the job's end to fit its record
	// ("error", "errors", "failure", "output:<step>"): the record's size
	// limit (etcdstore.WithMaxRecordSize) is too small for this job.
	Truncated []string
	// NotBefore is when a Scheduled job's next attempt may start, or when
	// a Waiting job's wait times out.
	NotBefore time.Time
	// Awaiting is the event a Waiting job waits for.
	Awaiting string
	// Limited names the limit and key (<limit>=<key>) whose slots were
	// all taken when the job was last tried (a Scheduled job waits for
	// one).
	Limited string
	// Zone is the zone that submitted the job (WithZone): its workers
	// are preferred.
	Zone string
	// Owner is the session of the worker running it (Running).
	Owner string
	// Token is the fencing token of the job's last claim.
	Token fencing.Token
	// Created is when the job was submitted; Expires when its record is
	// forgotten (retention), after which its key names a new job.
	Created, Expires time.Time
}

// StepInfo is one step of a job.
type StepInfo struct {
	Name     string
	Finished bool
	// Token is the fencing token of the attempt that finished it.
	Token fencing.Token
	// At is when it finished.
	At time.Time
	// Output is what the step returned.
	Output []byte
	// Compensated is set once its compensation ran.
	Compensated bool
}

// AttemptError is the error of one failed attempt.
type AttemptError struct {
	Attempt int
	Token   fencing.Token
	Step    string
	Err     string
	At      time.Time
}

// Output returns the output of the job's finished step named step, or nil.
func (j *Job) Output(step string) []byte {
	for _, s := range j.Steps {
		if s.Name == step && s.Finished {
			return s.Output
		}
	}
	return nil
}

// FromRecord decodes a job from its record (etcdstore.Admin.Get, List or
// DecodeRecord). A record that holds no job is an error wrapping ErrNotJob.
// now decides whether a job waiting for its time is still Scheduled.
func FromRecord(rec *etcdstore.Record, now time.Time) (*Job, error) {
	if rec.Kind == etcdstore.KindKey {
		// A plain key, whatever it holds (a saved error included): never
		// read as a job. Records written before kinds fall through to the
		// job state's own marker.
		return nil, fmt.Errorf("job %s: %w: a plain idempotency key", rec.Key, ErrNotJob)
	}
	var raw []byte
	switch rec.State {
	case etcdstore.InFlight:
		raw = rec.Checkpoint
	case etcdstore.Done:
		if rec.Outcome != nil {
			raw = rec.Outcome.Body
		}
	}
	st, err := decodeState(raw)
	if err != nil && rec.State == etcdstore.Done && rec.Outcome != nil && rec.Outcome.Err != "" && len(raw) == 0 &&
		(rec.Kind == etcdstore.KindJob || strings.HasPrefix(rec.Outcome.Err, storex.OutcomeNotSaved)) {
		// The store saved an error in the job's place (its final state
		// was too large to save): the job ran, and failed. A record
		// written before kinds is read so only when its error is the
		// store's: any other saved error is a plain key's work failing.
		return &Job{Key: rec.Key, State: Failed, Err: rec.Outcome.Err, Token: rec.Token, Created: rec.Created, Expires: rec.Expires}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("job %s: %w", rec.Key, err)
	}
	j := &Job{
		Key:       rec.Key,
		Kind:      st.Kind,
		Params:    st.Params,
		Token:     rec.Token,
		Created:   rec.Created,
		Expires:   rec.Expires,
		Err:       st.lastError(),
		Truncated: st.Truncated,
		Limited:   st.Limited,
		Zone:      st.Zone,
	}
	for _, e := range st.Errors {
		j.Errors = append(j.Errors, AttemptError{Attempt: e.Attempt, Token: fencing.Token(e.Token), Step: e.Step, Err: e.Err, At: time.UnixMilli(e.At)})
	}
	j.Attempts = max(rec.Takeovers-st.Base, 0)
	switch {
	case rec.State == etcdstore.Done:
		j.State = st.Outcome
		if rec.Outcome.Err != "" {
			j.Err = rec.Outcome.Err
		}
		if j.State == "" {
			j.State = Failed // a done record without an outcome: an error the store saved for the job
		}
		if j.State == Succeeded {
			j.Err = "" // earlier attempts' errors stay in Errors
		}
	case rec.Owner != "":
		j.State, j.Owner = Running, rec.Owner
	case st.Parked:
		j.State = Parked
	case st.Awaiting != "":
		j.State, j.Awaiting = Waiting, st.Awaiting
		if st.NotBefore != 0 {
			j.NotBefore = time.UnixMilli(st.NotBefore)
		}
	case st.NotBefore > now.UnixMilli():
		j.State, j.NotBefore = Scheduled, time.UnixMilli(st.NotBefore)
	default:
		j.State = Queued
	}
	if j.State == Running && j.Attempts == 0 {
		j.Attempts = 1
	}
	names := st.Steps
	for _, d := range st.Done {
		if !slices.Contains(names, d.Name) {
			names = append(names, d.Name)
		}
	}
	for _, n := range names {
		si := StepInfo{Name: n}
		if d := st.finished(n); d != nil {
			si.Finished, si.Token, si.At, si.Output, si.Compensated = true, fencing.Token(d.Token), time.UnixMilli(d.At), d.Output, d.Compensated
		}
		j.Steps = append(j.Steps, si)
	}
	return j, nil
}
