package explore

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Every dictionary a live record names is readable while the record is
// there (invariant 21): a record compressed against a dictionary (format
// 3) names the dictionary's id; a copy of that dictionary is kept on the
// record's own lease (<prefix>z/<id>/<lease hex>), so that both expire
// together. From etcd's history: when the record is written the copy on
// its lease exists, and the copy is not deleted while that version of the
// record is the key's (they go together, with their lease).

// dictCopies follows the dictionaries' copies through the history: for
// each copy key, the revisions it was created and deleted at.
type dictCopies map[string][]copyLife

type copyLife struct{ created, deleted int64 } // deleted 0: still there

// note takes an event of the feed on a copy key (rest is the key under
// the store's prefix).
func (d dictCopies) note(scope, rest string, ev *clientv3.Event) {
	body, ok := strings.CutPrefix(rest, "z/")
	if !ok || strings.Count(body, "/") != 1 {
		return
	}
	k := scope + body
	lives := d[k]
	switch {
	case ev.Type == clientv3.EventTypeDelete:
		if n := len(lives); n > 0 && lives[n-1].deleted == 0 {
			lives[n-1].deleted = ev.Kv.ModRevision
		}
	case ev.Kv.Version == 1:
		lives = append(lives, copyLife{created: ev.Kv.ModRevision})
	}
	d[k] = lives
}

// at reports whether the copy key existed at rev, and until when (the
// revision of its deletion; 0: never).
func (d dictCopies) at(k string, rev int64) (bool, int64) {
	for _, l := range d[k] {
		if l.created <= rev && (l.deleted == 0 || l.deleted > rev) {
			return true, l.deleted
		}
	}
	return false, 0
}

// dictOf returns the dictionary a record's value names (format 3), and
// whether it names one.
func dictOf(v []byte) (uint32, bool) {
	if len(v) < 3 || v[0] != 3 {
		return 0, false
	}
	id, n := binary.Uvarint(v[2:])
	if n <= 0 || id == 0 {
		return 0, false
	}
	return uint32(id), true
}

// copyKey names, under scope (a shard's name in a shard world), the copy
// of dictionary id on lease.
func copyKey(scope string, id uint32, lease int64) string {
	return scope + strconv.FormatUint(uint64(id), 10) + "/" + strconv.FormatInt(lease, 16)
}

// checkDicts returns the records whose dictionary was not readable while
// they were there.
func (w *world) checkDicts(hist map[string][]version) []string {
	var bad []string
	for key, vs := range hist {
		for i, v := range vs {
			if v.deleted || v.dict == 0 || w.restoredAt(v.rev) {
				continue
			}
			k := copyKey(v.shard, v.dict, v.lease)
			ok, until := w.copies.at(k, v.rev)
			end := int64(0) // the revision this version stopped being the key's
			if i+1 < len(vs) {
				end = vs[i+1].rev
			}
			switch {
			case !ok:
				bad = append(bad, fmt.Sprintf("%s: its record at revision %d is compressed against dictionary %d, which has no copy on its lease %x",
					key, v.rev, v.dict, v.lease))
			case until != 0 && (end == 0 || until < end):
				bad = append(bad, fmt.Sprintf("%s: dictionary %d's copy on lease %x was deleted at revision %d, while the record written at %d that needs it was there",
					key, v.dict, v.lease, until, v.rev))
			}
		}
	}
	return bad
}
