package etcdstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/klauspost/compress/zstd"
)

// Format 3 compresses a record with zstd, against a dictionary that every
// process of the prefix can read from etcd. Saved outcomes of one service
// look alike (the same JSON field names, the same headers), and a record
// is too small to compress well on its own: a 1 KiB payment object
// compresses to about 640 bytes alone, and to about 190 against a
// dictionary made of a few earlier outcomes (measured; docs/PERFORMANCE.md).
//
// The dictionary is raw content: recent done records (their metadata,
// headers and bodies), concatenated. The
// first process that has saved enough outcomes (and later, one whose
// dictionary is older than the refresh interval) publishes one at
// <prefix>z/<id>, with a create-if-absent Txn, and then names it in
// <prefix>z/current with a compare-and-set, so that processes agree on one.
// A record names its dictionary's id; a process that meets an id it does
// not know reads that dictionary from etcd once. A dictionary is written
// before any record names it, and deleted only once its successor is older
// than twice the retention (no record can name it then). A record is
// written compressed only when that saves space; otherwise it is format 2.

const (
	// compressMin is the smallest outcome body worth compressing.
	compressMin = 64
	// dictSamples and dictBytes are what a dictionary is made of.
	dictSamples = 16
	dictBytes   = 16 << 10
	// DefaultDictionaryRefresh is how often a dictionary is replaced by one
	// of more recent outcomes.
	DefaultDictionaryRefresh = 24 * time.Hour
)

// dictionaries holds a prefix's dictionaries: the current one, for writing,
// and every one met, for reading.
type dictionaries struct {
	client  *clientv3.Client
	ks      keyspace
	timeout time.Duration
	refresh time.Duration
	// retention is the store's, for pruning; 0 (an Admin): never prune.
	retention time.Duration
	now       func() time.Time
	log       *slog.Logger

	plainEnc *zstd.Encoder // no dictionary: id 0
	plainDec *zstd.Decoder

	mu         sync.Mutex
	byID       map[uint32]*dictionary
	current    *dictionary // nil: none yet
	samples    [][]byte
	publishing bool
}

type dictionary struct {
	id      uint32
	created time.Time
	enc     *zstd.Encoder // nil until this process writes with it
	dec     *zstd.Decoder
	content []byte
}

// maxDecoded bounds what a record may decompress to.
const maxDecoded = 4 << 20

func newDictionaries(client *clientv3.Client, ks keyspace, timeout time.Duration, log *slog.Logger, now func() time.Time) *dictionaries {
	enc, _ := zstd.NewWriter(nil, encoderOptions()...) // only bad options fail
	dec, _ := zstd.NewReader(nil, decoderOptions()...)
	return &dictionaries{client: client, ks: ks, timeout: max(timeout, time.Second), refresh: DefaultDictionaryRefresh, now: now, log: log,
		plainEnc: enc, plainDec: dec, byID: make(map[uint32]*dictionary)}
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

func (d *dictionaries) dictKey(id uint32) string {
	return d.ks.prefix + "z/" + strconv.FormatUint(uint64(id), 10)
}
func (d *dictionaries) currentKey() string { return d.ks.prefix + "z/current" }

// compress returns plain compressed, and the id of the dictionary it used
// (0: none).
func (d *dictionaries) compress(plain []byte) (uint32, []byte) {
	d.mu.Lock()
	cur := d.current
	d.mu.Unlock()
	enc, id := d.plainEnc, uint32(0)
	if cur != nil {
		enc, id = cur.enc, cur.id
	}
	// The frame's magic number is the same in every frame: it is left out,
	// and put back to decode.
	return id, enc.EncodeAll(plain, nil)[len(zstdMagic):]
}

// zstdMagic starts every zstd frame.
var zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}

// decompress undoes compress, reading dictionary id from etcd if this
// process has not met it.
func (d *dictionaries) decompress(id uint32, frame []byte) ([]byte, error) {
	frame = append(append(make([]byte, 0, len(zstdMagic)+len(frame)), zstdMagic...), frame...)
	if id == 0 {
		return d.plainDec.DecodeAll(frame, nil)
	}
	dict, err := d.get(id)
	if err != nil {
		return nil, err
	}
	return dict.dec.DecodeAll(frame, nil)
}

// get returns dictionary id, from memory or from etcd.
func (d *dictionaries) get(id uint32) (*dictionary, error) {
	d.mu.Lock()
	dict := d.byID[id]
	d.mu.Unlock()
	if dict != nil {
		return dict, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), d.timeout)
	defer cancel()
	resp, err := d.client.Get(clientv3.WithRequireLeader(ctx), d.dictKey(id))
	if err != nil {
		return nil, fmt.Errorf("%w: reading dictionary %d: %w", ErrUnavailable, id, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, fmt.Errorf("%w: dictionary %d is not in etcd", ErrCorrupt, id)
	}
	return d.add(id, resp.Kvs[0].Value)
}

