//go:build race

package explore

// raceOn: the race detector slows the explorer several times over, so a
// run under it explores briefly; scripts/test runs the long budget
// without it.
const raceOn = true
