package jobs

import (
	"fmt"
	"slices"

	"github.com/idem-dev/idem/etcdstore"
)

// fit returns a job's end, its state and its error text, within max bytes
// (the store's record limit), cutting what can be cut, in this order, and
// saying what it cut in the state (Truncated): the error text, to its first
// kilobyte; the attempt errors but the last; the last one's text; the
// failure's text; the outputs of the first outputs finished steps, oldest
// first (a step's output is cut only once its checkpoint landed: the last
// step of a success whose output is saved only with the end keeps it). The kind, the parameters and the finished steps' names and tokens
// are never cut: without them the job could run a finished step again, or
// not at all. ok is false when even that does not fit.
func fit(st *state, errText string, max int, outputs int) (out etcdstore.Outcome, ok bool) {
	size := func() int { return len(st.encode()) + len(errText) }
	cut := func(what string) { st.Truncated = append(st.Truncated, what) }
	if size() <= max {
		return etcdstore.Outcome{Body: st.encode(), Err: errText}, true
	}
	if len(errText) > maxErrorLen {
		errText = errText[:maxErrorLen] + "..."
		cut("error")
	}
	if size() > max && len(st.Errors) > 1 {
		st.Errors = st.Errors[len(st.Errors)-1:]
		cut("errors")
	}
	if size() > max && len(st.Errors) == 1 && len(st.Errors[0].Err) > 64 {
		st.Errors[0].Err = st.Errors[0].Err[:64] + "..."
		cut("errors")
	}
	if size() > max && len(st.Failure) > 64 {
		st.Failure = st.Failure[:64] + "..."
		cut("failure")
	}
	for i := 0; size() > max && i < min(outputs, len(st.Done)); i++ {
		if st.Done[i].Output != nil {
			st.Done[i].Output = nil
			cut(fmt.Sprintf("output:%s", st.Done[i].Name))
		}
	}
	if size() > max && len(errText) > 64 {
		errText = errText[:64] + "..."
	}
	return etcdstore.Outcome{Body: st.encode(), Err: errText}, size() <= max
}

// fits reports whether the end fit would make of st fits max bytes, and
// its size once cut, without changing st.
func fits(st *state, errText string, max int) (int, bool) {
	c := st.clone()
	out, ok := fit(c, errText, max, len(c.Done))
	return len(out.Body) + len(out.Err), ok
}

// clone returns a copy of st that shares nothing fit changes.
func (st *state) clone() *state {
	c := *st
	c.Steps = slices.Clone(st.Steps)
	c.Done = slices.Clone(st.Done)
	c.Errors = slices.Clone(st.Errors)
	c.Truncated = slices.Clone(st.Truncated)
	c.Waits = slices.Clone(st.Waits)
	return &c
}
