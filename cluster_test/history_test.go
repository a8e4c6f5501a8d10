package cluster_test

import (
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// The per-key model of the store. A key is unset, or done with one value.
// Every operation is one client's Do(key) proposing a value unique to that
// operation:
//
//	fresh(v)   the work ran and its outcome v was saved: needs unset, sets v,
//	           and v must be the operation's own proposal
//	replay(w)  a saved outcome was returned: needs done(w)
//	conflict   the key was in flight: needs unset (a done key replays)
//	unknown    the operation failed without knowing whether its outcome was
//	           saved (timeout, etcd unavailable, fenced): it may or may not
//	           take effect, at any time until the end of the history
type opInput struct {
	Key      string
	Proposal string
}

type outKind int

const (
	outFresh outKind = iota
	outReplay
	outConflict
	outUnknown
)

func (k outKind) String() string {
	return [...]string{"fresh", "replay", "conflict", "unknown"}[k]
}

type opOutput struct {
	Kind  outKind
	Value string
}

// endOfTime is the return time of operations whose outcome is unknown: they
// may take effect at any later point.
const endOfTime = int64(1) << 62

var storeModel = porcupine.NondeterministicModel{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		var keys []string
		for _, op := range h {
			k := op.Input.(opInput).Key
			if _, ok := byKey[k]; !ok {
				keys = append(keys, k)
			}
			byKey[k] = append(byKey[k], op)
		}
		sort.Strings(keys)
		out := make([][]porcupine.Operation, len(keys))
		for i, k := range keys {
			out[i] = byKey[k]
		}
		return out
	},
	Init: func() []any { return []any{""} },
	Step: func(state, input, output any) []any {
		s, in, out := state.(string), input.(opInput), output.(opOutput)
		switch out.Kind {
		case outFresh:
			if s == "" && out.Value == in.Proposal {
				return []any{out.Value}
			}
		case outReplay:
			if s != "" && out.Value == s {
				return []any{s}
			}
		case outConflict:
			if s == "" {
				return []any{s}
			}
		case outUnknown:
			if s == "" {
				return []any{"", in.Proposal}
			}
			return []any{s}
		}
		return nil
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(opInput), output.(opOutput)
		return fmt.Sprintf("Do(%s, %s) -> %v %s", in.Key, in.Proposal, out.Kind, out.Value)
	},
}

// history records client operations for the linearizability check.
type history struct {
	mu    sync.Mutex
	start time.Time
	ops   []porcupine.Operation
}

func newHistory() *history { return &history{start: time.Now()} }

func (h *history) now() int64 { return int64(time.Since(h.start)) }

// add records one operation. An unknown outcome returns at the end of time.
func (h *history) add(client int, in opInput, call int64, out opOutput) {
	ret := h.now()
	if out.Kind == outUnknown {
		ret = endOfTime
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

func (h *history) operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]porcupine.Operation(nil), h.ops...)
}

// checkLinearizable runs porcupine over the history.
func checkLinearizable(t *testing.T, h *history) {
	t.Helper()
	ops := h.operations()
	res, _ := porcupine.CheckOperationsVerbose(storeModel.ToModel(), ops, 60*time.Second)
	switch res {
	case porcupine.Ok:
		t.Logf("linearizable: %d operations", len(ops))
	case porcupine.Illegal:
		t.Errorf("history of %d operations is NOT linearizable", len(ops))
	default:
		t.Errorf("linearizability check timed out on %d operations", len(ops))
	}
}

// The checker must reject the bugs it exists to catch. Each history is
// built by hand: t(call, ret) in arbitrary units.
func TestCheckerRejectsPlantedBugs(t *testing.T) {
	op := func(client int, key, proposal string, call, ret int64, kind outKind, value string) porcupine.Operation {
		if kind == outUnknown {
			ret = endOfTime
		}
		return porcupine.Operation{ClientId: client, Input: opInput{key, proposal}, Call: call, Return: ret, Output: opOutput{kind, value}}
	}
	model := storeModel.ToModel()
	for _, tc := range []struct {
		name  string
		legal bool
		ops   []porcupine.Operation
	}{
		{"one run then replays", true, []porcupine.Operation{
			op(0, "k", "a", 0, 10, outFresh, "a"),
			op(1, "k", "b", 5, 15, outReplay, "a"),
			op(2, "k", "c", 20, 30, outReplay, "a"),
		}},
		{"a conflict while in flight, then a takeover after an unknown outcome", true, []porcupine.Operation{
			op(0, "k", "a", 0, 0, outUnknown, ""),
			op(1, "k", "b", 5, 8, outConflict, ""),
			op(1, "k", "b2", 10, 20, outFresh, "b2"),
			op(2, "k", "c", 25, 30, outReplay, "b2"),
		}},
		{"an unknown outcome that took effect", true, []porcupine.Operation{
			op(0, "k", "a", 0, 0, outUnknown, ""),
			op(1, "k", "b", 50, 60, outReplay, "a"),
		}},
		{"double claim: two runs both saved", false, []porcupine.Operation{
			op(0, "k", "a", 0, 10, outFresh, "a"),
			op(1, "k", "b", 2, 12, outFresh, "b"),
		}},
		{"wrong replay", false, []porcupine.Operation{
			op(0, "k", "a", 0, 10, outFresh, "a"),
			op(1, "k", "b", 20, 30, outReplay, "zzz"),
		}},
		{"completion after takeover: the fenced worker's outcome saved too", false, []porcupine.Operation{
			op(0, "k", "a", 0, 40, outFresh, "a"),  // slow worker, "saved" late
			op(1, "k", "b", 10, 20, outFresh, "b"), // the owner that took over
			op(2, "k", "c", 45, 50, outReplay, "b"),
		}},
		{"lost done: an acknowledged outcome forgotten", false, []porcupine.Operation{
			op(0, "k", "a", 0, 10, outFresh, "a"),
			op(1, "k", "b", 20, 30, outFresh, "b"),
		}},
		{"conflict after done", false, []porcupine.Operation{
			op(0, "k", "a", 0, 10, outFresh, "a"),
			op(1, "k", "b", 20, 30, outConflict, ""),
		}},
		{"fresh with another's value", false, []porcupine.Operation{
			op(0, "k", "a", 0, 10, outFresh, "b"),
		}},
		{"keys are independent", true, []porcupine.Operation{
			op(0, "k1", "a", 0, 10, outFresh, "a"),
			op(1, "k2", "b", 0, 10, outFresh, "b"),
		}},
	} {
		if got := porcupine.CheckOperations(model, tc.ops); got != tc.legal {
			t.Errorf("%s: linearizable = %v; want %v", tc.name, got, tc.legal)
		}
	}
}
