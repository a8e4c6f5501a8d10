// Package idemtest is the conformance suite of idem's store contract
// (idem.Store), in the spirit of testing/fstest.TestFS: one call runs every
// promise of the contract against a store a test hands it.
//
// idem runs it in CI against *etcdstore.Store on one etcd member and on
// three (one of them cut off from the others, reads going to it), and
// against *shard.Store on one shard, on three, and in the middle of a
// hand-over. A service that wraps a store runs it too:
//
//	func TestConformance(t *testing.T) {
//		idemtest.TestStore(t, idemtest.Harness{Store: myWrapper{store}})
//	}
//
// Each promise is a subtest named after it (Promises lists them). Check
// runs them without a *testing.T and returns what failed, so that a test
// can show that a broken store fails the suite.
package idemtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-dev/idem"
	"github.com/idem-dev/idem/etcdstore"
)

// Harness is what the suite is handed.
type Harness struct {
	// Store is the store under test. The suite writes keys under tenants of
	// its own ("idemtest-" and a sequence number), and evicts nothing else.
	Store idem.Store
	// Other, if set, is a second store over the same records, as another
	// process would hold it: what one writes the other must see.
	Other idem.Store
	// Behind, if set (with Other), holds back the etcd member that Other
	// reads from (cuts it off, or delays it) and returns a function that
	// lets it catch up. The suite then checks that a record deleted through
	// Store is never replayed through Other, held back or not.
	Behind func(ctx context.Context) (catchUp func() error, err error)
	// Timeout bounds each promise (default one minute), and HeldTimeout
	// each call through Other while its member is held back (default 3 s).
	Timeout, HeldTimeout time.Duration
}

// Promise is one promise of the contract and its check.
type Promise struct {
	Name string // the subtest's name
	Says string // the promise, in one sentence
	// Needs says which Harness fields it needs beyond Store ("" none).
	Needs string
	check func(ctx context.Context, e *env) error
}

// Promises lists the contract's promises in the order the suite checks
// them.
func Promises() []Promise { return promises }

// TestStore runs every promise against h as a subtest of t. A promise whose
// harness fields are missing is reported as skipped, with the reason.
func TestStore(t *testing.T, h Harness) {
	t.Helper()
	if h.Store == nil {
		t.Fatal("idemtest: Harness.Store is nil")
	}
	for _, p := range promises {
		t.Run(p.Name, func(t *testing.T) {
			if !h.has(p.Needs) {
				t.Skipf("needs Harness.%s", p.Needs)
			}
			if err := h.run(p); err != nil {
				t.Errorf("%s: %v", p.Says, err)
			}
		})
	}
}

// Check runs every promise against h and returns an error naming each one
// that failed (nil when all held). Promises whose harness fields are
// missing are not run.
func Check(h Harness) error {
	if h.Store == nil {
		return errors.New("idemtest: Harness.Store is nil")
	}
	var errs []error
	for _, p := range promises {
		if !h.has(p.Needs) {
			continue
		}
		if err := h.run(p); err != nil {
			errs = append(errs, fmt.Errorf("%s (%s): %w", p.Name, p.Says, err))
		}
	}
	return errors.Join(errs...)
}

func (h Harness) has(needs string) bool {
	switch needs {
	case "Other":
		return h.Other != nil
	case "Behind":
		return h.Other != nil && h.Behind != nil
	}
	return true
}

var tenantSeq atomic.Int64

func (h Harness) run(p Promise) error {
	timeout := h.Timeout
	if timeout <= 0 {
		timeout = time.Minute
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	e := &env{h: h, tenant: "idemtest-" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36) + "-" + strconv.FormatInt(tenantSeq.Add(1), 10)}
	return p.check(ctx, e)
}

// env is one promise's run: its tenant, and helpers.
type env struct {
	h      Harness
	tenant string
	seq    int
}

func (e *env) key() etcdstore.Key {
	e.seq++
	return etcdstore.Key{Tenant: e.tenant, ID: "k" + strconv.Itoa(e.seq)}
}

func fp(params string) etcdstore.Fingerprint {
	f, err := etcdstore.FingerprintOf([]byte(params))
	if err != nil {
		panic(err) // FingerprintOf fails only on invalid JSON; the suite's params are not JSON
	}
	return f
}

