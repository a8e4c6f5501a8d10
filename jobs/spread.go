package jobs

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/internal/storex"
)

// How work is spread. Every worker with a completer advertises itself: a
// value w/<tenant>/<owner>/<worker> on its session's lease (etcdstore.OnSession),
// naming its zone and kinds, gone when its session is. Each completer
// follows the adverts, and for every job it may take computes the job's
// preferred worker: among the workers of the job's kind in the zone that
// submitted it (or all of them when that zone has none), the one whose
// owner hashes highest with the job's id (rendezvous hashing: a worker
// that comes or goes moves only its own share). The preferred worker tries
// the job when it is due; another of its zone FallbackAfter later, one of
// another zone twice that. So a job runs once where it was submitted while
// that zone is up, the work of a zone is spread over its workers, and a
// job whose preferred worker is gone, stuck or cut off is still taken,
// late: the claim, not the preference, decides who runs it.

// DefaultFallbackAfter is how long a worker that is not a job's preferred
// waits before it tries the job itself.
const DefaultFallbackAfter = 2 * time.Second

// FallbackAfter sets how long this worker's completer waits, after a job
// is due, before it tries a job another worker is preferred for (default
// DefaultFallbackAfter; twice that for a job of another zone whose zone
// has workers). 0 turns spreading off: the worker tries every due job at
// once, racing the others.
func FallbackAfter(d time.Duration) WorkerOption {
	return func(w *Worker) error {
		if d < 0 {
			return fmt.Errorf("%w: fallback %v is negative", ErrInvalid, d)
		}
		w.fallback = d
		return nil
	}
}

// WorkerName names the worker in the rendezvous that picks each job's
// preferred worker (default: its session's owner id and a number, new at
// every start). A name that stays the same across restarts (a pod's name)
// gives a restarted worker back the same share of the jobs. Names must
// differ between the workers of one tenant: 1 to 128 bytes of visible
// ASCII.
func WorkerName(name string) WorkerOption {
	return func(w *Worker) error {
		if name == "" || len(name) > 128 {
			return fmt.Errorf("%w: worker name %q: 1 to 128 bytes", ErrInvalid, name)
		}
		for i := 0; i < len(name); i++ {
			if c := name[i]; c <= ' ' || c > '~' {
				return fmt.Errorf("%w: worker name %q: byte %#02x is not visible ASCII", ErrInvalid, name, c)
			}
		}
		w.name = name
		return nil
	}
}

// advert is what a worker says of itself.
type advert struct {
	Zone  string   `json:"zone,omitempty"`
	Kinds []string `json:"kinds"`
	Name  string   `json:"name,omitempty"` // WorkerName, if set
}

func (a advert) runs(kind string) bool { return slices.Contains(a.Kinds, kind) }

// advertPrefix starts the names of tenant's workers' adverts.
func advertPrefix(tenant string) string { return "w/" + tenant + "/" }

