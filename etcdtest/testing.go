package etcdtest

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// Start starts an n-member cluster under t's temporary directory and stops it
// when the test ends.
func Start(t testing.TB, n int, opts Options) *Cluster {
	t.Helper()
	c, err := New(t.TempDir(), n, opts)
	if err != nil {
		t.Fatalf("start %d-member etcd cluster: %v", n, err)
	}
	t.Cleanup(c.Close)
	return c
}

// EndpointsEnv names the environment variable in which Main puts the
// shared cluster's endpoints, for Example functions.
const EndpointsEnv = "IDEM_TEST_ETCD_ENDPOINTS"

// Main is a TestMain body for a package whose tests share one cluster: it
// starts an n-member cluster in a temporary directory, hands it to use, runs
// the tests, and removes everything. Call it as
//
//	func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m, 1, Options{}, &cluster)) }
func Main(m *testing.M, n int, opts Options, cluster **Cluster) int {
	dir, err := os.MkdirTemp("", "idem-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	c, err := New(dir, n, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "start etcd:", err)
		return 1
	}
	defer c.Close()
	*cluster = c
	// Examples connect as a user would, through an endpoint list.
	os.Setenv(EndpointsEnv, strings.Join(c.Endpoints(), ","))
	return m.Run()
}