// counted is a work that counts its runs and answers "run N".
type counted struct{ n atomic.Int64 }

func (c *counted) work(context.Context, *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
	n := c.n.Add(1)
	return etcdstore.Outcome{Status: 201, Body: []byte("run " + strconv.FormatInt(n, 10))}, etcdstore.EndSave
}

func (c *counted) runs() int64 { return c.n.Load() }

// fails is a work that fails every time it runs.
func fails(context.Context, *etcdstore.Claim) ([]byte, error) {
	return nil, errors.New("card declined")
}

var promises = []Promise{
	{Name: "RunOnce", Says: "a key's work runs once; every retry with its fingerprint replays the saved outcome byte for byte, with the saving claim's token", check: runOnce},
	{Name: "Mismatch", Says: "a key reused with another fingerprint is refused with ErrMismatch and its work does not run", check: mismatch},
	{Name: "HeldKeyConflicts", Says: "a key in flight under a live claim is refused with ErrConflict and its work does not run", check: heldConflicts},
	{Name: "Fencing", Says: "a released key is claimed again with a greater token, and the old claim's writes fail with ErrFenced", check: fenced},
	{Name: "Get", Says: "Get answers ErrNotFound for an absent key, and the record as the last write left it otherwise", check: get},
	{Name: "Wait", Says: "Wait returns a held key's record once its claim completes", check: wait},
	{Name: "Attach", Says: "a claim's Handle attaches from another store and completes the claim; a stale handle is ErrFenced", check: attach},
	{Name: "Evict", Says: "after Evict returns, Get answers ErrNotFound and the next request runs the work again; evicting an absent key is ErrNotFound", check: evict},
	{Name: "EvictIf", Says: "EvictIf deletes only the record written at the revision given, and answers true for a key that no store holds", check: evictIf},
	{Name: "Enqueue", Says: "Enqueue writes a job once: the same fingerprint finds it, another is ErrMismatch, and a claim takes it over with its data", check: enqueue},
	{Name: "Kinds", Says: "every record says what it is: a plain key (also one whose work failed, with its saved error) or a job", check: kinds},
	{Name: "List", Says: "List returns a tenant's live records in key order, page by page", check: list},
	{Name: "TooLarge", Says: "an outcome larger than MaxRecordSize fails with ErrTooLarge and is never replayed", check: tooLarge},
	{Name: "Retention", Says: "a record is kept at least the store's retention after its last write", check: retention},
	{Name: "OtherProcess", Says: "what one store saves another over the same records replays, and what one evicts the other runs again", Needs: "Other", check: otherProcess},
	{Name: "NoStaleReplay", Says: "a record deleted before a request began is never replayed, even through a store whose etcd member is held behind", Needs: "Behind", check: noStaleReplay},
}

func runOnce(ctx context.Context, e *env) error {
	s, k, w := e.h.Store, e.key(), &counted{}
	first, err := s.Run(ctx, k, fp("p"), w.work)
	if err != nil {
		return fmt.Errorf("first Run: %w", err)
	}
	if first.Replayed || w.runs() != 1 || string(first.Body) != "run 1" || first.Token <= 0 {
		return fmt.Errorf("first Run = %q replayed=%v token=%d after %d runs; want run 1, not replayed, a token", first.Body, first.Replayed, first.Token, w.runs())
	}
	for i := range 3 {
		again, err := s.Run(ctx, k, fp("p"), w.work)
		if err != nil {
			return fmt.Errorf("retry %d: %w", i, err)
		}
		if !again.Replayed || w.runs() != 1 || !bytes.Equal(again.Body, first.Body) || again.Status != first.Status || again.Token != first.Token {
			return fmt.Errorf("retry %d = %q status %d replayed=%v token %d, %d runs; want %q status %d replayed, token %d, 1 run",
				i, again.Body, again.Status, again.Replayed, again.Token, w.runs(), first.Body, first.Status, first.Token)
		}
	}
	return nil
}

