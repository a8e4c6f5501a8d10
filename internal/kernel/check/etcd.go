package check

import (
	"errors"
	"slices"
	"strings"

	"github.com/idem-dev/idem/internal/etcdmodel"
	"github.com/idem-dev/idem/internal/kernel"
)

// The model's shell: what etcdstore does with the kernel's Txns (encode
// records, pick their leases, send, read the answer), done on the model.

// codec encodes records as their canonical state and decodes them back:
// a value's bytes name one record, kept in a table shared by every world
// of an exploration (records never change).
type codec struct{ recs map[string]*kernel.Record }

func newCodec() *codec { return &codec{recs: map[string]*kernel.Record{}} }

func (c *codec) encode(r *kernel.Record) []byte {
	if o := r.Outcome; o != nil && len(o.Header) > 0 {
		// As etcdstore's codec: a header name with no values is not kept.
		n := *r
		oc := *o
		oc.Header = map[string][]string{}
		for k, vs := range o.Header {
			if len(vs) > 0 {
				oc.Header[k] = vs
			}
		}
		n.Outcome, r = &oc, &n
	}
	v := r.AppendState([]byte{'R'})
	if _, ok := c.recs[string(v)]; !ok {
		c.recs[string(v)] = r
	}
	return v
}

// decode is the record a key holds, as etcdstore decodes it: its revision
// and lease are the key's, and a token of 0 is the revision of its claim's
// write.
func (c *codec) decode(kv etcdmodel.KV) *kernel.Record {
	r := c.recs[string(kv.Value)]
	if r == nil {
		return nil
	}
	d := *r
	d.Revision, d.Lease = kv.ModRev, kv.Lease
	if d.Token == 0 {
		d.Token = kernel.TokenOf(d.Epoch, kv.ModRev)
	}
	return &d
}

// read returns key's record on cluster cl (nil: absent) and the revision
// of the read.
func (x *explorer) read(w *world, cl int, key string) (*kernel.Record, int64) {
	kv, ok := w.db(cl).Get(key)
	if !ok {
		return nil, w.db(cl).Rev()
	}
	return x.codec.decode(kv), w.db(cl).Rev()
}

// lower makes t a Txn the model runs: records encoded, leases named.
func (x *explorer) lower(w *world, p *proc, cl int, t *kernel.Txn) *kernel.Txn {
	l := &kernel.Txn{If: t.If, Else: t.Else, Then: make([]kernel.Op, len(t.Then))}
	for i, op := range t.Then {
		switch {
		case op.Kind == kernel.Nested:
			op.Txn = x.lower(w, p, cl, op.Txn)
		case op.Kind != kernel.Put:
		case op.Lease == kernel.RetentionLease:
			op.Lease, op.ID = kernel.LeaseID, w.bucketFor(cl, op.Until.Sub(epoch0).Milliseconds())
		case op.Lease == kernel.BucketLease:
			op.Lease, op.ID = kernel.LeaseID, w.bucketFor(cl, w.clockOf(p)*1000+int64(x.scope.Retention)*1000)
		case op.Lease == kernel.SessionLease:
			op.Lease, op.ID = kernel.LeaseID, p.sess[cl]
		}
		if op.Record != nil {
			op.Value, op.Record = x.codec.encode(op.Record), nil
		}
		l.Then[i] = op
	}
	return l
}

// bucketFor returns the retention lease of the bucket that outlives ms
// (milliseconds since epoch0): one a second, granted when first needed.
func (w *world) bucketFor(cl int, ms int64) int64 {
	until := (ms + 999) / 1000
	if i := slices.IndexFunc(w.buckets, func(b bucket) bool { return b.cl == cl && b.until == until }); i >= 0 {
		return w.buckets[i].lease
	}
	id := w.db(cl).Grant(until)
	w.buckets = append(w.buckets, bucket{cl: cl, until: until, lease: id})
	slices.SortFunc(w.buckets, func(a, b bucket) int { return int(a.until-b.until)*4 + a.cl - b.cl })
	return id
}

// errLost is the error of a Txn whose answer did not come back.
var errLost = errors.New("etcd: request timed out, its outcome unknown")

// errNotSent is the error of a Txn that never left its process.
var errNotSent = errors.New("etcd request not sent")

// reply is etcd's answer to t, as the kernel reads it (etcdstore's reply).
func (x *explorer) reply(t *kernel.Txn, resp *etcdmodel.Response, err error) kernel.Reply {
	if err != nil {
		return kernel.Reply{Delivery: kernel.Failed, Err: err}
	}
	if resp.Succeeded {
		return kernel.Reply{Delivery: kernel.Applied, Rev: resp.Rev}
	}
	r := kernel.Reply{Delivery: kernel.Refused, Rev: resp.Rev}
	for i, op := range t.Else {
		res := resp.Results[i]
		var kv *etcdmodel.KV
		if len(res.KVs) > 0 {
			kv = &res.KVs[0]
		}
		switch {
		case op.Kind == kernel.Get && strings.HasPrefix(op.Key, keys.Records()):
			if kv != nil {
				r.Cur = x.codec.decode(*kv)
			}
		case op.Kind == kernel.Count && strings.HasPrefix(op.Key, keys.Owners()):
			r.OwnerGone = res.Count == 0
		case op.Key == keys.Epoch() && kv != nil:
			r.Epoch, _ = kernel.ParseEpoch(kv.Value)
		case op.Key == keys.Set() && kv != nil:
			r.Set = kernel.SetValue{Value: kv.Value, Rev: kv.ModRev}
		}
	}
	return r
}
