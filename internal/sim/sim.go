// Package sim lets a deterministic simulation drive what the store would
// otherwise leave to real time and goroutines: its clock, its deadline
// timers and its retried background writes. The fault-schedule explorer
// (package explore) registers Hooks for an etcd client before it creates a
// store on that client; a store created on any other client (every store in
// production) finds none and uses the real clock and real goroutines.
//
// The registry is keyed by the client, not global, so tests that simulate
// and tests that do not can run in one process at once.
package sim

import (
	"context"
	"sync"
	"time"
)

// Hooks replace the store's clock and background execution.
type Hooks struct {
	// Now returns the simulated time.
	Now func() time.Time
	// AfterFunc calls f once the simulated clock reaches now+d; stop
	// cancels it and reports whether it did.
	AfterFunc func(d time.Duration, f func()) (stop func() bool)
	// Spawn takes over one of the store's retried background writes. try
	// makes one attempt and reports whether the task is finished; the
	// simulation calls it at the steps it chooses, never concurrently with
	// another of its steps.
	Spawn func(name string, try func(ctx context.Context) (done bool))
	// Flush is called by Store.Close before it revokes its session: the
	// simulation runs the store's pending tasks until they finish or it
	// gives up, as the store's own Close would within its bound.
	Flush func()
	// Renew, when a value arrives on it, makes a session on the client
	// renew its lease at once instead of at its next interval, so that a
	// lease the simulation revoked is noticed without waiting.
	Renew <-chan struct{}
}

var registry sync.Map // client (any comparable) -> *Hooks

// Register installs h for stores created on client, until the returned
// function is called.
func Register(client any, h *Hooks) (unregister func()) {
	registry.Store(client, h)
	return func() { registry.Delete(client) }
}

// Lookup returns the hooks registered for client, or nil.
func Lookup(client any) *Hooks {
	h, ok := registry.Load(client)
	if !ok {
		return nil
	}
	return h.(*Hooks)
}

type tagKey struct{}

// WithTag marks ctx so that a simulation's fault injector can tell whose
// etcd call it sees (for example "session": a call it must not fault, or a
// read-only observer's).
func WithTag(ctx context.Context, tag string) context.Context {
	return context.WithValue(ctx, tagKey{}, tag)
}

// Tag returns the tag WithTag put on ctx, or "".
func Tag(ctx context.Context) string {
	s, _ := ctx.Value(tagKey{}).(string)
	return s
}

type noWaitKey struct{}

// WithoutWaits marks ctx so that the store's retries of calls made with it
// do not sleep between tries: in a simulation, time between tries is the
// simulation's to decide, and real sleeps only slow it down.
func WithoutWaits(ctx context.Context) context.Context {
	return context.WithValue(ctx, noWaitKey{}, true)
}

// NoWaits reports whether ctx was marked by WithoutWaits.
func NoWaits(ctx context.Context) bool {
	b, _ := ctx.Value(noWaitKey{}).(bool)
	return b
}
