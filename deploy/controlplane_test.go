package deploy

// A real Kubernetes control plane for the chart and injection tests:
// kube-apiserver and kube-controller-manager of the release pinned in
// controlplane/go.mod, built from the Go module proxy and cached, on a
// Debian etcd that the test starts on loopback. There is no scheduler and
// no kubelet: pods stay Pending, but everything up to them is real (the
// API server's defaulting, validation, admission, Pod Security, CRD
// schemas, webhooks; the controllers that make ReplicaSets, Pods, Jobs).

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The CRDs the chart's objects need, from the modules' zips.
const (
	certManagerModule = "github.com/cert-manager/cert-manager@v1.21.2"
	certManagerCRDs   = "deploy/crds"
	promOperatorMod   = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
	promOperatorCRDs  = "example/prometheus-operator-crd"
)

// testCA signs every certificate of the control plane's world: the API
// server's, its clients', the webhook's.
type testCA struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	certPEM []byte
	dir     string
	serial  int64
}

func newTestCA(t *testing.T, dir string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idem-test-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{cert: cert, key: key, certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), dir: dir, serial: 1}
	writeFile(t, filepath.Join(dir, "ca.crt"), ca.certPEM)
	return ca
}

// issue writes name.crt and name.key: a server certificate for 127.0.0.1
// when server, else a client certificate of cn in orgs.
func (ca *testCA) issue(t *testing.T, name, cn string, server bool, orgs ...string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca.serial++
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(ca.serial), Subject: pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.DNSNames = []string{"localhost"}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(ca.dir, name+".crt"), filepath.Join(ca.dir, name+".key")
	writeFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	writeFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
	return certFile, keyFile
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// freePort asks the kernel for a free loopback port.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// controlPlane is one etcd, one kube-apiserver, one kube-controller-manager.
type controlPlane struct {
	dir        string
	ca         *testCA
	server     string // https://127.0.0.1:PORT
	kubeconfig string
	procs      []proc
	logs       map[string]*bytes.Buffer
	mu         sync.Mutex // guards logs' buffers
}

var (
	cpOnce sync.Once
	cp     *controlPlane
	cpErr  error
	// cpUsers are the tests that used cp (tests run one at a time here).
	cpUsers = map[string]bool{}
)

// controlPlaneTests are the package's tests that need the control plane:
// the Test functions of its files whose body calls sharedControlPlane.
func controlPlaneTests() ([]string, error) {
	files, err := filepath.Glob("*_test.go")
	if err != nil {
		return nil, err
	}
	var names []string
	fset := token.NewFileSet()
	for _, f := range files {
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			return nil, err
		}
		for _, d := range file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "Test") || fn.Body == nil {
				continue
			}
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				if id, ok := n.(*ast.Ident); ok && id.Name == "sharedControlPlane" {
					names = append(names, fn.Name.Name)
					return false
				}
				return true
			})
		}
	}
	return names, nil
}

// TestMain builds the control plane, when a test that needs it is to run,
// before the tests start: a cold build takes longer than go test's
// default timeout of 10 minutes, which counts from m.Run. Then it stops
// the control plane, if a test started one.
func TestMain(m *testing.M) {
	flag.Parse()
	tests, err := controlPlaneTests()
	if err != nil {
		fmt.Fprintln(os.Stderr, "finding the tests that need the control plane:", err)
		os.Exit(1)
	}
	if re, err := regexp.Compile(flag.Lookup("test.run").Value.String()); err == nil && !testing.Short() {
		for _, name := range tests {
			if re.MatchString(name) {
				if _, _, err := controlPlaneBinaries(); err != nil {
					fmt.Fprintln(os.Stderr, "building the control plane:", err)
					os.Exit(1)
				}
				break
			}
		}
	}
	code := m.Run()
	if cp != nil {
		cp.stop()
	}
	os.Exit(code)
}

