//go:build !race

package etcdmodel

const raceOn = false
