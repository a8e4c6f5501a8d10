package jobs

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/fencing"
	"github.com/idem-dev/idem/internal/kernel"
	"github.com/idem-dev/idem/internal/storex"
)

// Limit bounds the attempts of the jobs that share a key: "at most 2 jobs
// of this customer at once", "at most 5 attempts a second per merchant".
// The key is a value of the job (Key reads it from its parameters), and
// the bound holds across every worker and data centre: it is kept in etcd.
//
// A concurrency limit is Concurrency slots per key, each one etcd value
// that an attempt claims (a compare-and-set on its create revision) before
// it runs a step and frees when it ends. A slot names the job and the
// fencing token of the claim that holds it; a slot whose claim can write
// nothing more (taken over, given back, ended) is free to take, so the
// slot of a worker that died is freed when its session is gone and its job
// is taken over, and a slot whose release was lost is freed by the next
// attempt that needs it. Since a job's steps commit only under their claim
// (fenced), no more than Concurrency jobs of one key ever commit step
// effects in the same span of time, whatever the faults.
//
// A rate limit is Burst slots per key, each the time from which it may be
// used again: an attempt takes a slot whose time has come and sets it
// Burst/Rate seconds on, so at most Burst attempts start in any Burst/Rate
// seconds. It is read on the clock of the worker that takes the slot
// (etcdstore.WithClock): clocks that disagree by d let up to Burst more
// through in a window of d. The slot is set a twentieth of Burst/Rate
// longer (at least 100 ms, at most a second), and an attempt whose slot's write took longer
// than that to come back (a slow reply, a pause) does not start: it waits
// for its slot's time, and the slot counts as used.
//
// A job that finds its key's slots taken is given back (the attempt is not
// counted) and tried again when a slot frees (its workers follow the slots)
// or, for a rate, when the next one's time comes. Kinds that share a
// limit's Name share its slots: give them the same numbers. Workers start
// the due jobs of different keys in turn, so one key with many jobs
// waiting does not hold the others back.
type Limit struct {
	// Name names the limit: 1 to 64 characters of [A-Za-z0-9._-].
	Name string
	// Key returns the job's key for this limit from its parameters ("":
	// the job is not limited). An error fails the job: its parameters say
	// nothing the limit can use; so does a panic (the error names it),
	// which never takes the worker's process down. ParamKey reads a field
	// of JSON parameters.
	Key func(params []byte) (string, error)
	// Concurrency is how many jobs of a key may run an attempt at once (0:
	// no bound), at most 1000.
	Concurrency int
	// Rate is how many attempts of a key may start per second (0: no
	// bound); Burst (default: Rate rounded up, at least 1; at most 1000)
	// how many may start at once.
	Rate  float64
	Burst int
}

// maxSlots bounds a limit's slots per key: a full key is read whole.
const maxSlots = 1000

// maxLimitKey bounds a key (its bytes, as Key returns it).
const maxLimitKey = 1024

// keySegment is a key as it is named in its slots' names: URL-escaped,
// or, past 128 bytes escaped, '#' and a SHA-256 of the key ('#' is never
// left unescaped, so the two cannot meet). The key itself is in every
// concurrency slot's value.
func keySegment(key string) string {
	if e := url.PathEscape(key); len(e) <= 128 {
		return e
	}
	sum := sha256.Sum256([]byte(key))
	return "#" + hex.EncodeToString(sum[:20])
}

