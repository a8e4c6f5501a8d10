package check

// Scopes are the worlds CI explores.
var Scopes = []Scope{
	{Name: "A1: two processes, lost and held replies, a crash", Procs: 2, Keys: 1, Faults: 1, Crashes: 1, Retries: 2, Retention: 3600},
	{Name: "A2: two processes, two faults", Procs: 2, Keys: 1, Faults: 2, Retries: 1, Retention: 3600},
	{Name: "B: deadlines, clocks that move and disagree", Procs: 2, Keys: 1, Faults: 1, Retries: 1, Retention: 3600, Deadline: 2, Ticks: 2, Skew: []int64{0, 1}},
	{Name: "C: a session expires, recovery points", Procs: 2, Keys: 1, Faults: 1, Expiries: 1, Retries: 1, Retention: 3600, Checkpoint: true},
	{Name: "D: three processes", Procs: 3, Keys: 1, Faults: 1, Retries: 1, Retention: 3600},
	{Name: "E: two keys", Procs: 2, Keys: 2, Faults: 1, Retries: 1, Retention: 3600},
	{Name: "F: shard epochs raised", Procs: 2, Keys: 1, Faults: 1, Retries: 2, Retention: 3600, Epochs: true, Raises: 2},
	{Name: "G: retention passes: the sweeper and EvictIf", Procs: 2, Keys: 1, Faults: 1, Retries: 1, Retention: 2, Ticks: 3, Sweep: true, Evict: true},
}
