package explore

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"
)

// simWatcher is the clientv3.Watcher of a process's client in a
// simulation: its watches deliver what etcd sends only when the driver
// pumps them, and then everything up to the revision of that moment, so a
// store's watch-fed parts (the cache, the dictionary follower, a jobs
// completer, Wait) see the same events at the same steps in every replay.
//
// Underneath is one real etcd watch of the whole world (feed), on the
// world's fault-free client, which keeps every event of the world: a
// simulated watch takes from it the events of its key range from its start
// revision on.
//
// A pumped response reaches the store's reader (internal/watch) through an
// unbuffered channel, followed by an empty response (which the reader
// drops): when that second send completes, the first has been queued for
// the reader, which the driver then resumes by its clock's Wait.
type simWatcher struct {
	w *world
	p *process

	mu      sync.Mutex
	watches []*simWatch
	over    []*simWatch // watches that ended, closed by Close
}

type simWatch struct {
	out      chan clientv3.WatchResponse
	stream   string          // the stream it shares with others opened with the same metadata
	ctx      context.Context // the reader's
	key, end []byte          // its range: [key, end), or key alone when end is nil
	next     int64           // the revision of the next event it delivers
	wanted   atomic.Bool     // the reader asked for progress since the last pump
	done     atomic.Bool     // the reader's context ended (seen by a pump), or the watch broke: nothing more to send
	outDone  bool            // out is closed (under simWatcher.mu)
}

func (sw *simWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	md, _ := metadata.FromOutgoingContext(ctx)
	op := clientv3.OpGet(key, opts...)
	x := &simWatch{out: make(chan clientv3.WatchResponse), stream: fmt.Sprint(md), ctx: ctx, key: []byte(key), next: op.Rev()}
	if end := op.RangeBytes(); len(end) > 0 {
		x.end = end
	}
	if x.next == 0 {
		// From the next revision: nothing before the watch began.
		sw.w.mu.Lock()
		x.next = sw.w.lastWrite + 1
		sw.w.mu.Unlock()
	}
	sw.mu.Lock()
	sw.watches = append(sw.watches, x)
	sw.mu.Unlock()
	return x.out
}

func (x *simWatch) matches(key []byte) bool {
	if x.end == nil {
		return bytes.Equal(key, x.key)
	}
	return bytes.Compare(key, x.key) >= 0 && (string(x.end) == "\x00" || bytes.Compare(key, x.end) < 0)
}

// RequestProgress marks every watch of ctx's stream: the next pump sends
// each a progress notification, after every event up to its revision.
func (sw *simWatcher) RequestProgress(ctx context.Context) error {
	md, _ := metadata.FromOutgoingContext(ctx)
	stream := fmt.Sprint(md)
	sw.mu.Lock()
	defer sw.mu.Unlock()
	for _, x := range sw.watches {
		if x.stream == stream {
			x.wanted.Store(true)
		}
	}
	return nil
}

// progressWanted reports whether a watch asked for progress since the
// last pump.
func (sw *simWatcher) progressWanted() bool {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	for _, x := range sw.watches {
		if x.wanted.Load() && !x.done.Load() {
			return true
		}
	}
	return false
}

// Close ends every watch: its reader sees its channel closed. Call it
// only when no pump runs.
func (sw *simWatcher) Close() error {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	for _, x := range append(sw.watches, sw.over...) {
		x.done.Store(true)
		if !x.outDone {
			x.outDone = true
			close(x.out)
		}
	}
	sw.watches, sw.over = nil, nil
	return nil
}

// pump delivers every watch of the process what etcd holds of it up to
// rev (which the feed has caught up with), and the progress notifications
// asked for. With broken set, each watch is broken instead, as a
// compaction or a lost leader breaks one.
func (sw *simWatcher) pump(rev int64, broken bool) {
	sw.mu.Lock()
	watches := append([]*simWatch(nil), sw.watches...)
	sw.mu.Unlock()
	var live []*simWatch
	for _, x := range watches {
		if x.ctx.Err() != nil {
			x.done.Store(true) // its reader gave it up
		}
		if broken && !x.done.Load() {
			x.send(clientv3.WatchResponse{Header: &pb.ResponseHeader{Revision: rev}, Canceled: true, CompactRevision: rev})
			x.done.Store(true)
		}
		// A watch that is over is not closed here: its reader's queue
		// would get the close at a time real time decides. Close closes
		// them, with the process.
		if !x.done.Load() {
			live = append(live, x)
			x.pump(sw.w, rev)
		}
	}
	sw.mu.Lock()
	for _, x := range watches {
		if x.done.Load() {
			sw.over = append(sw.over, x)
		}
	}
	sw.watches = append(live, sw.watches[len(watches):]...)
	sw.mu.Unlock()
}

