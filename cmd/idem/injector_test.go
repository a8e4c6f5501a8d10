package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/testcerts"
)

// serverCert makes a CA named name in a new directory and a server
// certificate for 127.0.0.1 signed by it.
func serverCert(t *testing.T, name string) (string, *testcerts.CA, testcerts.Files) {
	t.Helper()
	dir := tempDir(t)
	ca, err := testcerts.NewCA(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.Issue(name, testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	return dir, ca, f
}

// startInjector starts "idem injector" with a certificate for 127.0.0.1
// and returns its address and a client that trusts only its CA.
func startInjector(t *testing.T, args ...string) (string, *http.Client, *exec.Cmd) {
	t.Helper()
	_, ca, f := serverCert(t, "injector")
	args = append([]string{"injector", "--listen", "127.0.0.1:0", "--tls-cert-file", f.CertFile, "--tls-key-file", f.KeyFile}, args...)
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "IDEM_TEST_RUN_MAIN=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		<-exited
	})
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == "idem injector listening" {
				addr <- m["listen"].(string)
			}
		}
		exited <- cmd.Wait()
	}()
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	select {
	case a := <-addr:
		return a, client, cmd
	case err := <-exited:
		exited <- err
		t.Fatalf("idem injector exited before listening: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("idem injector did not listen within 60s")
	}
	return "", nil, nil
}

// The webhook, over a real TLS socket: a labelled pod gets the patch, an
// unlabelled one none, a pod with a wrong annotation is refused naming
// it, and what is not an AdmissionReview gets 400. Plain HTTP is not
// served.
func TestInjectorAnswersAdmissionReviews(t *testing.T) {
	addr, client, _ := startInjector(t, "--image", "idem:test", "--endpoints", "http://etcd:2379")
	review := func(pod string) map[string]any {
		t.Helper()
		body := `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u-1","kind":{"group":"","version":"v1","kind":"Pod"},"operation":"CREATE","namespace":"shop","object":` + pod + `}}`
		resp, err := client.Post("https://"+addr+"/inject", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct{ Response map[string]any }
		if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&out) != nil || out.Response == nil {
			t.Fatalf("review: status %d", resp.StatusCode)
		}
		if out.Response["uid"] != "u-1" {
			t.Fatalf("response uid = %v; want the request's", out.Response["uid"])
		}
		return out.Response
	}
	labelled := `{"metadata":{"labels":{"idem.dev/inject":"true"}},"spec":{"containers":[{"name":"app","ports":[{"name":"http","containerPort":8080}]}]}}`
	r := review(labelled)
	if r["allowed"] != true || r["patchType"] != "JSONPatch" {
		t.Fatalf("labelled pod: %v", r)
	}
	raw, err := base64.StdEncoding.DecodeString(r["patch"].(string)) // base64, as the API wants
	var ops []map[string]any
	if err != nil || json.Unmarshal(raw, &ops) != nil || !strings.Contains(string(raw), `"restartPolicy":"Always"`) || !strings.Contains(string(raw), `"image":"idem:test"`) {
		t.Fatalf("labelled pod: patch %q (%v); want a JSON Patch adding the native sidecar", raw, err)
	}
	if r := review(`{"metadata":{},"spec":{"containers":[{"name":"app"}]}}`); r["allowed"] != true || r["patch"] != nil {
		t.Fatalf("unlabelled pod: %v; want allowed unchanged", r)
	}
	r = review(`{"metadata":{"labels":{"idem.dev/inject":"true"},"annotations":{"idem.dev/retention":"soon"}},"spec":{"containers":[{"name":"app","ports":[{"containerPort":8080}]}]}}`)
	if st, _ := r["status"].(map[string]any); r["allowed"] != false || st == nil || !strings.Contains(st["message"].(string), `idem.dev/retention "soon"`) {
		t.Fatalf("bad annotation: %v; want refused naming it", r)
	}
	resp, err := client.Post("https://"+addr+"/inject", "application/json", strings.NewReader(`{"kind":"Pod"}`))
	if err != nil || resp.StatusCode != 400 {
		t.Fatalf("not a review: %v %v; want 400", resp, err)
	}
	resp.Body.Close()
	if resp, err := http.Post("http://"+addr+"/inject", "application/json", strings.NewReader(`{}`)); err == nil && resp.StatusCode == 200 {
		t.Fatal("the webhook answered over plain HTTP")
	}
	resp, err = client.Get("https://" + addr + "/livez")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/livez: %v %v", resp, err)
	}
	resp.Body.Close()
}

