package main

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/idem-dev/idem/etcdstore"
)

// Issue 37: a plain key whose work failed (any library Do whose work
// returned an error) was listed by `idem jobs ls` and the console as a
// failed job with no kind, and the console's key page did not show the
// saved error. Every record now says what it is, and each reader shows it
// as such.
func TestAFailedPlainKeyIsShownAsAKeyWithItsError(t *testing.T) {
	idem, ep, st, ctx := consoleIdem(t)
	// A service's library Do, in the jobs tenant or any other.
	for _, tenant := range []string{"default", "jobs"} {
		_, err := st.Do(ctx, etcdstore.Key{Tenant: tenant, ID: "charge-9"}, []byte(`{"amount":5}`), func(context.Context, *etcdstore.Claim) ([]byte, error) {
			return nil, errors.New("card declined")
		})
		var saved *etcdstore.SavedError
		if err == nil || errors.As(err, &saved) {
			t.Fatalf("Do of a failing work = %v; want the work's own error", err)
		}
	}
	if out, err := runCmd(t, "jobs", "ls", "--endpoints", ep); err != nil || strings.Contains(out, "charge-9") {
		t.Fatalf("idem jobs ls = %q, %v; want no job (charge-9 is a plain key)", out, err)
	}
	out, err := runCmd(t, "get", "--endpoints", ep, "charge-9")
	if err != nil || !strings.Contains(out, "type=key") || !strings.Contains(out, `error="card declined"`) || strings.Contains(out, "job=") {
		t.Fatalf("idem get charge-9 = %q, %v; want type=key with its saved error", out, err)
	}
	rc := newReviewConsole(t, idem)
	status, page := rc.get("/console/key?tenant=default&key=charge-9")
	if status != 200 || !strings.Contains(page, `data-field="kind">an idempotency key<`) || !strings.Contains(page, `data-field="error"><code>card declined</code>`) {
		t.Fatalf("key page: %d\n%s", status, page)
	}
	if _, jobs := rc.get("/console/jobs?tenant=jobs"); strings.Contains(jobs, "charge-9") {
		t.Fatal("the console's jobs page lists the plain key charge-9 as a job")
	}
}

// consoleIdem starts idem serve --console on its embedded etcd, and a
// store of the test's own on that etcd (as a service beside it would
// have), both ended with the test. It returns the etcd endpoint and a
// context of a minute.
func consoleIdem(t *testing.T) (*idemProc, string, *etcdstore.Store, context.Context) {
	t.Helper()
	dir := tempDir(t)
	flags := embeddedFlags(t, filepath.Join(dir, "idem-data"))
	idem := startIdem(t, dir, append(flags, "--console")...)
	ep := etcdEndpoint(flags)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	st, err := etcdstore.New(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return idem, ep, st, ctx
}