func (x *simWatch) pump(w *world, rev int64) {
	var events []*clientv3.Event
	for _, ev := range w.feed.since(x.next, rev) {
		if x.matches(ev.Kv.Key) {
			events = append(events, ev)
		}
	}
	x.next = rev + 1
	if len(events) > 0 && !x.send(clientv3.WatchResponse{Header: &pb.ResponseHeader{Revision: rev}, Events: events}) {
		return
	}
	if x.wanted.Swap(false) {
		w.ledger.hit("path:watch progress answered")
		x.send(clientv3.WatchResponse{Header: &pb.ResponseHeader{Revision: rev}})
	}
}

// send hands wr to the reader, then an empty response: when that has gone
// too, the reader has queued wr. It reports false when the reader is gone.
func (x *simWatch) send(wr clientv3.WatchResponse) bool {
	if traceCalls {
		fmt.Printf("send %s events=%d canceled=%v\n", x.key, len(wr.Events), wr.Canceled)
	}
	for _, r := range []clientv3.WatchResponse{wr, {}} {
		if x.ctx.Err() != nil {
			return false
		}
		select {
		case x.out <- r:
		case <-x.ctx.Done():
			return false
		}
	}
	return true
}

// feed is the world's one real watch: every event of its prefix, kept.
type feed struct {
	mu       sync.Mutex
	events   []*clientv3.Event
	progress int64         // the revision up to which it has every event
	arrived  chan struct{} // closed (and replaced) when it hears from etcd
	err      error
	cancel   context.CancelFunc
	ctx      context.Context
	admin    *clientv3.Client
}

var feeds atomic.Int64

func newFeed(admin *clientv3.Client, prefix string, from int64) *feed {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(metadata.AppendToOutgoingContext(context.Background(),
		"explore-feed", strconv.FormatInt(feeds.Add(1), 10))))
	f := &feed{arrived: make(chan struct{}), cancel: cancel, ctx: ctx, admin: admin, progress: from - 1}
	wch := admin.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(from))
	go func() {
		for wr := range wch {
			f.mu.Lock()
			if err := wr.Err(); err != nil && f.err == nil {
				f.err = err
			}
			f.events = append(f.events, wr.Events...)
			f.progress = max(f.progress, wr.Header.GetRevision())
			close(f.arrived)
			f.arrived = make(chan struct{})
			f.mu.Unlock()
		}
	}()
	return f
}

// revision returns the revision up to which the feed has every event.
func (f *feed) revision() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.progress
}

// catchUp waits until the feed has every event up to rev.
func (f *feed) catchUp(rev int64) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		f.mu.Lock()
		caught, err, arrived := f.progress >= rev, f.err, f.arrived
		f.mu.Unlock()
		switch {
		case err != nil:
			return fmt.Errorf("the world's watch broke: %w", err)
		case caught:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("the world's watch did not catch up with revision %d in 20 s", rev)
		}
		pctx, cancel := context.WithTimeout(f.ctx, 10*time.Millisecond)
		f.admin.RequestProgress(pctx)
		select {
		case <-arrived:
		case <-pctx.Done():
		}
		cancel()
	}
}

// since returns the events from revision from up to rev.
func (f *feed) since(from, rev int64) []*clientv3.Event {
	f.mu.Lock()
	defer f.mu.Unlock()
	i := sort.Search(len(f.events), func(i int) bool { return f.events[i].Kv.ModRevision >= from })
	j := sort.Search(len(f.events), func(i int) bool { return f.events[i].Kv.ModRevision > rev })
	if i >= j {
		return nil
	}
	return append([]*clientv3.Event(nil), f.events[i:j]...)
}

func (f *feed) close() { f.cancel() }
