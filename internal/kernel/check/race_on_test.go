//go:build race

package check

// raceOn: the race detector slows exploration several times over.
const raceOn = true