func mismatch(ctx context.Context, e *env) error {
	s, w := e.h.Store, &counted{}
	done, held := e.key(), e.key()
	if _, err := s.Run(ctx, done, fp("p"), w.work); err != nil {
		return err
	}
	c, _, err := s.Claim(ctx, held, fp("p"))
	if err != nil {
		return err
	}
	defer c.Release(context.WithoutCancel(ctx))
	for _, k := range []etcdstore.Key{done, held} {
		if _, err := s.Run(ctx, k, fp("other"), w.work); !errors.Is(err, etcdstore.ErrMismatch) {
			return fmt.Errorf("Run of %s with another fingerprint = %v; want ErrMismatch", k, err)
		}
	}
	if w.runs() != 1 {
		return fmt.Errorf("work ran %d times; want once", w.runs())
	}
	return nil
}

func heldConflicts(ctx context.Context, e *env) error {
	s, k, w := e.h.Store, e.key(), &counted{}
	c, done, err := s.Claim(ctx, k, fp("p"))
	if err != nil || done != nil {
		return fmt.Errorf("Claim of a new key = %v, done %v; want a claim", err, done)
	}
	defer c.Release(context.WithoutCancel(ctx))
	_, err = s.Run(ctx, k, fp("p"), w.work)
	var ce *etcdstore.ConflictError
	if !errors.As(err, &ce) || !errors.Is(err, etcdstore.ErrConflict) || w.runs() != 0 {
		return fmt.Errorf("Run of a held key = %v after %d runs; want a *ConflictError and no run", err, w.runs())
	}
	return nil
}

func fenced(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	old, _, err := s.Claim(ctx, k, fp("p"))
	if err != nil {
		return err
	}
	handle := old.Handle()
	// The same claim, attached (as another process holding its handle
	// would): its writes after the release must be fenced.
	stale, err := s.Attach(ctx, handle)
	if err != nil {
		return fmt.Errorf("Attach: %w", err)
	}
	if err := old.Release(ctx); err != nil {
		return fmt.Errorf("Release: %w", err)
	}
	c, _, err := s.Claim(ctx, k, fp("p"))
	if err != nil {
		return fmt.Errorf("Claim after Release: %w", err)
	}
	if c.Token() <= handle.Token {
		return fmt.Errorf("token after a release = %d; want more than %d", c.Token(), handle.Token)
	}
	if err := stale.Complete(ctx, etcdstore.Outcome{Body: []byte("late")}); !errors.Is(err, etcdstore.ErrFenced) {
		return fmt.Errorf("the released claim's Complete = %v; want ErrFenced", err)
	}
	if err := c.Complete(ctx, etcdstore.Outcome{Body: []byte("mine")}); err != nil {
		return fmt.Errorf("the new claim's Complete: %w", err)
	}
	rec, err := s.Get(ctx, k)
	if err != nil || rec.State != etcdstore.Done || string(rec.Outcome.Body) != "mine" {
		return fmt.Errorf("record after the new claim completed = %+v, %v; want done with %q", rec, err, "mine")
	}
	return nil
}

func get(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	if rec, err := s.Get(ctx, k); !errors.Is(err, etcdstore.ErrNotFound) {
		return fmt.Errorf("Get of an absent key = %+v, %v; want ErrNotFound", rec, err)
	}
	c, _, err := s.Claim(ctx, k, fp("p"), etcdstore.WithAttempt("a1"))
	if err != nil {
		return err
	}
	rec, err := s.Get(ctx, k)
	if err != nil || rec.State != etcdstore.InFlight || rec.Key != k || rec.Fingerprint != fp("p") || rec.Attempt != "a1" || rec.Token != c.Token() {
		return fmt.Errorf("Get of a held key = %+v, %v; want in flight, attempt a1, token %d", rec, err, c.Token())
	}
	if err := c.Checkpoint(ctx, []byte("step 1")); err != nil {
		return err
	}
	if rec, err = s.Get(ctx, k); err != nil || string(rec.Checkpoint) != "step 1" {
		return fmt.Errorf("Get after a checkpoint = %+v, %v; want the checkpoint", rec, err)
	}
	if err := c.Complete(ctx, etcdstore.Outcome{Status: 200, Body: []byte("ok")}); err != nil {
		return err
	}
	rec, err = s.Get(ctx, k)
	if err != nil || rec.State != etcdstore.Done || rec.Outcome == nil || string(rec.Outcome.Body) != "ok" || rec.Outcome.Status != 200 || rec.Token != c.Token() {
		return fmt.Errorf("Get of a done key = %+v, %v; want done with its outcome and token %d", rec, err, c.Token())
	}
	if now := time.Now(); !rec.Expires.After(now) || rec.Created.After(now.Add(time.Minute)) {
		return fmt.Errorf("done record created %v, expires %v; want expiry in the future", rec.Created, rec.Expires)
	}
	return nil
}

