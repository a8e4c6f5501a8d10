// Package dict keeps the zstd dictionaries that a store's records are
// compressed against. Saved outcomes of one service look alike (the same
// JSON field names, the same headers), and a record is too small to
// compress well on its own: a 1 KiB payment object compresses to about 640
// bytes alone, and to about 200 against a dictionary made of a few earlier
// outcomes.
//
// A dictionary is raw content: recent done records, concatenated. The
// first process that has saved enough of them (and later, one whose
// dictionary is older than the refresh interval) publishes one, and names
// it in <prefix>current with a compare-and-set, so that processes agree on
// one. A record names its dictionary's id; a process that meets an id it
// does not know reads the dictionary from etcd once.
//
// # How long a dictionary lives
//
// A dictionary is kept in etcd exactly as long as a record may name it,
// without any process deciding when to delete it: its content is stored
// once per retention lease that holds records compressed against it, at
// <prefix><id>/<lease>, on that lease. Before a process writes a record
// compressed against dictionary d onto lease l, it makes sure d's copy on l
// exists (create-if-absent, once per dictionary and lease). A record lives
// no longer than the lease it was last written on (its sweep deletes it
// before the lease is revoked; the lease's expiry deletes both at once), so
// the copy outlives every record that needs it, whatever retention the
// writing process had, and is deleted with the last of them. Copies of
// dictionaries that lost a publishing race, or that nobody writes with any
// more, go the same way.
//
// The content is raw response bodies: an outcome evicted by an operator
// may still be part of a dictionary until the leases of the records
// written with that dictionary end (at most the refresh interval, plus the
// retention, plus the leases' grace, after it was sampled).
package dict

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/clock"
	"github.com/idem-dev/idem/etcdstore/internal/send"
	"github.com/idem-dev/idem/internal/watch"

	"github.com/klauspost/compress/zstd"
)

const (
	// Min is the smallest body worth compressing.
	Min = 64
	// Samples and contentBytes are what a dictionary is made of.
	Samples      = 16
	contentBytes = 16 << 10
	// DefaultRefresh is how often a dictionary is replaced by one of more
	// recent outcomes.
	DefaultRefresh = 24 * time.Hour
	// maxDecoded bounds what a record may decompress to.
	maxDecoded = 4 << 20
	// maxEnsured bounds the leases this process remembers ensuring.
	maxEnsured = 64
)

// Errors of Decompress.
var (
	// ErrMissing is returned when a record names a dictionary that etcd
	// does not hold.
	ErrMissing = errors.New("compression dictionary not in etcd")
	// ErrRead wraps the error of an etcd read of a dictionary.
	ErrRead = errors.New("cannot read the compression dictionary")
	// ErrCorrupt wraps a dictionary or a frame that cannot be decoded.
	ErrCorrupt = errors.New("corrupt compressed record or dictionary")
	// ErrClosed is returned once the Set is closed.
	ErrClosed = errors.New("compression dictionaries closed")
)

// Config configures a Set.
type Config struct {
	Client *clientv3.Client
	Clock  clock.Clock
	Log    *slog.Logger
	// Send sends the Set's writes; nil for a Set that only reads.
	Send *send.Sender
	// Try prepares one etcd request's context.
	Try func(context.Context) (context.Context, context.CancelFunc)
	// Prefix is where dictionaries live: Prefix+"current" names the
	// current one, Prefix+"<id>/<lease>" are its copies.
	Prefix string
	// Lease returns the lease a new dictionary's first copy goes on: the
	// store's retention lease for now.
	Lease   func(ctx context.Context) (clientv3.LeaseID, error)
	Refresh time.Duration
}

