package check

// Scopes are the worlds CI explores.
var Scopes = []Scope{
	{Name: "two processes, one key, lost and held replies, a crash", Procs: 2, Keys: 1, Faults: 2, Crashes: 1, Retries: 2, Retention: 3600},
}