func wait(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	c, _, err := s.Claim(ctx, k, fp("p"))
	if err != nil {
		return err
	}
	got := make(chan error, 1)
	var rec *etcdstore.Record
	go func() {
		var err error
		rec, err = s.Wait(ctx, k)
		got <- err
	}()
	if err := c.Complete(ctx, etcdstore.Outcome{Body: []byte("ok")}); err != nil {
		return err
	}
	if err := <-got; err != nil || rec.State != etcdstore.Done || string(rec.Outcome.Body) != "ok" {
		return fmt.Errorf("Wait = %+v, %v; want the done record", rec, err)
	}
	if rec, err := s.Wait(ctx, e.key()); !errors.Is(err, etcdstore.ErrNotFound) {
		return fmt.Errorf("Wait of an absent key = %+v, %v; want ErrNotFound", rec, err)
	}
	return nil
}

func attach(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	other := e.h.Other
	if other == nil {
		other = s
	}
	c, _, err := s.Claim(ctx, k, fp("p"), etcdstore.WithoutSession(), etcdstore.WithDeadline(time.Minute))
	if err != nil {
		return err
	}
	a, err := other.Attach(ctx, c.Handle())
	if err != nil {
		return fmt.Errorf("Attach: %w", err)
	}
	if err := a.Complete(ctx, etcdstore.Outcome{Body: []byte("attached")}); err != nil {
		return fmt.Errorf("the attached claim's Complete: %w", err)
	}
	res, err := s.Run(ctx, k, fp("p"), (&counted{}).work)
	if err != nil || !res.Replayed || string(res.Body) != "attached" {
		return fmt.Errorf("Run after the attached claim completed = %q replayed=%v, %v; want its outcome replayed", res.Body, res.Replayed, err)
	}
	if _, err := other.Attach(ctx, c.Handle()); !errors.Is(err, etcdstore.ErrFenced) {
		return fmt.Errorf("Attach of a completed claim's handle = %v; want ErrFenced", err)
	}
	return nil
}

func evict(ctx context.Context, e *env) error {
	s, k, w := e.h.Store, e.key(), &counted{}
	if _, err := s.Run(ctx, k, fp("p"), w.work); err != nil {
		return err
	}
	if err := s.Evict(ctx, k); err != nil {
		return fmt.Errorf("Evict: %w", err)
	}
	if rec, err := s.Get(ctx, k); !errors.Is(err, etcdstore.ErrNotFound) {
		return fmt.Errorf("Get after Evict = %+v, %v; want ErrNotFound", rec, err)
	}
	res, err := s.Run(ctx, k, fp("p"), w.work)
	if err != nil || res.Replayed || w.runs() != 2 || string(res.Body) != "run 2" {
		return fmt.Errorf("Run after Evict = %q replayed=%v, %d runs, %v; want the work run again", res.Body, res.Replayed, w.runs(), err)
	}
	if err := s.Evict(ctx, e.key()); !errors.Is(err, etcdstore.ErrNotFound) {
		return fmt.Errorf("Evict of an absent key = %v; want ErrNotFound", err)
	}
	// A held key evicted: its claim is fenced.
	held := e.key()
	c, _, err := s.Claim(ctx, held, fp("p"))
	if err != nil {
		return err
	}
	if err := s.Evict(ctx, held); err != nil {
		return fmt.Errorf("Evict of a held key: %w", err)
	}
	if err := c.Complete(ctx, etcdstore.Outcome{Body: []byte("late")}); !errors.Is(err, etcdstore.ErrFenced) {
		return fmt.Errorf("Complete of an evicted claim = %v; want ErrFenced", err)
	}
	return nil
}