// ParamKey returns a Limit.Key that reads field of the job's JSON
// parameters, a string or a number. A job without the field is not
// limited; parameters that are not a JSON object, or a field of another
// type, are an error.
func ParamKey(field string) func([]byte) (string, error) {
	return func(params []byte) (string, error) {
		if len(params) == 0 {
			return "", nil
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(params, &m); err != nil {
			return "", fmt.Errorf("parameters are not a JSON object: %v", err)
		}
		raw, ok := m[field]
		if !ok || string(raw) == "null" {
			return "", nil
		}
		var s string
		if err := json.Unmarshal(raw, &s); err == nil {
			return s, nil
		}
		var n json.Number
		if err := json.Unmarshal(raw, &n); err == nil {
			return n.String(), nil
		}
		return "", fmt.Errorf("field %q is %s, not a string or a number", field, raw)
	}
}

func (l *Limit) validate(kind string) error {
	switch {
	case validName(l.Name, 64, true) != nil:
		return fmt.Errorf("%w: kind %s: limit name %q: %v", ErrInvalid, kind, l.Name, validName(l.Name, 64, true))
	case l.Key == nil:
		return fmt.Errorf("%w: kind %s: limit %s has no Key", ErrInvalid, kind, l.Name)
	case l.Concurrency < 0 || l.Concurrency > maxSlots:
		return fmt.Errorf("%w: kind %s: limit %s: Concurrency %d must be 0 to %d", ErrInvalid, kind, l.Name, l.Concurrency, maxSlots)
	case l.Rate < 0 || math.IsNaN(l.Rate) || math.IsInf(l.Rate, 0):
		return fmt.Errorf("%w: kind %s: limit %s: Rate %v must be a number, 0 or more", ErrInvalid, kind, l.Name, l.Rate)
	case l.Burst < 0 || l.Burst > maxSlots:
		return fmt.Errorf("%w: kind %s: limit %s: Burst %d must be 0 to %d", ErrInvalid, kind, l.Name, l.Burst, maxSlots)
	case l.Concurrency == 0 && l.Rate == 0:
		return fmt.Errorf("%w: kind %s: limit %s bounds nothing: set Concurrency, Rate or both", ErrInvalid, kind, l.Name)
	case l.Rate > 0 && l.Rate < 1e-6:
		return fmt.Errorf("%w: kind %s: limit %s: Rate %v is under one a million seconds", ErrInvalid, kind, l.Name, l.Rate)
	}
	if l.Rate > 0 && l.Burst == 0 {
		l.Burst = max(1, int(math.Ceil(l.Rate)))
		if l.Burst > maxSlots {
			return fmt.Errorf("%w: kind %s: limit %s: Rate %v needs a Burst, at most %d", ErrInvalid, kind, l.Name, l.Rate, maxSlots)
		}
	}
	return nil
}

// period is how long a rate slot stays used.
func (l *Limit) period() time.Duration {
	return time.Duration(float64(l.Burst) / l.Rate * float64(time.Second))
}

// limitPrefix starts the names (among the store's values) of tenant's
// limits' slots: l/<tenant>/<limit>/<key, escaped>/{c,r}/<slot>.
func limitPrefix(tenant string) string { return "l/" + tenant + "/" }

// keyedLimit is one limit as it applies to one job: its key.
type keyedLimit struct {
	*Limit
	key string
}

// slots returns the prefix of the key's slots of kind c (concurrency) or r
// (rate).
func (kl keyedLimit) slots(tenant, kind string) string {
	return limitPrefix(tenant) + kl.Name + "/" + keySegment(kl.key) + "/" + kind + "/"
}

// label names the limit and key, for logs and a job's state.
func (kl keyedLimit) label() string { return kl.Name + "=" + kl.key }

// limitsOf returns the limits that apply to a job of kind k with params.
func (k *Kind) limitsOf(params []byte) ([]keyedLimit, error) {
	var out []keyedLimit
	for i := range k.Limits {
		l := &k.Limits[i]
		key, err := callLimitKey(l, params)
		if err != nil {
			return nil, fmt.Errorf("limit %s: the job's key: %w", l.Name, err)
		}
		if key == "" {
			continue
		}
		if len(key) > maxLimitKey {
			return nil, fmt.Errorf("limit %s: the job's key is %d bytes, limit %d", l.Name, len(key), maxLimitKey)
		}
		out = append(out, keyedLimit{l, key})
	}
	return out, nil
}

// holder is what a concurrency slot holds: the job and the token of the
// claim that took it.
type holder struct {
	Job   string `json:"job"`
	Token int64  `json:"token"`
	At    int64  `json:"at"`            // unix ms, for operators
	Key   string `json:"key,omitempty"` // the limit's key, for operators
}

// rateSlot is what a rate slot holds: when it may be used again.
type rateSlot struct {
	Until int64  `json:"until"` // unix ms
	Job   string `json:"job"`
}

// heldSlot is a concurrency slot an attempt holds (or may hold: its write's
// outcome was unknown), to free when the attempt ends.
type heldSlot struct {
	name  string
	value []byte
	rev   int64 // 0: unknown
}

// errLimited says an attempt found its key's slots taken: the job is
// given back until retry (for a rate, when a slot's time comes; for
// concurrency, a poll, unless a slot frees sooner).
type errLimited struct {
	label string
	retry time.Time
}

func (e *errLimited) Error() string { return "limited by " + e.label }

// acquire takes a slot of every limit of the attempt's job, in order.
// Slots it took (or may have taken) are in held, to release once the
// attempt ends, whatever acquire returns. An *errLimited says a limit was
// full; another error, that etcd could not say: either way the attempt
// runs nothing.
func (w *Worker) acquire(ctx context.Context, c *etcdstore.Claim, lims []keyedLimit, held *[]heldSlot) error {
	var late *errLimited // the rate slot that must be started by soonest
	var startBy time.Time
	for _, kl := range lims {
		if kl.Concurrency > 0 {
			if err := w.takeSlot(ctx, c, kl, held); err != nil {
				return err
			}
		}
	}
	// Rate slots last: the time to start by runs from the first one's
	// taking, and a full concurrency limit wastes none.
	for _, kl := range lims {
		if kl.Rate > 0 {
			by, until, err := w.takeRate(ctx, c, kl)
			if err != nil {
				return err
			}
			if startBy.IsZero() || by.Before(startBy) {
				startBy, late = by, &errLimited{label: kl.label() + rateSuffix, retry: until}
			}
		}
	}
	if now := w.q.clock.Now(); late != nil && kernel.RateLate(startBy, now) {
		// Its slot was set from a time this attempt is now too far past
		// to start in: the next attempt could take the slot less than a
		// period after this one starts. The slot counts as used.
		w.log.Info("idem: job's rate slot was taken too late to start in: the job waits for the slot's time",
			"job", c.Key().Digest(), "limit", late.label, "late_by", now.Sub(startBy), "until", late.retry)
		return late
	}
	return nil
}

// takeSlot takes one of kl's concurrency slots for claim c, as the
// kernel judges the slots read (JudgeSlots, Pick).
func (w *Worker) takeSlot(ctx context.Context, c *etcdstore.Claim, kl keyedLimit, held *[]heldSlot) error {
	prefix := kl.slots(w.q.tenant, "c")
	id, token := c.Key().ID, int64(c.Token())
	mine, _ := json.Marshal(holder{Job: id, Token: token, At: w.q.clock.Now().UnixMilli(), Key: kl.key})
	for try := 0; try < 8; try++ {
		vals, err := storex.Values(w.q.store, ctx, prefix)
		if err != nil {
			return fmt.Errorf("limit %s: reading its slots: %w", kl.label(), err)
		}
		byIndex, slots := slotsOf(prefix, vals)
		p := kernel.JudgeSlots(slots, id, token)
		switch {
		case p.Ours != nil:
			note(held, byIndex[p.Ours.Index]) // an earlier try whose reply was lost landed
			return nil
		case p.Later != 0:
			// A later claim of this job holds a slot: this claim was taken
			// over, and must take nothing.
			return fmt.Errorf("limit %s: %w: a later claim of the job (token %d) holds a slot", kl.label(), etcdstore.ErrFenced, p.Later)
		}
		if p.Full(kl.Concurrency) {
			// Full, as far as the names say: find which holders' claims
			// are over.
			for _, o := range p.Others {
				ok, err := storex.ClaimHeld(&w.q.store.Admin, ctx, w.q.Key(o.Job), fencing.Token(o.Token))
				if err != nil && !errors.Is(err, etcdstore.ErrInvalidArgument) {
					return fmt.Errorf("limit %s: reading a slot's job: %w", kl.label(), err)
				}
				if !ok {
					p.Stale = append(p.Stale, o)
				}
			}
		}
		i, rev, ok := p.Pick(kl.Concurrency)
		if p.Full(kl.Concurrency) || !ok {
			// Full, or holders above the bound (it was lowered) fill it.
			return &errLimited{label: kl.label(), retry: w.q.clock.Now().Add(limitPoll)}
		}
		name := prefix + strconv.Itoa(i)
		v, ok, err := storex.SetValue(w.q.store, ctx, name, mine, rev)
		switch {
		case err != nil && errors.Is(err, etcdstore.ErrUnavailable):
			// It may have landed: ours until we know (released later),
			// and the next try reads whether it did.
			*held = append(*held, heldSlot{name: name, value: mine})
			continue
		case err != nil:
			return fmt.Errorf("limit %s: %w", kl.label(), err)
		case ok:
			note(held, v)
			return nil
		}
		// Another took it first: look again.
	}
	return &errLimited{label: kl.label(), retry: w.q.clock.Now().Add(limitPoll)}
}

// slotsOf reads a limit key's concurrency slots (values under prefix) for
// the kernel, and returns them by index too.
func slotsOf(prefix string, vals []storex.Value) (map[int]storex.Value, []kernel.Slot) {
	byIndex := map[int]storex.Value{}
	var slots []kernel.Slot
	for _, v := range vals {
		i, err := strconv.Atoi(strings.TrimPrefix(v.Name, prefix))
		if err != nil || i < 0 {
			continue // not a slot
		}
		byIndex[i] = v
		var h holder
		s := kernel.Slot{Index: i, Rev: v.Revision}
		if json.Unmarshal(v.Value, &h) != nil {
			s.Damaged = true // nobody's
		} else {
			s.Job, s.Token = h.Job, h.Token
		}
		slots = append(slots, s)
	}
	return byIndex, slots
}

// note records a slot the attempt holds at a known revision.
func note(held *[]heldSlot, v storex.Value) {
	for i := range *held {
		if (*held)[i].name == v.Name {
			(*held)[i].rev, (*held)[i].value = v.Revision, v.Value
			return
		}
	}
	*held = append(*held, heldSlot{name: v.Name, value: v.Value, rev: v.Revision})
}

// limitPoll is how soon a job that found its key's slots taken is tried
// again if no slot's release wakes it first (a release that was lost, or
// a worker that does not follow the slots).
const limitPoll = 2 * time.Second

// takeRate takes one of kl's rate slots, on this worker's clock. The
// attempt must start by startBy (see kernel.RateSlack); the slot is used until
// until.
func (w *Worker) takeRate(ctx context.Context, c *etcdstore.Claim, kl keyedLimit) (startBy, until time.Time, err error) {
	prefix := kl.slots(w.q.tenant, "r")
	for try := 0; try < 8; try++ {
		vals, err := storex.Values(w.q.store, ctx, prefix)
		if err != nil {
			return time.Time{}, time.Time{}, fmt.Errorf("limit %s: reading its rate slots: %w", kl.label(), err)
		}
		now := w.q.clock.Now()
		var slots []kernel.RateSlot
		for _, v := range vals {
			i, err := strconv.Atoi(strings.TrimPrefix(v.Name, prefix))
			if err != nil || i < 0 {
				continue
			}
			var r rateSlot
			if json.Unmarshal(v.Value, &r) != nil {
				r.Until = 0 // unreadable: free
			}
			slots = append(slots, kernel.RateSlot{Index: i, Rev: v.Revision, Until: r.Until})
		}
		i, rev, soonest, ok := kernel.PickRate(slots, kl.Burst, now)
		if !ok {
			return time.Time{}, time.Time{}, &errLimited{label: kl.label() + rateSuffix, retry: soonest}
		}
		name := prefix + strconv.Itoa(i)
		slack := kernel.RateSlack(kl.period())
		until := now.Add(kl.period() + slack)
		val, _ := json.Marshal(rateSlot{Until: ceilMilli(until), Job: c.Key().ID})
		_, ok, err = storex.SetValue(w.q.store, ctx, name, val, rev, storex.Retained())
		switch {
		case err != nil && errors.Is(err, etcdstore.ErrUnavailable):
			// It may have landed: the slot counts as used (an outcome that
			// may have happened is treated as having happened), and this
			// attempt does not run.
			return time.Time{}, time.Time{}, fmt.Errorf("limit %s: taking a rate slot: %w", kl.label(), err)
		case err != nil:
			return time.Time{}, time.Time{}, fmt.Errorf("limit %s: %w", kl.label(), err)
		case ok:
			return now.Add(slack), until, nil
		}
	}
	return time.Time{}, time.Time{}, &errLimited{label: kl.label() + rateSuffix, retry: w.q.clock.Now().Add(limitPoll)}
}

// release frees the concurrency slots an attempt held, once its claim has
// ended. One whose revision is unknown (its write's reply was lost) is read
// first: freed if it holds this attempt. A release that fails leaves the
// slot to the next attempt that needs it, which finds its claim over.
func (w *Worker) release(held []heldSlot) {
	if len(held) == 0 {
		return
	}
	ctx, cancel := w.q.clock.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, h := range held {
		rev := h.rev
		if rev == 0 {
			v, err := storex.GetValue(w.q.store, ctx, h.name)
			if err != nil || v.Revision == 0 || string(v.Value) != string(h.value) {
				continue
			}
			rev = v.Revision
		}
		if _, err := storex.DeleteValue(w.q.store, ctx, h.name, rev); err != nil {
			w.log.Info("idem: a limit's slot was not released; the next job that needs it frees it", "slot", h.name, "err", err)
		}
	}
}

// limit takes the slots of the job's limits for attempt c; ok is false
// when the attempt must end as out and end say instead of running: its
// key's slots are taken (given back until one frees, not counted), etcd
// could not say (given back, tried again soon), or its parameters give no
// key (the job fails).
func (w *Worker) limit(ctx context.Context, c *etcdstore.Claim, st *state, k *Kind, held *[]heldSlot) (etcdstore.Outcome, etcdstore.End, bool) {
	if len(k.Limits) == 0 {
		return etcdstore.Outcome{}, 0, true
	}
	lims, err := k.limitsOf(st.Params)
	if err != nil {
		st.addError(w.errorOf(c, c.Takeovers()-st.Base, "", err))
		st.Outcome = Failed
		w.log.Info("idem: job failed: its limits", "job", c.Key().Digest(), "err", err)
		out, end := w.end(c, st, err.Error())
		return out, end, false
	}
	err = w.acquire(ctx, c, lims, held)
	if err == nil {
		return etcdstore.Outcome{}, 0, true
	}
	var lim *errLimited
	if errors.As(err, &lim) {
		st.NotBefore, st.Awaiting, st.Limited = ceilMilli(lim.retry), "", lim.label
		w.log.Debug("idem: job waits for a limit", "job", c.Key().Digest(), "limit", lim.label, "until", lim.retry)
	} else {
		st.NotBefore, st.Awaiting, st.Limited = ceilMilli(w.q.clock.Now().Add(time.Second)), "", ""
		w.log.Info("idem: job given back: its limits could not be read", "job", c.Key().Digest(), "err", err)
	}
	// The slots it took for the limits before are released with the
	// claim's end (execute).
	out, end := w.giveBack(ctx, c, st)
	return out, end, false
}

// Slot is one concurrency slot of a limit, held by a job's attempt.
type Slot struct {
	Limit string // the limit's name
	Key   string // the key the limit applies to (the merchant, the customer)
	Slot  int    // the slot's number, from 0
	Job   string // the job whose attempt holds it
	Token fencing.Token
	Since time.Time // when it was taken, on the taker's clock
}

// Slots returns the concurrency slots of the queue's limits that are held
// now: see the package function Slots.
func (q *Queue) Slots(ctx context.Context, limit string) ([]Slot, error) {
	if q.set != nil {
		return nil, nil // no limit runs on a shard set (NewWorker refuses kinds with limits)
	}
	return Slots(ctx, &q.store.Admin, q.tenant, limit)
}

// Slots returns the concurrency slots of tenant's limits that are held now
// (read linearizably), by limit, key and slot; limit "" lists every
// limit's. A slot whose attempt is over but was not released (its worker
// died, or its release was lost) is listed until the next attempt that
// needs it takes it.
func Slots(ctx context.Context, admin *etcdstore.Admin, tenant, limit string) ([]Slot, error) {
	if tenant == "" {
		tenant = DefaultTenant
	}
	prefix := limitPrefix(tenant)
	if limit != "" {
		if err := validName(limit, 64, true); err != nil {
			return nil, fmt.Errorf("slots: %w: limit name %q: %v", ErrInvalid, limit, err)
		}
		prefix += limit + "/"
	}
	vals, err := storex.Values(admin, ctx, prefix)
	if err != nil {
		return nil, fmt.Errorf("slots: %w", err)
	}
	var out []Slot
	for _, v := range vals {
		parts := strings.Split(strings.TrimPrefix(v.Name, limitPrefix(tenant)), "/")
		if len(parts) != 4 || parts[2] != "c" {
			continue // a rate's slot
		}
		key, err1 := url.PathUnescape(parts[1])
		n, err2 := strconv.Atoi(parts[3])
		var h holder
		if err2 != nil || json.Unmarshal(v.Value, &h) != nil {
			continue
		}
		if h.Key != "" || err1 != nil {
			key = h.Key // (a long key is named by its digest)
		}
		out = append(out, Slot{Limit: parts[0], Key: key, Slot: n, Job: h.Job, Token: fencing.Token(h.Token), Since: time.UnixMilli(h.At)})
	}
	slices.SortFunc(out, func(a, b Slot) int {
		return cmp.Or(cmp.Compare(a.Limit, b.Limit), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Slot, b.Slot))
	})
	return out, nil
}

