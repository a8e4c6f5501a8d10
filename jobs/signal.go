package jobs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// ErrSignalMismatch is returned by Queue.Signal for an event that was
// signalled before with another payload: an event is delivered once, with
// the payload it was first signalled with. Nothing was written.
var ErrSignalMismatch = errors.New("event signalled before with another payload")

// eventPrefix is the start of the names (among the store's values) of the
// events of tenant's jobs: e/<tenant>/<job id>/<job created, unix ms>/<event>.
// The job's creation names the job, not only its id: a job that replaces
// another of its id (DedupWindow, or after the store forgot it) never sees
// the other's events. Ids and tenants hold no '/', and event names neither.
func eventPrefix(tenant string) string { return "e/" + tenant + "/" }

func eventName(tenant, id string, created time.Time, event string) string {
	return eventPrefix(tenant) + id + "/" + strconv.FormatInt(created.UnixMilli(), 10) + "/" + event
}

// parseEvent splits an event's value name (without the tenant's prefix)
// into its job's id and creation, and the event's name.
func parseEvent(rest string) (id string, created int64, event string, ok bool) {
	parts := strings.Split(rest, "/")
	if len(parts) != 3 || parts[0] == "" || parts[2] == "" {
		return "", 0, "", false
	}
	created, err := strconv.ParseInt(parts[1], 10, 64)
	return parts[0], created, parts[2], err == nil
}

// Signal delivers event name, with payload, to job id: the job's
// Run.Await(name) returns payload, whether it waits already or reaches the
// call later. An event is delivered once: signalling it again with the same
// payload (a retried signal, or the same signal sent from two places)
// changes nothing and succeeds; with another payload it is refused with
// ErrSignalMismatch. The event is one etcd value, kept for the store's
// retention.
//
// The job must exist and not have ended (etcdstore.ErrNotFound, ErrFinal).
// A signal whose outcome is unknown is an error wrapping
// etcdstore.ErrUnavailable: send it again, which is safe.
func (q *Queue) Signal(ctx context.Context, id, name string, payload []byte) error {
	key := q.Key(id)
	if err := key.Validate(); err != nil {
		return fmt.Errorf("signal: %w", err)
	}
	if err := validName(name, 64, true); err != nil {
		return fmt.Errorf("signal %s: %w: event name %q: %v", key, ErrInvalid, name, err)
	}
	if limit := q.maxRecord() / 3; len(payload) > limit {
		return fmt.Errorf("signal %s %s: %w: a payload of %d bytes, limit %d (a third of the store's record size: it is saved with the job, in base64)",
			key, name, ErrInvalid, len(payload), limit)
	}
	// The store that holds the job (its shard, on a shard set) keeps its
	// events: a job that has not ended stays where it is.
	st, rec, err := q.holder(ctx, id)
	var j *Job
	if err == nil {
		j, err = FromRecord(rec, q.clock.Now())
	}
	switch {
	case err != nil:
		return fmt.Errorf("signal %s: %w", name, err)
	case j.State.Final():
		return fmt.Errorf("signal %s %s: %w: %s", key, name, ErrFinal, j.State)
	}
	if payload == nil {
		payload = []byte{}
	}
	v, ok, err := storex.SetValue(st, ctx, eventName(q.tenant, id, j.Created, name), payload, 0, storex.Retained())
	switch {
	case err != nil:
		return fmt.Errorf("signal %s %s: %w", key, name, err)
	case !ok && !samePayload(v.Value, payload):
		return fmt.Errorf("signal %s %s: %w", key, name, ErrSignalMismatch)
	}
	return nil
}

// samePayload reports whether two payloads are one: the same bytes, or
// the same JSON in another spelling (member order, spacing, 2.0 for 2),
// compared canonically as a job's parameters are (issue 38: a signal sent
// again from another language was refused as another payload).
func samePayload(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	fa, errA := etcdstore.FingerprintOf(a)
	fb, errB := etcdstore.FingerprintOf(b)
	return errA == nil && errB == nil && fa == fb
}

// eventCame reports whether event (of job id, created then) was
// signalled, in st (the store that holds the job); "" never was. An error
// reading it counts as not yet.
func (q *Queue) eventCame(ctx context.Context, st *etcdstore.Store, event, id string, created time.Time) bool {
	if event == "" {
		return false
	}
	v, err := storex.GetValue(st, ctx, eventName(q.tenant, id, created, event))
	return err == nil && v.Revision != 0
}
