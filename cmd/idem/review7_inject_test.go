package main

// Review 7 (issue 39): the sidecar the injector writes, run as the kubelet
// would run it (its environment, nothing else), against a real etcd.

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-dev/idem/internal/embedded"
	"github.com/idem-dev/idem/internal/inject"
	"github.com/idem-dev/idem/internal/testcerts"
)

// sidecarEnv is the environment of the idem container the injector adds
// to pod (as JSON), with the files it mounts replaced by files.
func sidecarEnv(t *testing.T, cfg inject.Config, pod string, files map[string]string) []string {
	t.Helper()
	d := json.NewDecoder(strings.NewReader(pod))
	d.UseNumber()
	var p map[string]any
	if err := d.Decode(&p); err != nil {
		t.Fatal(err)
	}
	ops, err := cfg.Mutate(p)
	if err != nil {
		t.Fatal(err)
	}
	var env []string
	for _, op := range ops {
		if op.Path != "/spec/initContainers" {
			continue
		}
		b, _ := json.Marshal(op.Value)
		var cts []struct {
			Name string
			Env  []struct{ Name, Value string }
		}
		json.Unmarshal(b, &cts)
		for _, e := range cts[0].Env {
			v := e.Value
			if f, ok := files[v]; ok {
				v = f
			}
			switch e.Name {
			case "IDEM_LISTEN", "IDEM_ADMIN_LISTEN":
				v = "127.0.0.1:0"
			}
			env = append(env, e.Name+"="+v)
		}
	}
	if env == nil {
		t.Fatalf("no idem init container in the patch %+v", ops)
	}
	return env
}

// A pod with idem.dev/shards-configmap gets, by default, the etcd client
// certificate of idem.dev/etcd-tls-secret (the injector's
// --etcd-tls-secret, which the chart always sets): the Secret is mounted
// and IDEM_CACERT, IDEM_CERT and IDEM_KEY point at it. idem serve
// --shards-file ignores --cacert/--cert/--key without a word (each shard's
// TLS comes from the shards file alone), so the sidecar dials an etcd that
// requires client certificates without one: the documented default
// (deploy/README.md: "idem's client certificate for etcd") does nothing.
// Either the certificate is used, or the combination is refused (exit 2)
// naming it; here it is neither.
func TestReview7ShardsSidecarUsesItsEtcdCertificate(t *testing.T) {
	dir := t.TempDir()
	ca, err := testcerts.NewCA(dir, "etcd")
	if err != nil {
		t.Fatal(err)
	}
	server, err := ca.Issue("etcd", testcerts.Options{Server: true})
	if err != nil {
		t.Fatal(err)
	}
	client, err := ca.Issue("idem", testcerts.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ep := startEtcd(t, embedded.TLS{CertFile: server.CertFile, KeyFile: server.KeyFile, TrustedCAFile: ca.CertFile, ClientCertAuth: true})
	shards := filepath.Join(dir, "shards.yaml")
	if err := os.WriteFile(shards, []byte("shards:\n  - name: a\n    endpoints: ["+ep+"]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := inject.Config{Image: "idem:test", Endpoints: "https://etcd-0.etcd:2379", EtcdTLSSecret: "idem-etcd-client-tls",
		Retention: time.Hour, SessionTTL: 2 * time.Second, ShutdownGrace: time.Second, Native: true}
	pod := `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/shards-configmap": "shop-shards"}},
		"spec": {"containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}}`
	env := sidecarEnv(t, cfg, pod, map[string]string{
		"/etc/idem/shards/shards.yaml": shards, "/etc/idem/etcd-tls/ca.crt": ca.CertFile,
		"/etc/idem/etcd-tls/tls.crt": client.CertFile, "/etc/idem/etcd-tls/tls.key": client.KeyFile,
	})
	if !strings.Contains(strings.Join(env, "\n"), "IDEM_CERT=") {
		t.Fatalf("the injector gave the shards sidecar no client certificate: %v", env)
	}

	// The control: the same etcd, the same environment, with the
	// certificate named in the shards file itself, works.
	control := filepath.Join(dir, "shards-control.yaml")
	if err := os.WriteFile(control, []byte("shards:\n  - name: a\n    endpoints: ["+ep+"]\n    cacert: "+ca.CertFile+
		"\n    cert: "+client.CertFile+"\n    key: "+client.KeyFile+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var controlEnv []string
	for _, e := range env {
		if strings.HasPrefix(e, "IDEM_SHARDS_FILE=") {
			e = "IDEM_SHARDS_FILE=" + control
		}
		controlEnv = append(controlEnv, e)
	}
	if ok, refused, logs := runShardsSidecar(t, controlEnv); !ok || refused {
		t.Fatalf("control (the certificate in the shards file): the sidecar cannot use etcd either:\n%s", logs)
	}
	ok, refused, logs := runShardsSidecar(t, env)
	var kept []string
	for _, l := range strings.Split(logs, "\n") {
		if !strings.Contains(l, `"idem: refused"`) {
			kept = append(kept, l)
		}
	}
	logs = strings.Join(kept, "\n")
	if !ok && !refused {
		t.Fatalf("the shards sidecar cannot use etcd (503 on every keyed request, while the same environment with the certificate in the shards file works): its IDEM_CACERT/IDEM_CERT/IDEM_KEY, from idem.dev/etcd-tls-secret, are ignored without a word; logs:\n%s", logs)
	}
}

// runShardsSidecar runs idem serve with env and says whether a keyed
// request got past etcd (ok), or serve refused the configuration (exit 2
// naming the shards file).
func runShardsSidecar(t *testing.T, env []string) (ok, refused bool, logs string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "serve", "--log-format", "json", "--dial-timeout", "1s", "--request-timeout", "2s")
	cmd.Dir = t.TempDir()
	cmd.Env = append(append(os.Environ(), "IDEM_TEST_RUN_MAIN=1"), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	listen := make(chan string, 1)
	buf := &syncBuffer{}
	exited := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			buf.Write([]byte(sc.Text() + "\n"))
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == "idem listening" {
				listen <- "http://" + m["listen"].(string)
			}
		}
		exited <- cmd.Wait()
	}()
	defer func() {
		cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
		}
	}()
	select {
	case err := <-exited:
		exited <- err
		return false, exitCode1(err) == 2 && strings.Contains(buf.String(), "shards"), buf.String()
	case url := <-listen:
		// The upstream (the app) is not there: a claimed request answers
		// 502; one etcd cannot take answers 503.
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			req, _ := http.NewRequest("POST", url+"/orders", strings.NewReader(`{}`))
			req.Header.Set("Idempotency-Key", "k-1")
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode != http.StatusServiceUnavailable {
					return true, false, buf.String()
				}
			}
			time.Sleep(500 * time.Millisecond)
		}
		return false, false, buf.String()
	case <-ctx.Done():
		return false, false, buf.String()
	}
}