// setRate notes a rate slot's time (a deletion: Revision 0) in rates, by
// its prefix (a limit and key).
func setRate(rates map[string]map[string]int64, v storex.Value) {
	i := strings.LastIndex(v.Name, "/r/")
	if i < 0 {
		return
	}
	prefix := v.Name[:i+3]
	var r rateSlot
	if v.Revision == 0 || json.Unmarshal(v.Value, &r) != nil {
		delete(rates[prefix], v.Name)
		if len(rates[prefix]) == 0 {
			delete(rates, prefix)
		}
		return
	}
	if rates[prefix] == nil {
		rates[prefix] = map[string]int64{}
	}
	rates[prefix][v.Name] = r.Until
}

// rateSlotsOf returns the prefixes of e's rate limits' slots.
func rateSlotsOf(tenant string, e *entry) []string {
	var out []string
	for _, kl := range e.limits {
		if kl.Rate > 0 {
			out = append(out, kl.slots(tenant, "r"))
		}
	}
	return out
}

// rateRoom returns the prefix of the first of e's rate limits whose slots,
// as the index shows them, are all used now or about to be (by attempts of
// its key this completer runs), and when the soonest is free again; "" when
// each has room.
func (c *completer) rateRoom(e *entry, now time.Time) (string, time.Time) {
	for _, kl := range e.limits {
		if kl.Rate == 0 {
			continue
		}
		prefix := kl.slots(c.w.q.tenant, "r")
		free, soonest := kl.Burst, time.Time{}
		for name, until := range c.rates[prefix] {
			if i, err := strconv.Atoi(strings.TrimPrefix(name, prefix)); err != nil || i >= kl.Burst {
				continue
			}
			if at := time.UnixMilli(until); at.After(now) {
				free--
				if soonest.IsZero() || at.Before(soonest) {
					soonest = at
				}
			}
		}
		if free-c.ratePending[prefix] > 0 {
			continue
		}
		if soonest.IsZero() {
			soonest = now.Add(limitPoll) // the running attempts' slots are not seen yet
		}
		return prefix, soonest
	}
	return "", time.Time{}
}

// callLimitKey calls a limit's Key function, turning a panic into an
// error naming it: a function that panics on one job's parameters fails
// that job, never the process (and every process that runs its kind).
func callLimitKey(l *Limit, params []byte) (key string, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("its Key function panicked: %v", v)
		}
	}()
	return l.Key(params)
}