func evictIf(ctx context.Context, e *env) error {
	s, k, w := e.h.Store, e.key(), &counted{}
	if gone, err := s.EvictIf(ctx, e.key(), 1); err != nil || !gone {
		return fmt.Errorf("EvictIf of a key that no store holds = %v, %v; want true (it has no record)", gone, err)
	}
	if _, err := s.Run(ctx, k, fp("p"), w.work); err != nil {
		return err
	}
	rec, err := s.Get(ctx, k)
	if err != nil {
		return err
	}
	if gone, err := s.EvictIf(ctx, k, rec.Revision-1); err != nil || gone {
		return fmt.Errorf("EvictIf at an older revision = %v, %v; want false, the record kept", gone, err)
	}
	if _, err := s.Get(ctx, k); err != nil {
		return fmt.Errorf("Get after a refused EvictIf: %w", err)
	}
	if gone, err := s.EvictIf(ctx, k, rec.Revision); err != nil || !gone {
		return fmt.Errorf("EvictIf at the record's revision = %v, %v; want true", gone, err)
	}
	if gone, err := s.EvictIf(ctx, k, rec.Revision); err != nil || !gone {
		return fmt.Errorf("EvictIf retried after it landed = %v, %v; want true", gone, err)
	}
	res, err := s.Run(ctx, k, fp("p"), w.work)
	if err != nil || res.Replayed || w.runs() != 2 {
		return fmt.Errorf("Run after EvictIf = %q replayed=%v, %d runs, %v; want the work run again", res.Body, res.Replayed, w.runs(), err)
	}
	return nil
}

func enqueue(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	rec, err := s.Enqueue(ctx, k, fp("p"), []byte("job data"))
	if err != nil {
		return fmt.Errorf("Enqueue: %w", err)
	}
	if rec.State != etcdstore.InFlight || rec.Owner != "" || string(rec.Checkpoint) != "job data" || rec.Kind != etcdstore.KindJob {
		return fmt.Errorf("Enqueue wrote %+v; want in flight, no owner, the data as its checkpoint, kind job", rec)
	}
	again, err := s.Enqueue(ctx, k, fp("p"), []byte("other data"))
	if err != nil || again.Revision != rec.Revision || string(again.Checkpoint) != "job data" {
		return fmt.Errorf("Enqueue again = %+v, %v; want the first record", again, err)
	}
	if _, err := s.Enqueue(ctx, k, fp("other"), nil); !errors.Is(err, etcdstore.ErrMismatch) {
		return fmt.Errorf("Enqueue with another fingerprint = %v; want ErrMismatch", err)
	}
	var seen []byte
	res, err := s.Run(ctx, k, fp("p"), func(_ context.Context, c *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		seen = c.LastCheckpoint()
		return etcdstore.Outcome{Body: []byte("ran")}, etcdstore.EndSave
	})
	if err != nil || res.Replayed || string(seen) != "job data" || res.Token <= rec.Token {
		return fmt.Errorf("Run of an enqueued key = %q replayed=%v token %d, saw %q, %v; want it run with the data, token above %d",
			res.Body, res.Replayed, res.Token, seen, err, rec.Token)
	}
	if rec, err := s.Get(ctx, k); err != nil || rec.Kind != etcdstore.KindJob {
		return fmt.Errorf("the job's record once done = %+v, %v; want kind job", rec, err)
	}
	return nil
}

func kinds(ctx context.Context, e *env) error {
	s := e.h.Store
	ok, failed, held := e.key(), e.key(), e.key()
	if _, err := s.Do(ctx, ok, []byte("p"), func(context.Context, *etcdstore.Claim) ([]byte, error) { return []byte("ok"), nil }); err != nil {
		return err
	}
	if _, err := s.Do(ctx, failed, []byte("p"), fails); err == nil {
		return errors.New("Do of a failing work returned no error")
	}
	c, _, err := s.Claim(ctx, held, fp("p"))
	if err != nil {
		return err
	}
	defer c.Release(context.WithoutCancel(ctx))
	for _, k := range []etcdstore.Key{ok, failed, held} {
		rec, err := s.Get(ctx, k)
		if err != nil {
			return err
		}
		if rec.Kind != etcdstore.KindKey {
			return fmt.Errorf("record of plain key %s says it is %q; want %q", k, rec.Kind, etcdstore.KindKey)
		}
		if k == failed && (rec.Outcome == nil || rec.Outcome.Err != "card declined") {
			return fmt.Errorf("the failed key's record = %+v; want its saved error", rec.Outcome)
		}
	}
	return nil
}