// The sidecar the injector admits must be one idem serve runs. A pod with
// idem.dev/retention "1500ms" is admitted (the injector only asks for a
// positive duration), and its idem, started with exactly the environment
// the injector wrote, against a real etcd, exits 2 on the retention: the
// pod crash-loops instead of being refused naming the annotation
// (deploy/README.md).
func TestReview7AdmittedSidecarStarts(t *testing.T) {
	ep := startEtcd(t, embedded.TLS{})
	cfg := inject.Config{Image: "idem:test", Endpoints: ep, Retention: 24 * time.Hour, SessionTTL: 2 * time.Second,
		ShutdownGrace: time.Second, Native: true}
	pod := `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/retention": "1500ms"}},
		"spec": {"containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}}`
	d := json.NewDecoder(strings.NewReader(pod))
	d.UseNumber()
	var p map[string]any
	d.Decode(&p)
	if _, err := cfg.Mutate(p); err != nil {
		return // refused at admission, naming the annotation: fine
	}
	env := sidecarEnv(t, cfg, pod, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "serve")
	cmd.Dir = t.TempDir()
	cmd.Env = append(append(os.Environ(), "IDEM_TEST_RUN_MAIN=1"), env...)
	logs := &syncBuffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	if logs.waitFor("idem listening", 20*time.Second) {
		return
	}
	t.Fatalf("the pod was admitted, and its idem (the injector's environment) does not start:\n%s", logs.String())
}

// idem injector takes values it never checks, each of which breaks every
// pod it later injects: a --prefix idem serve refuses (no trailing slash:
// every sidecar exits 2), a --retention in milliseconds (likewise), a
// resource quantity the API server refuses (every labelled pod refused).
// docs/CLI.md: a flag value a command refuses exits 2 before anything
// runs; these are refused only later, pod by pod.
func TestReview7InjectorChecksWhatItInjects(t *testing.T) {
	_, _, f := serverCert(t, "c")
	for _, tc := range [][]string{
		{"--prefix", "/idem"},
		{"--retention", "1500ms"},
		{"--resources", `{"requests":{"cpu":"lots"}}`},
		{"--resources", `{"limits":{"memory":"256 MiB"}}`},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		args := append([]string{"injector", "--listen", "127.0.0.1:0", "--tls-cert-file", f.CertFile, "--tls-key-file", f.KeyFile,
			"--image", "idem:test", "--endpoints", "http://etcd:2379"}, tc...)
		cmd := exec.CommandContext(ctx, os.Args[0], args...)
		cmd.Env = append(os.Environ(), "IDEM_TEST_RUN_MAIN=1")
		out, err := cmd.CombinedOutput()
		cancel()
		if exitCode1(err) != 2 {
			t.Errorf("idem injector %q: %v (still running after 5s: %v); want exit 2 naming %s\n%s", tc, err, ctx.Err() != nil, tc[0], out)
		}
	}
}
