package check

// Scopes are the worlds CI explores, each exhaustively: every interleaving
// of its processes' steps and of the faults it allows. They are explored
// in parallel, smallest first, so that a violation a small world shows
// is found in seconds.
var Scopes = []Scope{
	{Name: "E: two keys", Procs: 2, Keys: 2, Faults: 1, Retries: 1, Retention: 3600},
	{Name: "D: three processes", Procs: 3, Keys: 1, Faults: 1, Retries: 1, Retention: 3600},
	{Name: "A2: two processes, two faults", Procs: 2, Keys: 1, Faults: 2, Retries: 1, Retention: 3600},
	{Name: "B: deadlines, clocks that move and disagree, a stuck worker", Procs: 2, Keys: 1, Faults: 1, Retries: 1, Retention: 3600,
		Deadline: 2, Ticks: 2, Skew: []int64{0, 1}, Hangs: 1},
	{Name: "H: two clients a process, reads first", Procs: 2, Keys: 1, Clients: 2, Faults: 1, Retries: 1, Retention: 3600, ReadFirst: true},
	{Name: "A1: two processes, lost and held replies, a crash", Procs: 2, Keys: 1, Faults: 1, Crashes: 1, Retries: 2, Retention: 3600},
	{Name: "S0: a shard set changes: keys handed over between two clusters, a crash", Procs: 2, Keys: 1, Faults: 1, Crashes: 1, Retries: 1, Retention: 3600, Shards: true},
	{Name: "F: shard epochs raised, a restart", Procs: 2, Keys: 1, Faults: 1, Crashes: 1, Retries: 1, Retention: 3600, Epochs: true, Raises: 1},
	{Name: "C: a session expires, recovery points", Procs: 2, Keys: 1, Faults: 1, Expiries: 1, Retries: 1, Retention: 3600, Checkpoint: true},
	{Name: "G1: retention passes: the sweeper", Procs: 2, Keys: 1, Faults: 1, Retries: 1, Retention: 2, Ticks: 2, Sweep: true},
	{Name: "G2: retention passes: EvictIf, reads first", Procs: 2, Keys: 1, Faults: 1, Retries: 1, Retention: 2, Ticks: 3, Evict: true, ReadFirst: true},
	{Name: "S: a shard set changes: keys handed over between two clusters, an epoch raised, a crash", Procs: 2, Keys: 1, Faults: 1,
		Crashes: 1, Raises: 1, Retries: 1, Retention: 3600, Shards: true},
}
