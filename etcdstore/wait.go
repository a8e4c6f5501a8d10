package etcdstore

import (
	"go.opentelemetry.io/otel/trace"

	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/internal/watch"
)

// Wait blocks, on an etcd Watch, until key is no longer in flight under a
// live owner, and returns its record then:
//
//   - done: the record, with the Outcome to replay;
//   - in flight but stale (its owner died, its deadline passed, or it was
//     abandoned): the record; claim the key to take it over;
//   - gone (released, evicted, expired) or never claimed: ErrNotFound.
//
// It returns early with ctx's error. Wait does not compare fingerprints:
// claim with the request's fingerprint to get a replay or a mismatch.
func (s *Store) Wait(ctx context.Context, key Key) (rec *Record, err error) {
	if err := key.Validate(); err != nil {
		return nil, fmt.Errorf("wait: %w", err)
	}
	if s.tracer != nil {
		var sp trace.Span
		ctx, sp = s.startSpan(ctx, "idem.wait", key)
		defer func() {
			if err != nil && !errors.Is(err, ErrNotFound) && ctx.Err() == nil {
				s.endSpanErr(sp, err, key)
				return
			}
			state := "gone"
			if err != nil && ctx.Err() != nil {
				state = "timeout"
			}
			if rec != nil {
				state = string(rec.State)
			}
			sp.SetAttributes(AttrOutcome.String(state))
			sp.End()
		}()
	}
	cur, rev, err := s.get(ctx, key)
	if err != nil {
		return nil, err
	}
	for {
		now := s.now()
		ownerRev := rev
		switch {
		case cur == nil || cur.expired(now):
			return nil, fmt.Errorf("wait %s: %w", key, ErrNotFound)
		case cur.State == Done, cur.Owner == "":
			return cur, nil
		case s.runningHere(key, cur.Attempt):
			// Running in this process: the owner is alive by definition,
			// whatever its deadline (as a claim judges it: the kernel's
			// "held here" comes before "past its deadline").
		case cur.pastDeadline(now):
			return cur, nil
		default:
			alive, r, err := s.ownerAlive(ctx, cur.Owner)
			if err != nil {
				return nil, unavailable("wait", key, err)
			}
			if !alive {
				return cur, nil
			}
			ownerRev = r
		}
		cur, rev, err = s.awaitChange(ctx, key, cur, rev, ownerRev)
		if err != nil {
			return nil, err
		}
	}
}

// awaitChange blocks until the record changes from cur (it returns the new
// record, or nil when deleted), cur's owner key is deleted, or cur's
// deadline passes (it returns cur unchanged in those two cases), with the
// revision the answer reflects. seenRev is the revision at which cur was
// read and ownerRev one at which its owner was seen alive: watches start
// just after them, so no change in between is missed, and a record whose
// last write was compacted away can still be watched.
func (s *Store) awaitChange(ctx context.Context, k Key, cur *Record, seenRev, ownerRev int64) (*Record, int64, error) {
	// WithRequireLeader: a member cut off from the leader ends the watch
	// instead of leaving it silent forever.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	ekey := s.ks.record(k)
	from := max(cur.Revision, seenRev) + 1
	stream := watch.New(s.clock)
	recW := stream.Add(s.client.Watch(wctx, ekey, clientv3.WithRev(from)))
	if cur.Owner != "" && cur.Owner != deadlineOwner {
		stream.Add(s.client.Watch(wctx, s.ks.owner(cur.Owner), clientv3.WithRev(max(ownerRev, seenRev)+1)))
	}
	until := ctx // ends at cur's deadline too
	if !cur.Deadline.IsZero() {
		wake := cur.Deadline.Sub(s.now())
		if wake <= 0 {
			// Past it, and held here (Wait's caller waits only then): look
			// again soon, the claim ends here by its deadline.
			wake = time.Second
		}
		var stop context.CancelFunc
		until, stop = s.clock.WithTimeout(ctx, wake)
		defer stop()
	}
	if testHookAwait != nil {
		testHookAwait()
	}
	for {
		r, err := stream.Next(until)
		switch {
		case ctx.Err() != nil:
			return nil, 0, fmt.Errorf("wait %s: %w", k, context.Cause(ctx))
		case err != nil:
			return cur, seenRev, nil // the deadline passed
		case r.Closed || r.Canceled || r.Err() != nil:
			return s.afterWatchEnded(ctx, k, r.WatchResponse, !r.Closed)
		case r.Watch == recW:
			if n := len(r.Events); n > 0 {
				ev := r.Events[n-1]
				if ev.Type == mvccpb.DELETE {
					return nil, ev.Kv.ModRevision, nil
				}
				rec, err := s.decode(ctx, k, ev.Kv)
				return rec, ev.Kv.ModRevision, err
			}
		default:
			for _, ev := range r.Events {
				if ev.Type == mvccpb.DELETE {
					return cur, seenRev, nil // its owner died
				}
			}
		}
	}
}

// testHookAwait, when set by a test, is called once awaitChange's watches
// are open: events from then on cannot be missed.
var testHookAwait func()

// afterWatchEnded turns a watch that stopped into a result: a compacted
// start revision means history was dropped, so read the record again; any
// other end is the context's or etcd's.
func (s *Store) afterWatchEnded(ctx context.Context, k Key, wr clientv3.WatchResponse, ok bool) (*Record, int64, error) {
	if ctx.Err() != nil {
		return nil, 0, fmt.Errorf("wait %s: %w", k, context.Cause(ctx))
	}
	if ok && wr.CompactRevision != 0 {
		// History was compacted: read again, and watch from that read on.
		return s.get(ctx, k)
	}
	if errors.Is(wr.Err(), rpctypes.ErrNoLeader) && s.backoff(ctx, 1) {
		// The watch met a member cut off from the leader. A read goes to a
		// member that has one; the caller then watches again.
		return s.get(ctx, k)
	}
	err := wr.Err()
	if err == nil {
		err = fmt.Errorf("watch closed")
	}
	return nil, 0, unavailable("wait", k, err)
}