func list(ctx context.Context, e *env) error {
	s, w := e.h.Store, &counted{}
	var keys []etcdstore.Key
	for range 5 {
		k := e.key()
		keys = append(keys, k)
		if _, err := s.Run(ctx, k, fp("p"), w.work); err != nil {
			return err
		}
	}
	var got []etcdstore.Key
	var after *etcdstore.Key
	for pages := 0; ; pages++ {
		if pages > 10 {
			return fmt.Errorf("List did not end after %d pages: %v", pages, got)
		}
		page, err := s.List(ctx, e.tenant, etcdstore.ListOptions{Limit: 2, After: after})
		if err != nil {
			return fmt.Errorf("List: %w", err)
		}
		for _, r := range page {
			got = append(got, r.Key)
			if r.State != etcdstore.Done || r.Kind != etcdstore.KindKey {
				return fmt.Errorf("listed %s as %s, kind %q; want done, kind key", r.Key, r.State, r.Kind)
			}
		}
		if len(page) < 2 {
			break
		}
		after = &page[len(page)-1].Key
	}
	want := []etcdstore.Key{keys[0], keys[1], keys[2], keys[3], keys[4]}
	// Key order: k1 < k2 < ... < k5 (one digit each).
	if fmt.Sprint(got) != fmt.Sprint(want) {
		return fmt.Errorf("List = %v; want %v in key order", got, want)
	}
	return listEveryTenant(ctx, e, keys)
}

// listEveryTenant pages through every tenant's records (List with no
// tenant), where a tenant "t-b" sorts before "t" (etcd's byte order of
// "t-b/" and "t/"), and checks that each of the promise's records comes
// once, in key order.
func listEveryTenant(ctx context.Context, e *env, keys []etcdstore.Key) error {
	s := e.h.Store
	other := etcdstore.Key{Tenant: e.tenant + "-b", ID: "x"}
	if _, err := s.Run(ctx, other, fp("p"), (&counted{}).work); err != nil {
		return err
	}
	mine := map[etcdstore.Key]int{other: 0}
	for _, k := range keys {
		mine[k] = 0
	}
	var order []etcdstore.Key
	var after *etcdstore.Key
	for pages := 0; ; pages++ {
		if pages > 100000 {
			return errors.New("List of every tenant did not end")
		}
		page, err := s.List(ctx, "", etcdstore.ListOptions{Limit: 2, After: after})
		if err != nil {
			return fmt.Errorf("List of every tenant: %w", err)
		}
		for _, r := range page {
			if _, ok := mine[r.Key]; ok {
				mine[r.Key]++
				order = append(order, r.Key)
			}
		}
		if len(page) < 2 {
			break
		}
		after = &page[len(page)-1].Key
	}
	for k, n := range mine {
		if n != 1 {
			return fmt.Errorf("List of every tenant, page by page, returned %s %d times; want once (order seen: %v)", k, n, order)
		}
	}
	if want := append([]etcdstore.Key{other}, keys...); fmt.Sprint(order) != fmt.Sprint(want) {
		return fmt.Errorf("List of every tenant = %v; want %v (etcd's key order: %q before %q)", order, want, other.Tenant+"/", e.tenant+"/")
	}
	return nil
}

func tooLarge(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	big := bytes.Repeat([]byte{'x'}, s.MaxRecordSize()+1)
	// Incompressible enough: a store that compresses records must still
	// refuse what exceeds its limit before compression.
	for i := range big {
		big[i] = byte(i*7919>>3) ^ byte(i)
	}
	_, err := s.Run(ctx, k, fp("p"), func(context.Context, *etcdstore.Claim) (etcdstore.Outcome, etcdstore.End) {
		return etcdstore.Outcome{Body: big}, etcdstore.EndSave
	})
	if !errors.Is(err, etcdstore.ErrTooLarge) {
		return fmt.Errorf("Run saving %d bytes (limit %d) = %v; want ErrTooLarge", len(big), s.MaxRecordSize(), err)
	}
	res, err := s.Run(ctx, k, fp("p"), (&counted{}).work)
	if err == nil && res.Replayed && len(res.Body) > s.MaxRecordSize() {
		return errors.New("the outcome over the limit was replayed")
	}
	return nil
}

