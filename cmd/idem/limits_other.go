//go:build !unix

package main

func openFileLimit() int { return 8192 }