// sharedControlPlane starts the control plane on first use; every test
// of the package shares it (it takes a build and a few seconds to start).
// A test that runs again (go test -count=N) gets a new control plane: the
// tests name their namespaces and objects, and the first run's are there.
func sharedControlPlane(t *testing.T) *controlPlane {
	t.Helper()
	cpOnce.Do(func() { cp, cpErr = startControlPlane(t) })
	if cpErr == nil && cpUsers[t.Name()] {
		cp.stop()
		cp, cpErr = startControlPlane(t)
		cpUsers = map[string]bool{}
	}
	cpUsers[t.Name()] = true
	if cpErr != nil {
		t.Fatal(cpErr)
	}
	return cp
}

// controlPlaneBinaries builds kube-apiserver and kube-controller-manager
// at the release controlplane/go.mod pins, into the user's cache directory
// under a hash of that go.mod and go.sum: built once per machine and
// release (a few minutes cold; Go's build cache makes a rebuild a link).
func controlPlaneBinaries() (apiserver, controllerManager string, err error) {
	h := sha256.New()
	for _, f := range []string{"controlplane/go.mod", "controlplane/go.sum"} {
		b, err := os.ReadFile(f)
		if err != nil {
			return "", "", err
		}
		h.Write(b)
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", "", err
	}
	dir := filepath.Join(cache, "idem-controlplane", hex.EncodeToString(h.Sum(nil))[:16])
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", "", err
	}
	var out [2]string
	for i, cmd := range []string{"kube-apiserver", "kube-controller-manager"} {
		out[i] = filepath.Join(dir, cmd)
		if _, err := os.Stat(out[i]); err == nil {
			continue
		}
		tmp := out[i] + fmt.Sprintf(".%d.tmp", os.Getpid())
		b := exec.Command("go", "build", "-trimpath", "-o", tmp, "k8s.io/kubernetes/cmd/"+cmd)
		b.Dir = "controlplane"
		b.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod", "CGO_ENABLED=0")
		if msg, err := b.CombinedOutput(); err != nil {
			return "", "", fmt.Errorf("building %s (controlplane/go.mod): %v\n%s", cmd, err, msg)
		}
		if err := os.Rename(tmp, out[i]); err != nil {
			return "", "", err
		}
	}
	return out[0], out[1], nil
}

