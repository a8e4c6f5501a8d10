package etcdstore

import "time"

// Metrics is what a Store holds and has done, in one value: its state now
// and counters since New. Package shard adds the shards' values up
// (Metrics.Add), and idem serve exports them.
type Metrics struct {
	// Live is true while the store has a session: claims can be made.
	Live bool
	// Full is true when etcd refused the store's last write for lack of
	// space (the NOSPACE alarm) and no write has been accepted since.
	// While it is, new keys and takeovers fail with ErrStoreFull; done keys
	// are still replayed, in-flight keys still conflict (CheckFull asks
	// etcd again).
	Full bool
	// Running counts the claims this process holds and has not ended,
	// Pending the final writes it retries in the background (outcomes of
	// finished work, fences of claims whose write had an unknown outcome).
	Running, Pending int
	// Reaped counts claims whose claim write had an unknown outcome and
	// that the store fenced or abandoned in the background.
	Reaped int64

	Batch        BatchMetrics
	Sweep        SweepMetrics
	Cache        CacheMetrics
	Dictionaries DictionaryMetrics
}

// BatchMetrics counts the store's group commit: batches it sent (a write
// sent alone is a batch of one; none without batching), the writes they
// held (Members/Batches is their mean size), those etcd refused as a whole,
// so that their writes went again alone, writes whose caller left before
// they were sent (they did not land: the caller got an error saying so),
// and writes whose caller's context ended while they flew (the store waited
// for etcd's answer, bounded by the request timeout, rather than leave the
// outcome unknown).
//
// Beside counts the batches sent while others of the store flew, Full
// those of them that went because a full batch waited (the others went once
// the hold had passed). RoundTrip is the smoothed round trip of a batch and
// Hold how long a write that finds a batch in flight now waits for company
// before a further batch may go: group commit measures the first and
// derives the second (docs/ARCHITECTURE.md, "Group commit").
type BatchMetrics struct {
	Batches, Members, Split int64
	Left, Waited            int64
	Beside, Full            int64
	RoundTrip, Hold         time.Duration
}

// SweepMetrics counts the expiry sweeper: retention leases it emptied (and
// revoked), and the expired records it deleted from them.
type SweepMetrics struct {
	Leases, Records int64
}

// CacheMetrics reports the done-record cache (WithCache). Stale counts the
// lookups it did not answer because it could not prove itself current
// within its staleness bound; Lag is how long ago it last could.
type CacheMetrics struct {
	Entries             int
	Bytes               int64
	Hits, Misses, Stale int64
	Lag                 time.Duration
}

// DictionaryMetrics counts compression dictionaries: those this process
// published and made current, those it wrote but another process's won,
// and the copies it wrote onto retention leases (one per dictionary and
// lease its records went on).
type DictionaryMetrics struct {
	Published, Raced, Copies int64
}

// Metrics returns the store's metrics.
func (s *Store) Metrics() Metrics {
	s.mu.Lock()
	m := Metrics{Live: s.sess != nil, Running: len(s.running)}
	s.mu.Unlock()
	m.Full = s.full.Load()
	m.Pending = s.bg.Pending()
	m.Reaped = s.reaped.Load()
	b := s.kv.Stats()
	m.Batch = BatchMetrics{Batches: b.Batches, Members: b.Members, Split: b.Split, Left: b.Left, Waited: b.Waited,
		Beside: b.Beside, Full: b.Full, RoundTrip: b.RoundTrip, Hold: b.Hold}
	if s.sweep != nil {
		w := s.sweep.Stats()
		m.Sweep = SweepMetrics{Leases: w.Leases, Records: w.Records}
	}
	if s.cache != nil {
		c := s.cache.Stats()
		m.Cache = CacheMetrics{Entries: c.Entries, Bytes: c.Bytes, Hits: c.Hits, Misses: c.Misses, Stale: c.Stale, Lag: c.Lag}
	}
	d := s.dicts.Stats()
	m.Dictionaries = DictionaryMetrics{Published: d.Published, Raced: d.Raced, Copies: d.Copies}
	return m
}

// Add returns the sum of m and o, as of several stores (the shards of a
// set): counts add up, Live holds if both are, Full if either is, and the
// cache's Lag, the batches' RoundTrip and Hold are the larger.
func (m Metrics) Add(o Metrics) Metrics {
	m.Live = m.Live && o.Live
	m.Full = m.Full || o.Full
	m.Running += o.Running
	m.Pending += o.Pending
	m.Reaped += o.Reaped
	m.Batch.Batches += o.Batch.Batches
	m.Batch.Members += o.Batch.Members
	m.Batch.Split += o.Batch.Split
	m.Batch.Left += o.Batch.Left
	m.Batch.Waited += o.Batch.Waited
	m.Batch.Beside += o.Batch.Beside
	m.Batch.Full += o.Batch.Full
	m.Batch.RoundTrip = max(m.Batch.RoundTrip, o.Batch.RoundTrip)
	m.Batch.Hold = max(m.Batch.Hold, o.Batch.Hold)
	m.Sweep.Leases += o.Sweep.Leases
	m.Sweep.Records += o.Sweep.Records
	m.Cache.Entries += o.Cache.Entries
	m.Cache.Bytes += o.Cache.Bytes
	m.Cache.Hits += o.Cache.Hits
	m.Cache.Misses += o.Cache.Misses
	m.Cache.Stale += o.Cache.Stale
	m.Cache.Lag = max(m.Cache.Lag, o.Cache.Lag)
	m.Dictionaries.Published += o.Dictionaries.Published
	m.Dictionaries.Raced += o.Dictionaries.Raced
	m.Dictionaries.Copies += o.Dictionaries.Copies
	return m
}