func retention(ctx context.Context, e *env) error {
	s, k := e.h.Store, e.key()
	r := s.Retention()
	if r <= 0 {
		return fmt.Errorf("Retention() = %v; want positive", r)
	}
	before := time.Now()
	if _, err := s.Run(ctx, k, fp("p"), (&counted{}).work); err != nil {
		return err
	}
	rec, err := s.Get(ctx, k)
	if err != nil {
		return err
	}
	// Millisecond precision, and clocks of one machine.
	if lo := before.Add(r).Add(-time.Millisecond); rec.Expires.Before(lo) {
		return fmt.Errorf("record expires %v; want at least retention %v after its write, %v", rec.Expires, r, lo)
	}
	return nil
}

func otherProcess(ctx context.Context, e *env) error {
	s, o, k, w := e.h.Store, e.h.Other, e.key(), &counted{}
	if _, err := s.Run(ctx, k, fp("p"), w.work); err != nil {
		return err
	}
	res, err := o.Run(ctx, k, fp("p"), w.work)
	if err != nil || !res.Replayed || string(res.Body) != "run 1" {
		return fmt.Errorf("the other store's Run = %q replayed=%v, %v; want run 1 replayed", res.Body, res.Replayed, err)
	}
	if err := o.Evict(ctx, k); err != nil {
		return err
	}
	res, err = s.Run(ctx, k, fp("p"), w.work)
	if err != nil || res.Replayed || w.runs() != 2 {
		return fmt.Errorf("Run after the other store evicted = %q replayed=%v, %d runs, %v; want the work run again", res.Body, res.Replayed, w.runs(), err)
	}
	return nil
}

// noStaleReplay: a key done, replayed through Other, deleted through
// Store (Evict, then EvictIf as a job's DedupWindow does) while Other's
// member is held behind: Other never replays it, held or caught up, and
// once caught up it runs the work again.
func noStaleReplay(ctx context.Context, e *env) error {
	s, o := e.h.Store, e.h.Other
	held := e.h.HeldTimeout
	if held <= 0 {
		held = 3 * time.Second
	}
	deletes := []struct {
		name string
		del  func(etcdstore.Key, *etcdstore.Record) error
	}{
		{"Evict", func(k etcdstore.Key, _ *etcdstore.Record) error { return s.Evict(ctx, k) }},
		{"EvictIf", func(k etcdstore.Key, r *etcdstore.Record) error {
			if gone, err := s.EvictIf(ctx, k, r.Revision); err != nil || !gone {
				return fmt.Errorf("EvictIf = %v, %v", gone, err)
			}
			return nil
		}},
	}
	for _, d := range deletes {
		k, w := e.key(), &counted{}
		if _, err := s.Run(ctx, k, fp("p"), w.work); err != nil {
			return err
		}
		// Other finds it (and learns that retries are frequent).
		for range 8 {
			if res, err := o.Run(ctx, k, fp("p"), w.work); err != nil || !res.Replayed {
				return fmt.Errorf("%s: Other's replay before the delete = %q replayed=%v, %v", d.name, res.Body, res.Replayed, err)
			}
		}
		rec, err := s.Get(ctx, k)
		if err != nil {
			return err
		}
		catchUp, err := e.h.Behind(ctx)
		if err != nil {
			return fmt.Errorf("hold Other's member behind: %w", err)
		}
		if err := d.del(k, rec); err != nil {
			catchUp()
			return fmt.Errorf("%s: %w", d.name, err)
		}
		hctx, cancel := context.WithTimeout(ctx, held)
		res, err := o.Run(hctx, k, fp("p"), w.work)
		cancel()
		if cerr := catchUp(); cerr != nil {
			return fmt.Errorf("catch Other's member up: %w", cerr)
		}
		if err == nil && res.Replayed {
			return fmt.Errorf("after %s returned, Other (held behind) replayed the deleted record %q", d.name, res.Body)
		}
		for w.runs() < 2 {
			res, err = o.Run(ctx, k, fp("p"), w.work)
			if err == nil && res.Replayed {
				return fmt.Errorf("after %s returned, Other (caught up) replayed %q with %d runs", d.name, res.Body, w.runs())
			}
			if ctx.Err() != nil {
				return fmt.Errorf("%s: Other never ran the work again: %v", d.name, err)
			}
		}
		if w.runs() != 2 {
			return fmt.Errorf("%s: the work ran %d times; want twice", d.name, w.runs())
		}
	}
	return nil
}
