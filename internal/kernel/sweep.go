package kernel

import "time"

// SweepChunk is the Txn that deletes the records keys that are still on
// lease: one inner Txn each, If Lease(record) == lease Then
// Delete(record). A record written again since (on a newer lease) is left
// alone: the sweeper deletes only records its rule allows, expired with
// their lease.
func SweepChunk(keys []string, lease int64) *Txn {
	t := &Txn{Then: make([]Op, len(keys))}
	for i, k := range keys {
		t.Then[i] = Op{Kind: Nested, Key: k, Txn: &Txn{If: []Cmp{OnLease(k, lease)}, Then: []Op{Del(k)}}}
	}
	return t
}

// BucketDue reports whether a retention bucket that ends at end is due for
// its sweep at now: every record on it has expired, with margin for the
// writers' clocks, which may run ahead of this one's.
func BucketDue(end time.Time, retention, margin time.Duration, now time.Time) bool {
	return !now.Before(end.Add(retention + margin))
}

// EvictIf is the Txn that deletes key's record if it is still the one
// written at rev: If ModRevision(key) == rev Then Delete(key) Else
// Count(key).
func EvictIf(key string, rev int64) *Txn {
	return &Txn{If: []Cmp{Modified(key, rev)}, Then: []Op{Del(key)}, Else: []Op{CountOf(key)}}
}

// EvictIfGone reports, from an EvictIf Txn's answer (applied, or the
// count its Else read), whether the key has no record now.
func EvictIfGone(applied bool, left int64) bool { return applied || left == 0 }

// Drainable reports whether a record of a key its shard no longer holds
// under the set in force may be deleted by the drain: its retention passed
// more than skew ago, by the drainer's clock. A younger one keeps the
// shard undrained.
func Drainable(rec *Record, now time.Time, skew time.Duration) bool {
	return !rec.Expires.IsZero() && now.After(rec.Expires.Add(skew))
}

// ReadDone judges a record found without a write (in the replay cache, or
// by a serializable read): Replay when it is done and retained, Mismatch
// when it names another operation; 0 when it says nothing (absent,
// expired, in flight: the claim Txn decides).
func ReadDone(rec *Record, fp [32]byte, now time.Time) Verdict {
	switch {
	case rec == nil || rec.Expired(now) || rec.State != Done:
		return 0
	case rec.Fingerprint != fp:
		return Mismatch
	}
	return Replay
}