// Set holds a prefix's dictionaries: the current one, for writing, and
// every one met, for reading.
type Set struct {
	cfg Config

	plainEnc *zstd.Encoder // no dictionary: id 0
	plainDec *zstd.Decoder

	// inUse is held (read) while an encoder or decoder runs, and by Close:
	// after Close, Compress declines and Decompress fails with ErrClosed.
	inUse  sync.RWMutex
	closed bool

	mu         sync.Mutex
	byID       map[uint32]*dictionary
	current    *dictionary // nil: none yet
	samples    [][]byte
	publishing bool
	ensured    map[clientv3.LeaseID]map[uint32]*ensure
	leases     []clientv3.LeaseID // ensured's keys, oldest first
	stats      Stats
}

type dictionary struct {
	id      uint32
	created time.Time
	value   []byte        // as stored: created time, then content
	enc     *zstd.Encoder // nil until this process writes with it
	dec     *zstd.Decoder
	content []byte
}

// ensure is one copy of a dictionary this process made sure of.
type ensure struct {
	ready chan struct{} // closed when ok is set
	ok    bool
}

// Stats count what a Set did.
type Stats struct {
	// Published counts dictionaries this process made current; Raced those
	// it wrote but another won; Copies the copies it wrote onto leases.
	Published, Raced, Copies int64
}

// New returns a Set.
func New(cfg Config) *Set {
	if cfg.Refresh <= 0 {
		cfg.Refresh = DefaultRefresh
	}
	enc, _ := zstd.NewWriter(nil, encoderOptions()...) // only bad options fail
	dec, _ := zstd.NewReader(nil, decoderOptions()...)
	return &Set{cfg: cfg, plainEnc: enc, plainDec: dec, byID: make(map[uint32]*dictionary),
		ensured: make(map[clientv3.LeaseID]map[uint32]*ensure)}
}

func encoderOptions(o ...zstd.EOption) []zstd.EOption {
	// A 64 KiB window: records are small, and a larger one costs megabytes
	// of tables per encoder (measured: 4.7 MiB with the default, 0.7 with
	// this, per concurrent encode).
	return append([]zstd.EOption{zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderCRC(false),
		zstd.WithZeroFrames(true), zstd.WithLowerEncoderMem(true), zstd.WithEncoderConcurrency(2),
		zstd.WithWindowSize(64 << 10)}, o...)
}

func decoderOptions(o ...zstd.DOption) []zstd.DOption {
	return append([]zstd.DOption{zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(maxDecoded), zstd.WithDecoderLowmem(true)}, o...)
}

// Stats returns the Set's counters.
func (d *Set) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.stats
}

func (d *Set) currentKey() string { return d.cfg.Prefix + "current" }

// copyKey is dictionary id's copy on lease l.
func (d *Set) copyKey(id uint32, l clientv3.LeaseID) string {
	return d.cfg.Prefix + strconv.FormatUint(uint64(id), 10) + "/" + strconv.FormatInt(int64(l), 16)
}

// zstdMagic starts every zstd frame; frames are stored without it.
var zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}

// Compress returns plain compressed, and the id of the dictionary it used
// (0: none), for a record that goes onto lease l: it makes sure first that
// the dictionary's copy on l exists (one Txn, the first time for each
// dictionary and lease); when it cannot, it compresses without one. It
// reports false, compressing nothing, once the Set is closed.
func (d *Set) Compress(ctx context.Context, plain []byte, l clientv3.LeaseID) (uint32, []byte, bool) {
	d.mu.Lock()
	cur := d.current
	d.mu.Unlock()
	enc, id := d.plainEnc, uint32(0)
	if cur != nil && d.ensure(ctx, cur, l) {
		enc, id = cur.enc, cur.id
	}
	d.inUse.RLock()
	defer d.inUse.RUnlock()
	if d.closed {
		return 0, nil, false
	}
	return id, enc.EncodeAll(plain, nil)[len(zstdMagic):], true
}