// A configuration error exits 2, before anything listens.
func TestInjectorConfigErrors(t *testing.T) {
	dir, _, f := serverCert(t, "c")
	tlsArgs := []string{"--tls-cert-file", f.CertFile, "--tls-key-file", f.KeyFile}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--image", "i"}, "--tls-cert-file and --tls-key-file are required"},
		{tlsArgs, "--image is required"},
		{append([]string{"--image", "i", "--endpoints", "etcd:2379"}, tlsArgs...), "--endpoints"},
		{append([]string{"--image", "i", "--image-pull-policy", "Sometimes"}, tlsArgs...), "--image-pull-policy"},
		{append([]string{"--image", "i", "--session-ttl", "1500ms"}, tlsArgs...), "--session-ttl"},
		{append([]string{"--image", "i", "--retention", "0s"}, tlsArgs...), "--retention"},
		{append([]string{"--image", "i", "--retention", "1500ms"}, tlsArgs...), "--retention"},
		{append([]string{"--image", "i", "--prefix", "/idem"}, tlsArgs...), "--prefix"},
		{append([]string{"--image", "i", "--resources", `{"requests":{"cpu":"lots"}}`}, tlsArgs...), "--resources"},
		{append([]string{"--image", "i", "--resources", `{"limits":{"memory":"256 MiB"}}`}, tlsArgs...), "--resources"},
		{append([]string{"--image", "i", "--resources", `[]`}, tlsArgs...), "--resources"},
		{[]string{"--image", "i", "--tls-cert-file", filepath.Join(dir, "none.pem"), "--tls-key-file", f.KeyFile}, "none.pem"},
		{append([]string{"--image", "i", "extra"}, tlsArgs...), "no arguments"},
	} {
		out, err := runCmd(t, append([]string{"injector", "--listen", "127.0.0.1:0"}, tc.args...)...)
		if exitCode(err) != 2 || !strings.Contains(out+err.Error(), tc.want) {
			t.Errorf("injector %q = %v (exit %d); want exit 2 naming %s", tc.args, err, exitCode(err), tc.want)
		}
	}
}

// serve --tenant puts every request of an unauthenticated idem (an
// injected sidecar's) in that tenant; with authentication it is refused.
func TestServeTenantFlag(t *testing.T) {
	dir := tempDir(t)
	flags := embeddedFlags(t, filepath.Join(dir, "data"))
	idem := startIdem(t, dir, append([]string{"--tenant", "shop"}, flags...)...)
	if r := send(t, "POST", idem.listen+"/v1/claim", "", `{"key":"order-1","params":{}}`); r.status != 201 {
		t.Fatalf("claim = %d %s", r.status, r.body)
	}
	ep := etcdEndpoint(flags)
	if out, err := runCmd(t, "get", "--endpoints", ep, "--tenant", "shop", "order-1"); err != nil || !strings.Contains(out, "shop/order-1") {
		t.Fatalf("idem get --tenant shop order-1 = %q, %v; want the key in tenant shop", out, err)
	}
	if out, err := runCmd(t, "get", "--endpoints", ep, "order-1"); err == nil {
		t.Fatalf("the key is in the default tenant too: %q", out)
	}
	// Jobs stay in their own tenant: a job's id never meets a key of the
	// same name (the key API would claim the job's record).
	if r := send(t, "POST", idem.listen+"/v1/jobs", "", `{"id":"order-2","kind":"report","params":{}}`); r.status != 201 {
		t.Fatalf("submit = %d %s", r.status, r.body)
	}
	if out, err := runCmd(t, "get", "--endpoints", ep, "--tenant", "jobs", "order-2"); err != nil || !strings.Contains(out, "jobs/order-2") {
		t.Fatalf("the job is not in tenant jobs: %q, %v", out, err)
	}
	for _, args := range [][]string{{"--tenant", "a/b"}, {"--tenant", "shop", "--tokens-file", filepath.Join(dir, "tokens")}} {
		if out, err := runCmd(t, append([]string{"serve"}, args...)...); exitCode(err) != 2 || !strings.Contains(out+err.Error(), "--tenant") {
			t.Errorf("serve %q = %v; want exit 2 naming --tenant", args, err)
		}
	}
}
