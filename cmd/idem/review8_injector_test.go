package main

// Review 8: idem injector accepts sidecar resources that the API server
// refuses on every pod it injects.

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
)

// --resources is checked at start ("requests and limits of Kubernetes
// quantities") so that a bad value exits 2 instead of reaching pods. But
// the check is per quantity only: a request above its limit, or a
// resource name Kubernetes does not know, passes, the injector starts,
// and every labelled pod in the cluster is then refused by the API
// server's validation (spec.initContainers[0].resources.requests: Invalid
// value: must be less than or equal to memory limit), with
// failurePolicy irrelevant: the webhook answered. The chart passes
// sidecar.resources straight through (--resources={{ toJson ... }}), and
// values.schema.json does not compare them either.
func TestReview8InjectorRefusesResourcesTheAPIServerRefuses(t *testing.T) {
	_, _, f := serverCert(t, "c")
	for _, res := range []string{
		`{"requests":{"memory":"512Mi"},"limits":{"memory":"256Mi"}}`, // request above limit
		`{"requests":{"cpu":"2"},"limits":{"cpu":"500m"}}`,
		`{"requests":{"gpu":"1"}}`, // not a standard or qualified resource name
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		cmd := exec.CommandContext(ctx, os.Args[0], "injector", "--listen", "127.0.0.1:0", "--tls-cert-file", f.CertFile, "--tls-key-file", f.KeyFile,
			"--image", "idem:test", "--endpoints", "http://etcd:2379", "--resources", res)
		cmd.Env = append(os.Environ(), "IDEM_TEST_RUN_MAIN=1")
		out, err := cmd.CombinedOutput()
		cancel()
		if exitCode1(err) != 2 {
			t.Errorf("idem injector --resources %s: %v (still running after 3s: %v); want exit 2: the API server refuses every pod with these resources\n%s", res, err, ctx.Err() != nil, out)
		}
	}
}