// ensure makes sure dict's copy on lease l exists, and reports whether it
// does.
func (d *Set) ensure(ctx context.Context, dict *dictionary, l clientv3.LeaseID) bool {
	if d.cfg.Send == nil || l == clientv3.NoLease {
		return false
	}
	d.mu.Lock()
	byLease := d.ensuredLocked(l)
	e := byLease[dict.id]
	mine := e == nil
	if mine {
		e = &ensure{ready: make(chan struct{})}
		byLease[dict.id] = e
	}
	d.mu.Unlock()
	if !mine {
		if d.cfg.Clock.Wait(ctx, e.ready) != nil {
			return false
		}
		return e.ok
	}
	key := d.copyKey(dict.id, l)
	var resp *clientv3.TxnResponse
	err := d.cfg.Send.Do(ctx, func(ctx context.Context) (err error) {
		resp, err = d.cfg.Client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, string(dict.value), clientv3.WithLease(l))).Commit()
		return err
	})
	d.mu.Lock()
	e.ok = err == nil
	if err == nil && resp.Succeeded {
		d.stats.Copies++
	}
	if !e.ok {
		delete(byLease, dict.id) // unknown or refused: try again next time
	}
	close(e.ready)
	d.mu.Unlock()
	return e.ok
}

// Forget drops what this process knows of copies on lease l: etcd no
// longer knows the lease.
func (d *Set) Forget(l clientv3.LeaseID) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.ensured, l)
}