// advertise keeps this worker's advert written under its store's current
// session, until ctx ends; then deletes it.
func (c *completer) advertise(ctx context.Context) {
	kinds := make([]string, 0, len(c.w.kinds))
	for k := range c.w.kinds {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	val, _ := json.Marshal(advert{Zone: c.w.q.zone, Kinds: kinds, Name: c.w.name})
	var done string // the owner advertised under
	var rev int64
	name := func(owner string) string { return advertPrefix(c.w.q.tenant) + owner + "/" + c.idName() }
	defer func() {
		if done != "" {
			dctx, cancel := c.w.q.clock.WithTimeout(context.Background(), 5*time.Second)
			storex.DeleteValue(c.st, dctx, name(done), rev)
			cancel()
		}
	}()
	for fails := 0; ctx.Err() == nil; {
		owner := c.st.Owner()
		if owner != "" && owner != done {
			v, ok, err := storex.SetValue(c.st, ctx, name(owner), val, 0, storex.OnSession())
			switch {
			case err == nil && c.st.Owner() != owner:
				// The session changed between the two: the advert may be on
				// the new session's lease under the old owner. Take it back.
				if ok {
					storex.DeleteValue(c.st, ctx, name(owner), v.Revision)
				}
			case err == nil && (ok || string(v.Value) == string(val)):
				done, rev, fails = owner, v.Revision, 0
			case err == nil:
				fails++ // (another worker's advert under this name: cannot be)
			default:
				fails++
				c.w.log.Info("idem: a job worker could not advertise itself; others take its jobs after their fallback", "err", err)
			}
		}
		// The session changes rarely; a look a second costs no etcd call.
		wait := time.Second
		if fails > 0 {
			wait = min(time.Duration(100<<min(fails, 6))*time.Millisecond, 5*time.Second)
		}
		if clock.Sleep(c.w.q.clock, ctx, wait) != nil {
			return
		}
	}
}

// advertChanged notes a worker's advert written or gone, and reconsiders
// every job: its preferred worker may have changed.
func (c *completer) advertChanged(v *storex.Value) {
	owner := strings.TrimPrefix(v.Name, advertPrefix(c.w.q.tenant)) // owner/worker
	if v.Revision == 0 {
		delete(c.workers, owner)
	} else {
		var a advert
		if json.Unmarshal(v.Value, &a) != nil {
			return
		}
		c.workers[owner] = a
	}
	for _, e := range c.jobs {
		c.schedule(e)
	}
}

// fallbackFor returns how long after e is due this worker waits before it
// tries e: 0 when it is e's preferred worker (or spreading is off, or no
// worker of e's kind is known).
func (c *completer) fallbackFor(e *entry) time.Duration {
	if c.w.fallback == 0 || len(c.workers) == 0 {
		return 0
	}
	me := c.st.Owner() + "/" + c.idName()
	var best string
	var bestHash uint64
	zoned := false // the job's zone has workers of its kind
	for pass := 0; pass < 2 && best == ""; pass++ {
		for owner, a := range c.workers {
			if !a.runs(e.kind.Name) || pass == 0 && (e.zone == "" || a.Zone != e.zone) {
				continue
			}
			weight := owner
			if a.Name != "" {
				weight = a.Name
			}
			if h := rendezvous(e.id, weight); best == "" || h > bestHash || h == bestHash && owner > best {
				best, bestHash = owner, h
			}
		}
		zoned = zoned || pass == 0 && best != ""
	}
	switch {
	case best == "" || best == me:
		return 0
	case zoned && c.w.q.zone != e.zone:
		return 2 * c.w.fallback
	}
	return c.w.fallback
}

// rendezvous is the weight of a worker for a job.
func rendezvous(job, owner string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(job))
	h.Write([]byte{0})
	h.Write([]byte(owner))
	return h.Sum64()
}

// workerIDs numbers the live workers of each store, the smallest number
// free first: a worker's advert is named by its store's owner and this
// number, the same in every replay of a simulation (package explore),
// unlike a random name, on which the preferred workers would depend. The
// stores are held weakly: a worker never closed (its process died) must
// not keep its store, and all the store holds, alive. (Found when the
// explorer's memory grew by 30 MB a second: every store of every process
// it ever started, kept by this map.)
var workerIDs struct {
	sync.Mutex
	live map[weak.Pointer[etcdstore.Store]]map[int]bool
}

func workerID(s *etcdstore.Store) int {
	workerIDs.Lock()
	defer workerIDs.Unlock()
	if workerIDs.live == nil {
		workerIDs.live = map[weak.Pointer[etcdstore.Store]]map[int]bool{}
	}
	k := weak.Make(s)
	if workerIDs.live[k] == nil {
		workerIDs.live[k] = map[int]bool{}
		runtime.AddCleanup(s, func(k weak.Pointer[etcdstore.Store]) {
			workerIDs.Lock()
			defer workerIDs.Unlock()
			delete(workerIDs.live, k)
		}, k)
	}
	n := 1
	for workerIDs.live[k][n] {
		n++
	}
	workerIDs.live[k][n] = true
	return n
}

// freeWorkerID gives a closed worker's number back.
func freeWorkerID(s *etcdstore.Store, n int) {
	workerIDs.Lock()
	defer workerIDs.Unlock()
	delete(workerIDs.live[weak.Make(s)], n)
}

// idName is the worker's number as its advert names it.
func (c *completer) idName() string { return "w" + strconv.Itoa(c.id) }

// idName is the number of the worker's first completer's advert.
func (w *Worker) idName() string { return w.comp.idName() }
