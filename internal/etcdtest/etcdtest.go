// Package etcdtest is the testing glue over package etcdcluster: a cluster
// for one test, and a TestMain body for a package whose tests share one.
package etcdtest

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/idem-dev/idem/internal/etcdcluster"
)

// Start starts an n-member cluster under t's temporary directory and stops it
// when the test ends.
func Start(t testing.TB, n int, opts etcdcluster.Options) *etcdcluster.Cluster {
	t.Helper()
	c, err := etcdcluster.New(t.TempDir(), n, opts)
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
//	func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m, 1, etcdcluster.Options{}, &cluster)) }
func Main(m *testing.M, n int, opts etcdcluster.Options, cluster **etcdcluster.Cluster) int {
	dir, err := os.MkdirTemp("", "idem-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	c, err := etcdcluster.New(dir, n, opts)
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