// Decompress undoes Compress, reading dictionary id from etcd if this
// process has not met it. at, when not zero, is the revision a record was
// written at, for a record that may have been deleted since (a history, a
// backup): a dictionary no longer in etcd is read as it stood then.
func (d *Set) Decompress(ctx context.Context, id uint32, frame []byte, at int64) ([]byte, error) {
	frame = append(append(make([]byte, 0, len(zstdMagic)+len(frame)), zstdMagic...), frame...)
	dec := d.plainDec
	if id != 0 {
		dict, err := d.get(ctx, id, 0)
		if errors.Is(err, ErrMissing) && at > 0 {
			dict, err = d.get(ctx, id, at)
		}
		if err != nil {
			return nil, err
		}
		dec = dict.dec
	}
	d.inUse.RLock()
	defer d.inUse.RUnlock()
	if d.closed {
		return nil, ErrClosed
	}
	plain, err := dec.DecodeAll(frame, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	return plain, nil
}

// get returns dictionary id, from memory or from etcd (at revision at, or
// the current one): any copy of it, or the single key an idem 0.3 process
// wrote (<prefix><id>, no lease).
func (d *Set) get(ctx context.Context, id uint32, at int64) (*dictionary, error) {
	d.mu.Lock()
	dict := d.byID[id]
	d.mu.Unlock()
	if dict != nil {
		return dict, nil
	}
	ctx, cancel := d.cfg.Try(ctx)
	defer cancel()
	from := d.cfg.Prefix + strconv.FormatUint(uint64(id), 10)
	// "<id>" and "<id>/..." sort before "<id>0": ids are decimal.
	opts := []clientv3.OpOption{clientv3.WithRange(from + "0"), clientv3.WithLimit(1)}
	if at > 0 {
		opts = append(opts, clientv3.WithRev(at))
	}
	resp, err := d.cfg.Client.Get(ctx, from, opts...)
	if at > 0 && errors.Is(err, rpctypes.ErrCompacted) {
		return nil, fmt.Errorf("dictionary %d at revision %d: %w (compacted)", id, at, ErrMissing)
	}
	if err != nil {
		return nil, fmt.Errorf("dictionary %d: %w: %w", id, ErrRead, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, fmt.Errorf("dictionary %d: %w", id, ErrMissing)
	}
	return d.add(id, resp.Kvs[0].Value)
}

// add decodes a dictionary's stored value (created time, then content) and
// keeps it.
func (d *Set) add(id uint32, v []byte) (*dictionary, error) {
	ms, n := binary.Uvarint(v)
	if n <= 0 {
		return nil, fmt.Errorf("dictionary %d: %w: bad layout", id, ErrCorrupt)
	}
	content := bytes.Clone(v[n:])
	// The frames name no dictionary (id 0 in zstd's terms): the record's
	// own header does, in fewer bytes.
	dec, err := zstd.NewReader(nil, decoderOptions(zstd.WithDecoderDictRaw(0, content))...)
	if err != nil {
		return nil, fmt.Errorf("dictionary %d: %w: %v", id, ErrCorrupt, err)
	}
	dict := &dictionary{id: id, created: time.UnixMilli(int64(ms)), value: bytes.Clone(v), dec: dec, content: content}
	d.mu.Lock()
	defer d.mu.Unlock()
	if have := d.byID[id]; have != nil {
		dec.Close()
		return have, nil
	}
	d.byID[id] = dict
	return dict, nil
}

// use makes dict the one this process writes with.
func (d *Set) use(dict *dictionary) error {
	enc, err := zstd.NewWriter(nil, encoderOptions(zstd.WithEncoderDictRaw(0, dict.content))...)
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.current != nil && d.current.id == dict.id {
		enc.Close()
		return nil
	}
	if dict.enc == nil {
		dict.enc = enc
	} else {
		enc.Close()
	}
	d.current = dict
	return nil
}

// Load reads which dictionary is current and makes it this process's. It
// returns the revision of its read. A current dictionary whose copies are
// all gone (nobody wrote with it for a retention) is none.
func (d *Set) Load(ctx context.Context) (int64, error) {
	rctx, cancel := d.cfg.Try(ctx)
	defer cancel()
	resp, err := d.cfg.Client.Get(rctx, d.currentKey())
	if err != nil {
		return 0, err
	}
	rev := resp.Header.Revision
	if len(resp.Kvs) == 0 {
		return rev, nil
	}
	id, err := strconv.ParseUint(string(resp.Kvs[0].Value), 10, 32)
	if err != nil || id == 0 {
		return rev, fmt.Errorf("current dictionary %q: %w", resp.Kvs[0].Value, ErrCorrupt)
	}
	d.mu.Lock()
	same := d.current != nil && d.current.id == uint32(id)
	d.mu.Unlock()
	if same {
		return rev, nil
	}
	dict, err := d.get(ctx, uint32(id), 0)
	if errors.Is(err, ErrMissing) {
		return rev, nil // expired with its records: the next publish replaces it
	}
	if err != nil {
		return rev, err
	}
	return rev, d.use(dict)
}

// Follow watches which dictionary is current until ctx ends: a dictionary
// another process published becomes this one's at once. A broken watch
// starts again, after a read.
func (d *Set) Follow(ctx context.Context) {
	for try := 0; ctx.Err() == nil; try++ {
		rev, err := d.Load(ctx)
		if err != nil {
			d.cfg.Log.Debug("idem: reading the current compression dictionary", "err", err)
		} else {
			d.follow(ctx, rev)
		}
		if clock.Sleep(d.cfg.Clock, ctx, time.Duration(25<<min(try, 6))*time.Millisecond) != nil {
			return
		}
	}
}

// follow applies changes of the current dictionary after rev until the
// watch ends.
func (d *Set) follow(ctx context.Context, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	stream := watch.New(d.cfg.Clock)
	stream.Add(d.cfg.Client.Watch(wctx, d.currentKey(), clientv3.WithRev(rev+1)))
	for {
		r, err := stream.Next(ctx)
		if err != nil || r.Closed || r.Canceled || r.Err() != nil {
			return
		}
		if len(r.Events) > 0 {
			if _, err := d.Load(ctx); err != nil {
				d.cfg.Log.Debug("idem: reading the current compression dictionary", "err", err)
			}
		}
	}
}

// Sample offers a done record (what is compressed of it) as material for
// the next dictionary: wanted while there is none, or the current one is
// due for a refresh. Once there are enough, a publish runs as background
// work of the clock, under ctx.
func (d *Set) Sample(ctx context.Context, plain []byte) {
	if len(plain) < Min || d.cfg.Send == nil {
		return
	}
	d.mu.Lock()
	due := d.current == nil || d.cfg.Clock.Now().Sub(d.current.created) >= d.cfg.Refresh
	if !due || d.publishing {
		d.mu.Unlock()
		return
	}
	d.samples = append(d.samples, bytes.Clone(plain))
	if len(d.samples) < Samples {
		d.mu.Unlock()
		return
	}
	all := d.samples
	d.samples, d.publishing = nil, true
	old := d.current
	d.mu.Unlock()
	d.cfg.Clock.Go(ctx, "publish dictionary", func(ctx context.Context) {
		err := d.publish(ctx, all, old)
		d.mu.Lock()
		d.publishing = false
		d.mu.Unlock()
		if err != nil {
			d.cfg.Log.Warn("idem: publishing a compression dictionary", "err", err)
		}
	})
}

// publish writes a dictionary made of samples and makes it current unless
// another process replaced old first (then that one is used).
func (d *Set) publish(ctx context.Context, all [][]byte, old *dictionary) error {
	content := bytes.Join(all, nil)
	if len(content) > contentBytes {
		content = content[len(content)-contentBytes:] // the most recent
	}
	l, err := d.cfg.Lease(ctx)
	if err != nil {
		return err
	}
	created := d.cfg.Clock.Now()
	value := append(binary.AppendUvarint(nil, uint64(created.UnixMilli())), content...)
	var id uint32
	for id == 0 {
		if id = rand.Uint32(); id == 0 {
			continue
		}
		key := d.copyKey(id, l)
		var resp *clientv3.TxnResponse
		err := d.cfg.Send.Do(ctx, func(ctx context.Context) (err error) {
			resp, err = d.cfg.Client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
				Then(clientv3.OpPut(key, string(value), clientv3.WithLease(l))).Commit()
			return err
		})
		if err != nil {
			return err // a copy that landed is on a lease: it goes with it
		}
		if !resp.Succeeded {
			id = 0 // taken: draw another
		}
	}
	cond := clientv3.Compare(clientv3.CreateRevision(d.currentKey()), "=", 0)
	if old != nil {
		cond = clientv3.Compare(clientv3.Value(d.currentKey()), "=", strconv.FormatUint(uint64(old.id), 10))
	}
	var resp *clientv3.TxnResponse
	err = d.cfg.Send.Do(ctx, func(ctx context.Context) (err error) {
		resp, err = d.cfg.Client.Txn(ctx).If(cond).Then(clientv3.OpPut(d.currentKey(), strconv.FormatUint(uint64(id), 10))).Commit()
		return err
	})
	if err != nil {
		return err // the follower learns whether it landed
	}
	if !resp.Succeeded {
		// Another process published first: use its dictionary. Ours is
		// used by nobody, and goes with its lease.
		d.mu.Lock()
		d.stats.Raced++
		d.mu.Unlock()
		_, err := d.Load(ctx)
		return err
	}
	dict, err := d.add(id, value)
	if err != nil {
		return err
	}
	d.mu.Lock()
	d.stats.Published++
	d.ensuredLocked(l)[id] = &ensure{ready: closed, ok: true}
	d.mu.Unlock()
	return d.use(dict)
}

var closed = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// ensuredLocked returns the copies this process knows of on lease l; it
// remembers the latest maxEnsured leases.
func (d *Set) ensuredLocked(l clientv3.LeaseID) map[uint32]*ensure {
	m := d.ensured[l]
	if m == nil {
		m = make(map[uint32]*ensure)
		d.ensured[l] = m
		d.leases = append(d.leases, l)
		if len(d.leases) > maxEnsured {
			delete(d.ensured, d.leases[0])
			d.leases = d.leases[1:]
		}
	}
	return m
}

// Close releases the encoders' and decoders' goroutines, once those in use
// are done.
func (d *Set) Close() {
	d.inUse.Lock()
	defer d.inUse.Unlock()
	if d.closed {
		return
	}
	d.closed = true
	d.plainEnc.Close()
	d.plainDec.Close()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, dict := range d.byID {
		dict.dec.Close()
		if dict.enc != nil {
			dict.enc.Close()
		}
	}
}