// add decodes a dictionary's stored value (created time, then content) and
// keeps it.
func (d *dictionaries) add(id uint32, v []byte) (*dictionary, error) {
	ms, n := binary.Uvarint(v)
	if n <= 0 {
		return nil, fmt.Errorf("%w: dictionary %d: bad layout", ErrCorrupt, id)
	}
	content := bytes.Clone(v[n:])
	// The frames name no dictionary (id 0 in zstd's terms): the record's
	// own header does, in fewer bytes.
	dec, err := zstd.NewReader(nil, decoderOptions(zstd.WithDecoderDictRaw(0, content))...)
	if err != nil {
		return nil, fmt.Errorf("%w: dictionary %d: %w", ErrCorrupt, id, err)
	}
	dict := &dictionary{id: id, created: time.UnixMilli(int64(ms)), dec: dec, content: content}
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
func (d *dictionaries) use(dict *dictionary) error {
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

// load reads which dictionary is current and makes it this process's.
func (d *dictionaries) load(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	resp, err := d.client.Get(clientv3.WithRequireLeader(ctx), d.currentKey())
	if err != nil || len(resp.Kvs) == 0 {
		return err
	}
	id, err := strconv.ParseUint(string(resp.Kvs[0].Value), 10, 32)
	if err != nil {
		return fmt.Errorf("%w: current dictionary %q", ErrCorrupt, resp.Kvs[0].Value)
	}
	d.mu.Lock()
	same := d.current != nil && d.current.id == uint32(id)
	d.mu.Unlock()
	if same {
		return nil
	}
	dict, err := d.get(uint32(id))
	if err != nil {
		return err
	}
	return d.use(dict)
}

// sample offers a done record (what format 3 compresses of it) as material
// for the next dictionary:
// wanted while there is none, or the current one is due for a refresh.
func (d *dictionaries) sample(body []byte) {
	if len(body) < compressMin {
		return
	}
	d.mu.Lock()
	due := d.current == nil || d.now().Sub(d.current.created) >= d.refresh
	if !due || d.publishing {
		d.mu.Unlock()
		return
	}
	d.samples = append(d.samples, bytes.Clone(body))
	if len(d.samples) < dictSamples {
		d.mu.Unlock()
		return
	}
	samples := d.samples
	d.samples, d.publishing = nil, true
	old := d.current
	d.mu.Unlock()
	go func() {
		err := d.publish(samples, old)
		d.mu.Lock()
		d.publishing = false
		d.mu.Unlock()
		if err != nil {
			d.log.Warn("idem: publishing a compression dictionary", "err", err)
		}
	}()
}

// publish writes a dictionary made of samples and makes it current unless
// another process replaced old first (then that one is used).
func (d *dictionaries) publish(samples [][]byte, old *dictionary) error {
	content := bytes.Join(samples, nil)
	if len(content) > dictBytes {
		content = content[len(content)-dictBytes:] // the most recent
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*d.timeout)
	defer cancel()
	ctx = clientv3.WithRequireLeader(ctx)
	var id uint32
	created := d.now()
	value := append(binary.AppendUvarint(nil, uint64(created.UnixMilli())), content...)
	for id == 0 {
		if id = rand.Uint32(); id == 0 {
			continue
		}
		resp, err := d.client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(d.dictKey(id)), "=", 0)).
			Then(clientv3.OpPut(d.dictKey(id), string(value))).Commit()
		if err != nil {
			return err
		}
		if !resp.Succeeded {
			id = 0 // taken: draw another
		}
	}
	cond := clientv3.Compare(clientv3.CreateRevision(d.currentKey()), "=", 0)
	if old != nil {
		cond = clientv3.Compare(clientv3.Value(d.currentKey()), "=", strconv.FormatUint(uint64(old.id), 10))
	}
	resp, err := d.client.Txn(ctx).If(cond).Then(clientv3.OpPut(d.currentKey(), strconv.FormatUint(uint64(id), 10))).Commit()
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		// Another process published first: use its dictionary, drop ours.
		_, _ = d.client.Delete(ctx, d.dictKey(id))
		return d.load(ctx)
	}
	dict, err := d.add(id, value)
	if err != nil {
		return err
	}
	if err := d.use(dict); err != nil {
		return err
	}
	return d.prune(ctx, dict)
}

// prune deletes the dictionaries no record can name any more: those whose
// successor is older than twice the retention. Records live at most a
// retention (plus a bucket) after their last write, and a process writes
// with a dictionary only while it is current.
func (d *dictionaries) prune(ctx context.Context, current *dictionary) error {
	retention := d.retention
	if retention <= 0 || current == nil {
		return nil
	}
	resp, err := d.client.Get(ctx, d.ks.prefix+"z/", clientv3.WithPrefix())
	if err != nil {
		return err
	}
	type entry struct {
		key     string
		created time.Time
	}
	var all []entry
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		if k == d.currentKey() || !strings.HasPrefix(k, d.ks.prefix+"z/") {
			continue
		}
		ms, n := binary.Uvarint(kv.Value)
		if n <= 0 {
			continue
		}
		all = append(all, entry{k, time.UnixMilli(int64(ms))})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].created.Before(all[j].created) })
	for i := 0; i+1 < len(all); i++ {
		if all[i].key == d.dictKey(current.id) {
			continue
		}
		if d.now().Sub(all[i+1].created) > 2*retention {
			if _, err := d.client.Delete(ctx, all[i].key); err != nil {
				return err
			}
		}
	}
	return nil
}

// close releases the encoders' and decoders' goroutines.
func (d *dictionaries) close() {
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