func startControlPlane(t *testing.T) (*controlPlane, error) {
	etcd, err := exec.LookPath("etcd")
	if err != nil {
		return nil, errors.New("Debian's etcd-server is not installed (scripts/test-deps installs it)")
	}
	if _, err := exec.LookPath("kubectl"); err != nil {
		return nil, errors.New("Debian's kubectl is not installed (scripts/test-deps installs it)")
	}
	apiserver, kcm, err := controlPlaneBinaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-controlplane-")
	if err != nil {
		return nil, err
	}
	c := &controlPlane{dir: dir, logs: map[string]*bytes.Buffer{}}
	c.ca = newTestCA(t, dir)
	srvCert, srvKey := c.ca.issue(t, "apiserver", "kube-apiserver", true)
	adminCert, adminKey := c.ca.issue(t, "admin", "admin", false, "system:masters")
	kcmCert, kcmKey := c.ca.issue(t, "kcm", "system:kube-controller-manager", false)
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	kder, _ := x509.MarshalECPrivateKey(saKey)
	pder, _ := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	writeFile(t, filepath.Join(dir, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
	writeFile(t, filepath.Join(dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pder}))

	clientPort, peerPort, apiPort := freePort(t), freePort(t), freePort(t)
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	c.start("etcd", etcd, "--name", "cp", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL, "--initial-cluster", "cp="+peerURL)
	c.server = fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	c.start("kube-apiserver", apiserver,
		"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", fmt.Sprint(apiPort),
		"--tls-cert-file", srvCert, "--tls-private-key-file", srvKey, "--client-ca-file", filepath.Join(dir, "ca.crt"),
		"--cert-dir", filepath.Join(dir, "apiserver-certs"),
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", filepath.Join(dir, "sa.pub"),
		"--service-account-signing-key-file", filepath.Join(dir, "sa.key"),
		"--service-cluster-ip-range", "10.96.0.0/16",
		"--endpoint-reconciler-type", "none", // no node runs here: no endpoints of its own to keep
		"--authorization-mode", "Node,RBAC",
		"--enable-priority-and-fairness=false")
	c.kubeconfig = c.writeKubeconfig(t, "admin", adminCert, adminKey)
	if err := c.waitReady(); err != nil {
		c.stop()
		return nil, err
	}
	kcmConfig := c.writeKubeconfig(t, "kcm", kcmCert, kcmKey)
	flex := filepath.Join(dir, "flex")
	os.MkdirAll(flex, 0o755)
	c.start("kube-controller-manager", kcm,
		"--kubeconfig", kcmConfig, "--authentication-kubeconfig", kcmConfig, "--authorization-kubeconfig", kcmConfig,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", fmt.Sprint(freePort(t)),
		"--cert-dir", filepath.Join(dir, "kcm-certs"),
		"--service-account-private-key-file", filepath.Join(dir, "sa.key"), "--root-ca-file", filepath.Join(dir, "ca.crt"),
		"--use-service-account-credentials=true", // each controller with its own account, as in a real cluster
		"--flex-volume-plugin-dir", flex,         // it writes nowhere else
		"--controllers", "*,-csrsigning,-nodeipam")
	// The controller manager works once its service account controller has
	// made the default namespace's account.
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if _, err := c.kubectl(nil, "get", "serviceaccount", "default", "-n", "default"); err == nil {
			break
		}
		if d := c.dead(); d != "" || time.Now().After(deadline) {
			c.stop()
			return nil, fmt.Errorf("kube-controller-manager made no service account in 2m: %s\n%s", d, c.tail("kube-controller-manager"))
		}
		time.Sleep(200 * time.Millisecond) // polling a process we do not control
	}
	for _, d := range []string{filepath.Join(modDir(certManagerModule), certManagerCRDs), filepath.Join(modDir(promOperatorMod), promOperatorCRDs)} {
		if strings.HasPrefix(d, "!") {
			c.stop()
			return nil, errors.New(d[1:])
		}
		if out, err := c.kubectl(nil, "apply", "--server-side", "--field-manager=idem-test", "-f", d); err != nil {
			c.stop()
			return nil, fmt.Errorf("installing the CRDs of %s: %v\n%s", d, err, out)
		}
	}
	if out, err := c.kubectl(nil, "wait", "--for=condition=Established", "--timeout=60s", "crd", "--all"); err != nil {
		c.stop()
		return nil, fmt.Errorf("CRDs not established: %v\n%s", err, out)
	}
	return c, nil
}

// modDir downloads a module (go mod download) and returns its directory,
// or "!" and the error.
func modDir(mod string) string {
	cmd := exec.Command("go", "mod", "download", "-json", mod)
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	cmd.Dir = os.TempDir()
	out, err := cmd.Output()
	var info struct{ Dir, Error string }
	if jerr := json.Unmarshal(out, &info); err != nil || jerr != nil || info.Dir == "" {
		return fmt.Sprintf("!go mod download %s: %v %v %s", mod, err, jerr, info.Error)
	}
	return info.Dir
}

