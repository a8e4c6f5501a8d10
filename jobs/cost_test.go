package jobs

import (
	"context"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// calls counts a client's unary etcd calls by method (Txn, Range, ...).
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]int{}
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

// since returns the Txns and reads (Range) made since before.
func (c *calls) since(before map[string]int) [2]int {
	now := c.snapshot()
	return [2]int{now["Txn"] - before["Txn"], now["Range"] - before["Range"]}
}

func countingClient(t *testing.T) (*clientv3.Client, *calls) {
	t.Helper()
	c := &calls{n: map[string]int{}}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: cluster.Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				c.mu.Lock()
				c.n[method[strings.LastIndex(method, "/")+1:]]++
				c.mu.Unlock()
				return invoker(ctx, method, req, reply, cc, opts...)
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli, c
}

// costTable reads JOBS.md's job cost table: operation -> [Txns, reads].
func costTable(t *testing.T) map[string][2]int {
	t.Helper()
	doc, err := os.ReadFile("../docs/JOBS.md")
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(doc), "<!-- job cost table: TestJobCostTableIsMeasured -->")
	if !ok {
		t.Fatal("docs/JOBS.md has no job cost table")
	}
	row := regexp.MustCompile(`^\s*\| ([^|]+?) \| (\d+) \| (\d+) \|$`)
	out := map[string][2]int{}
	for _, l := range strings.Split(after, "\n")[3:] {
		m := row.FindStringSubmatch(l)
		if m == nil {
			break
		}
		txns, _ := strconv.Atoi(m[2])
		reads, _ := strconv.Atoi(m[3])
		out[m[1]] = [2]int{txns, reads}
	}
	return out
}

// JOBS.md's cost table is what the code does: each operation's etcd calls
// are counted at the client (issue 37: the table said a claim was two
// Txns; it is one Txn and a read).
func TestJobCostTableIsMeasured(t *testing.T) {
	table := costTable(t)
	ctx := testCtx(t)
	cli, n := countingClient(t)
	s := newStoreOn(t, cli, testPrefix(t))
	q := newQueue(t, s)
	step := func(out string) Step {
		return Step{Name: "s" + out, Run: func(ctx context.Context, r *Run) ([]byte, error) { return []byte(out), nil }}
	}
	three := Kind{Name: "three", Steps: []Step{step("1"), step("2"), step("3")}}
	w := newWorker(t, q, []Kind{three}, Concurrency(0))
	if _, err := q.Submit(ctx, "warm", "three", nil); err != nil { // the retention bucket's lease, once
		t.Fatal(err)
	}
	measured := map[string][2]int{}
	b := n.snapshot()
	j, err := q.Submit(ctx, "j", "three", nil)
	if err != nil {
		t.Fatal(err)
	}
	measured["submit (`Queue.Submit`)"] = n.since(b)
	rec, err := s.Get(ctx, j.Key)
	if err != nil {
		t.Fatal(err)
	}
	b = n.snapshot()
	if err := w.execute(ctx, "j", rec.Fingerprint, w.kinds["three"]); err != nil {
		t.Fatal(err)
	}
	attempt := n.since(b)
	if j, err := q.Get(ctx, "j"); err != nil || j.State != Succeeded {
		t.Fatalf("job after its attempt = %+v, %v; want succeeded", j, err)
	}
	b = n.snapshot()
	if err := q.Signal(ctx, "warm", "go", nil); err != nil {
		t.Fatal(err)
	}
	measured["a signal (`Queue.Signal`)"] = n.since(b)
	claim, mid, last := table["an attempt's claim of a queued job"], table["each step but the last (its checkpoint)"],
		table["the last step and the job's end (a step that commits no ops)"]
	// The attempt is the claim, two steps but the last, and the last with
	// the end: its calls must be the table's sum.
	want := [2]int{claim[0] + 2*mid[0] + last[0], claim[1] + 2*mid[1] + last[1]}
	if attempt != want {
		t.Errorf("a three-step attempt made %d Txns and %d reads; JOBS.md's table sums to %d and %d", attempt[0], attempt[1], want[0], want[1])
	}
	for op, got := range measured {
		if table[op] != got {
			t.Errorf("%s: %d Txns, %d reads measured; JOBS.md says %v", op, got[0], got[1], table[op])
		}
	}
	if len(table) != 5 {
		t.Errorf("JOBS.md's cost table has %d rows (%v); this test measures 5", len(table), table)
	}
}