func (c *controlPlane) writeKubeconfig(t *testing.T, user, cert, key string) string {
	t.Helper()
	path := filepath.Join(c.dir, user+".kubeconfig")
	writeFile(t, path, fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: test
  context: {cluster: test, user: %s}
current-context: test
`, c.server, filepath.Join(c.dir, "ca.crt"), user, cert, key, user))
	return path
}

// start starts a process of the control plane, its output kept for the
// failure report.
func (c *controlPlane) start(name, bin string, args ...string) {
	cmd := exec.Command(bin, args...)
	buf := &bytes.Buffer{}
	c.mu.Lock()
	c.logs[name] = buf
	c.mu.Unlock()
	w := &lockedWriter{mu: &c.mu, w: buf}
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // gone with the test binary, whatever happens
	done := make(chan struct{})
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(w, "cannot start: %v\n", err)
		close(done)
		return
	}
	c.procs = append(c.procs, proc{name, cmd, done})
	go func() {
		err := cmd.Wait()
		fmt.Fprintf(w, "\n[%s exited: %v]\n", name, err)
		close(done)
	}()
}

// dead names a process of the control plane that has exited, with the end
// of its output; "" while all run.
func (c *controlPlane) dead() string {
	for _, p := range c.procs {
		select {
		case <-p.done:
			return p.name + " exited:\n" + c.tail(p.name)
		default:
		}
	}
	return ""
}

// proc is a process of the control plane; done is closed when it has
// exited.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// tail is the end of a process's output.
func (c *controlPlane) tail(name string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.logs[name].String()
	if len(s) > 4000 {
		s = s[len(s)-4000:]
	}
	return s
}

func (c *controlPlane) waitReady() error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		out, err := c.kubectl(nil, "get", "--raw", "/readyz")
		if err == nil && strings.TrimSpace(out) == "ok" {
			return nil
		}
		if d := c.dead(); d != "" || time.Now().After(deadline) {
			return fmt.Errorf("kube-apiserver not ready in 2m: %v %s %s\n%s", err, out, d, c.tail("kube-apiserver"))
		}
		time.Sleep(200 * time.Millisecond) // polling a process we do not control
	}
}

func (c *controlPlane) stop() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-p.done
		}
	}
	os.RemoveAll(c.dir)
}

// kubectl runs Debian's kubectl against the control plane, stdin from in;
// it returns stdout and, on failure, stderr in the error.
func (c *controlPlane) kubectl(in []byte, args ...string) (string, error) {
	out, stderr, err := c.kubectlErr(in, args...)
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, stderr)
	}
	return out, nil
}

// kubectlErr is kubectl that also returns stderr, where kubectl prints the
// API server's warnings.
func (c *controlPlane) kubectlErr(in []byte, args ...string) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "kubectl", append([]string{"--kubeconfig", c.kubeconfig}, args...)...)
	if in != nil {
		cmd.Stdin = bytes.NewReader(in)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

// restrictedNamespace makes a namespace that enforces (and warns and
// audits at) the restricted Pod Security level.
func (c *controlPlane) restrictedNamespace(t *testing.T, name string) {
	t.Helper()
	ns := fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata:
  name: %s
  labels:
    pod-security.kubernetes.io/enforce: restricted
    pod-security.kubernetes.io/enforce-version: latest
    pod-security.kubernetes.io/warn: restricted
    pod-security.kubernetes.io/warn-version: latest
    pod-security.kubernetes.io/audit: restricted
`, name)
	if out, err := c.kubectl([]byte(ns), "apply", "--server-side", "--field-manager=idem-test", "-f", "-"); err != nil {
		t.Fatalf("namespace %s: %v %s", name, err, out)
	}
}

// waitFor polls cond (a question to the API server, which we cannot
// subscribe to from kubectl cheaply) until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v; last seen:\n%s", what, timeout, state)
		}
		if cp != nil {
			if d := cp.dead(); d != "" {
				t.Fatalf("%s: the control plane is down: %s", what, d)
			}
		}
		time.Sleep(250 * time.Millisecond) // polling the API server
	}
}

// getJSON gets objects as JSON.
func (c *controlPlane) getJSON(t *testing.T, v any, args ...string) {
	t.Helper()
	out, err := c.kubectl(nil, append([]string{"get", "-o", "json"}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("kubectl get %v: %v", args, err)
	}
}

// TestMain's list of the tests that need the control plane finds them
// all (it decides whether to build the control plane first).
func TestControlPlaneTestsAreFound(t *testing.T) {
	tests, err := controlPlaneTests()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"TestChartOnARealControlPlane", "TestABadValueSetIsRefused", "TestSidecarInjectionOnARealControlPlane", "TestReview7InjectorOnARealControlPlane"} {
		if !slices.Contains(tests, want) {
			t.Errorf("%s is not found among the control plane's tests %v", want, tests)
		}
	}
	if slices.Contains(tests, "TestHelmSchemaRefusesBadValues") {
		t.Errorf("an offline test is counted as needing the control plane: %v", tests)
	}
}
