package deploy

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// buildIdem builds the idem binary of this checkout.
func buildIdem(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "idem")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/idem")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/idem: %v\n%s", err, out)
	}
	return bin
}

// injectorArgs are the arguments the chart gives idem injector (its
// Deployment's container), with the listener and certificate files
// replaced by the test's.
func injectorArgs(t *testing.T, objects, listen, cert, key string) []string {
	t.Helper()
	for _, doc := range strings.Split(objects, "\n---\n") {
		var d struct {
			Kind     string
			Metadata struct{ Name string }
			Spec     struct {
				Template struct {
					Spec struct {
						Containers []struct {
							Name string
							Args []string
						}
					}
				}
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &d); err != nil {
			t.Fatal(err)
		}
		if d.Kind != "Deployment" || !strings.HasSuffix(d.Metadata.Name, "-injector") {
			continue
		}
		var args []string
		for _, a := range d.Spec.Template.Spec.Containers[0].Args {
			switch {
			case strings.HasPrefix(a, "--listen="):
				a = "--listen=" + listen
			case strings.HasPrefix(a, "--tls-cert-file="):
				a = "--tls-cert-file=" + cert
			case strings.HasPrefix(a, "--tls-key-file="):
				a = "--tls-key-file=" + key
			}
			args = append(args, a)
		}
		return args
	}
	t.Fatal("the chart has no injector Deployment")
	return nil
}

// injectorProc is idem injector, run on loopback where the API server
// reaches it by URL (no kubelet runs the chart's Deployment here).
type injectorProc struct {
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex // guards logs
	logs *bytes.Buffer
}

func startInjectorProc(t *testing.T, bin string, args []string, addr string, ca *testCA) *injectorProc {
	t.Helper()
	p := &injectorProc{cmd: exec.Command(bin, args...), done: make(chan struct{}), logs: &bytes.Buffer{}}
	p.cmd.Stderr = &lockedWriter{mu: &p.mu, w: p.logs}
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	t.Cleanup(p.stop)
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	waitFor(t, 60*time.Second, "idem injector to answer /livez", func() (bool, string) {
		select {
		case <-p.done:
			p.mu.Lock()
			defer p.mu.Unlock()
			t.Fatalf("idem injector exited: %s", p.logs)
		default:
		}
		resp, err := client.Get("https://" + addr + "/livez")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == 200, resp.Status
	})
	return p
}

func (p *injectorProc) stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
}

const shopDeployment = `apiVersion: apps/v1
kind: Deployment
metadata:
  name: %[1]s
spec:
  replicas: 2
  selector:
    matchLabels: {app: %[1]s}
  template:
    metadata:
      labels: {app: %[1]s%[2]s}
      annotations: {%[3]s}
    spec:
      securityContext:
        runAsNonRoot: true
        runAsUser: 1000
        seccompProfile: {type: RuntimeDefault}
      containers:
        - name: shop
          image: ghcr.io/example/shop:1.0
          ports:
            - name: http
              containerPort: 8080
          readinessProbe:
            httpGet: {path: /ready, port: http}
          securityContext:
            allowPrivilegeEscalation: false
            capabilities: {drop: ["ALL"]}
---
apiVersion: v1
kind: Service
metadata:
  name: %[1]s
spec:
  selector: {app: %[1]s}
  ports:
    - name: http
      port: 80
      targetPort: http
`

func shop(name string, labelled bool, annotations string) string {
	label := ""
	if labelled {
		label = `, idem.dev/inject: "true"`
	}
	return fmt.Sprintf(shopDeployment, name, label, annotations)
}

type pod struct {
	Metadata struct {
		Name        string
		Labels      map[string]string
		Annotations map[string]string
	}
	Spec struct {
		InitContainers []container `json:"initContainers"`
		Containers     []container
		Grace          int `json:"terminationGracePeriodSeconds"`
	}
}

type container struct {
	Name          string
	Image         string
	RestartPolicy string `json:"restartPolicy"`
	Env           []struct{ Name, Value string }
	Ports         []struct {
		Name          string
		ContainerPort int `json:"containerPort"`
	}
	ReadinessProbe *struct {
		HTTPGet *struct {
			Port any
		} `json:"httpGet"`
	} `json:"readinessProbe"`
	SecurityContext map[string]any `json:"securityContext"`
}

func (c container) env(name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

func (c *controlPlane) pods(t *testing.T, ns, sel string) []pod {
	t.Helper()
	var l struct{ Items []pod }
	c.getJSON(t, &l, "pods", "-n", ns, "-l", sel)
	return l.Items
}

// checkInjected says what is wrong with a stored pod that should carry
// idem as deploy/README.md documents it, "" when nothing is.
func checkInjected(p pod, tenant string) string {
	if len(p.Spec.InitContainers) == 0 || p.Spec.InitContainers[0].Name != "idem" {
		return "idem is not the first init container"
	}
	idem := p.Spec.InitContainers[0]
	n := 0
	for _, c := range append(append([]container{}, p.Spec.InitContainers...), p.Spec.Containers...) {
		if c.Name == "idem" {
			n++
		}
	}
	app := p.Spec.Containers[0]
	switch {
	case n != 1:
		return fmt.Sprintf("%d idem containers", n)
	case idem.RestartPolicy != "Always":
		return "idem is not a native sidecar (restartPolicy " + idem.RestartPolicy + ")"
	case idem.Image != "ghcr.io/idem-dev/idem:latest":
		return "idem's image is " + idem.Image
	case idem.env("IDEM_UPSTREAM") != "http://127.0.0.1:8080":
		return "IDEM_UPSTREAM " + idem.env("IDEM_UPSTREAM")
	case idem.env("IDEM_TENANT") != tenant:
		return "IDEM_TENANT " + idem.env("IDEM_TENANT") + ", want " + tenant
	case idem.env("IDEM_RETENTION") != "48h0m0s":
		return "IDEM_RETENTION " + idem.env("IDEM_RETENTION")
	case !strings.Contains(idem.env("IDEM_ENDPOINTS"), "https://idem-etcd-0.idem-etcd.idem-system.svc:2379"):
		return "IDEM_ENDPOINTS " + idem.env("IDEM_ENDPOINTS")
	case len(idem.Ports) != 2 || idem.Ports[0].Name != "http" || idem.Ports[0].ContainerPort != 9480:
		return fmt.Sprintf("idem's ports %+v; want http on 9480 first", idem.Ports)
	case len(app.Ports) != 1 || app.Ports[0].Name != "" || app.Ports[0].ContainerPort != 8080:
		return fmt.Sprintf("the app's ports %+v; want 8080 without its name", app.Ports)
	case app.ReadinessProbe == nil || fmt.Sprint(app.ReadinessProbe.HTTPGet.Port) != "8080":
		return "the app's readiness probe does not name 8080"
	case p.Spec.Grace != 45:
		return fmt.Sprintf("terminationGracePeriodSeconds %d; want 45 (shutdown grace 40 s, 5 s more)", p.Spec.Grace)
	case p.Metadata.Annotations["idem.dev/injected"] != "ghcr.io/idem-dev/idem:latest":
		return "no idem.dev/injected annotation"
	}
	return ""
}

// chartWithInjector installs the chart as release name into a restricted
// namespace ns, with the injector reached by URL on loopback (no kubelet
// runs the chart's Deployment here) behind a certificate of the test CA,
// and starts idem injector with the chart's own arguments. It returns the
// injector's address and arguments.
func chartWithInjector(t *testing.T, c *controlPlane, bin, name, ns string) (addr string, args []string, inj *injectorProc) {
	t.Helper()
	cert, key := c.ca.issue(t, name+"-injector", name+"-injector", true)
	addr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	vals := map[string]any{"mode": "external", "certManager": map[string]any{"enabled": false},
		"injector": map[string]any{"enabled": true, "url": "https://" + addr,
			"tls": map[string]any{"secretName": "injector-tls", "caBundle": base64.StdEncoding.EncodeToString(c.ca.certPEM)}}}
	objects, err := renderRelease(t, vals, name, ns, false)
	if err != nil {
		t.Fatal(err)
	}
	c.restrictedNamespace(t, ns)
	c.applyChecked(t, "the chart with the injector", ns, objects)
	t.Cleanup(func() {
		c.kubectl(nil, "delete", "mutatingwebhookconfiguration", "-l", "app.kubernetes.io/instance="+name, "--ignore-not-found")
	})
	args = injectorArgs(t, objects, addr, cert, key)
	return addr, args, startInjectorProc(t, bin, args, addr, c.ca)
}

// Issue 39: the sidecar injected by the real API server calling idem's
// webhook over TLS. An annotated Deployment's pods, made by the controller
// manager, are stored with idem as the chart's injector configures it; an
// unlabelled Deployment's are untouched; a pod that carries idem already
// is not injected again; new settings reach new pods; a pod with a wrong
// annotation is refused naming it; and with the webhook down, labelled
// pods wait (failurePolicy Fail) while others are made, until it is back.
func TestSidecarInjectionOnARealControlPlane(t *testing.T) {
	c := sharedControlPlane(t)
	bin := buildIdem(t)
	// The chart, with the injector reached by URL and a provided
	// certificate, into idem's own (restricted) namespace.
	addr, args, inj := chartWithInjector(t, c, bin, "idem", "idem-system")

	c.restrictedNamespace(t, "shop")
	anns := `idem.dev/app-port: http, idem.dev/tenant: shop, idem.dev/retention: 48h`
	c.applyChecked(t, "the shop", "shop", shop("shop", true, anns)+"---\n"+shop("plain", false, ""))
	for _, p := range c.waitPods(t, "shop", "app=shop", 2, "the shop's pods", true) {
		b, _ := json.Marshal(p)
		var sp pod
		json.Unmarshal(b, &sp)
		if msg := checkInjected(sp, "shop"); msg != "" {
			t.Errorf("pod %s: %s\n%s", sp.Metadata.Name, msg, b)
		}
	}
	c.waitPods(t, "shop", "app=plain", 2, "the unlabelled pods", true)
	// idem's own namespace is never injected, labels or not.
	c.applyChecked(t, "a labelled app in idem's namespace", "idem-system", shop("own", true, anns))
	c.waitPods(t, "idem-system", "app=own", 2, "the labelled pods in idem's namespace", true)
	for _, p := range c.pods(t, "idem-system", "app=own") {
		if len(p.Spec.InitContainers) != 0 {
			t.Errorf("a pod in idem's own namespace was injected: %+v", p.Spec.InitContainers)
		}
	}
	for _, p := range c.pods(t, "shop", "app=plain") {
		if len(p.Spec.InitContainers) != 0 || len(p.Spec.Containers) != 1 || p.Metadata.Annotations["idem.dev/injected"] != "" {
			t.Errorf("an unlabelled pod was changed: %+v", p)
		}
	}

	// A pod that carries idem already goes through the webhook unchanged.
	var stored map[string]any
	c.getJSON(t, &stored, "pod", "-n", "shop", c.pods(t, "shop", "app=shop")[0].Metadata.Name)
	meta := stored["metadata"].(map[string]any)
	stored["metadata"] = map[string]any{"name": "again", "labels": meta["labels"], "annotations": meta["annotations"]}
	delete(stored, "status")
	stored["metadata"].(map[string]any)["labels"].(map[string]any)["app"] = "again"
	again, _ := json.Marshal(stored)
	if out, err := c.kubectl(again, "create", "-n", "shop", "-f", "-"); err != nil {
		t.Fatalf("creating an injected pod again: %v %s", err, out)
	}
	if p := c.pods(t, "shop", "app=again"); len(p) != 1 || checkInjected(p[0], "shop") != "" {
		t.Fatalf("a pod injected twice: %+v (%s)", p, checkInjected(p[0], "shop"))
	}

	// New settings: the template's annotation changes, the new pods get it.
	if out, err := c.kubectl(nil, "patch", "deployment", "shop", "-n", "shop", "--type", "merge",
		"-p", `{"spec":{"template":{"metadata":{"annotations":{"idem.dev/tenant":"shop-eu"}}}}}`); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	waitFor(t, 90*time.Second, "a pod with the new tenant", func() (bool, string) {
		for _, p := range c.pods(t, "shop", "app=shop") {
			if checkInjected(p, "shop-eu") == "" {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d pods, none with tenant shop-eu", len(c.pods(t, "shop", "app=shop")))
	})

	// A wrong annotation: the pod is refused, saying which.
	c.applyChecked(t, "a wrong annotation", "shop", shop("typo", true, `idem.dev/app-port: http, idem.dev/retention: soon`))
	waitEvent(t, c, "shop", `idem.dev/retention \"soon\"`, "the refusal of a wrong annotation")
	if p := c.pods(t, "shop", "app=typo"); len(p) != 0 {
		t.Fatalf("a pod with a wrong annotation was created: %+v", p)
	}

	// The webhook down: labelled pods wait, others are made.
	inj.stop()
	c.applyChecked(t, "while the injector is down", "shop", shop("later", true, anns)+"---\n"+shop("plain2", false, ""))
	waitEvent(t, c, "shop", "failed calling webhook", "the refusal while the webhook is down")
	c.waitPods(t, "shop", "app=plain2", 2, "unlabelled pods while the injector is down", false)
	if p := c.pods(t, "shop", "app=later"); len(p) != 0 {
		t.Fatalf("a labelled pod was created without the injector (failurePolicy Fail): %+v", p)
	}
	startInjectorProc(t, bin, args, addr, c.ca)
	waitFor(t, 3*time.Minute, "the labelled pods once the injector is back", func() (bool, string) {
		ps := c.pods(t, "shop", "app=later")
		for _, p := range ps {
			if msg := checkInjected(p, "shop"); msg != "" {
				t.Fatalf("pod %s made once the injector was back: %s", p.Metadata.Name, msg)
			}
		}
		return len(ps) == 2, fmt.Sprintf("%d pods", len(ps))
	})
}

// waitEvent waits for an event in ns whose text contains sub.
func waitEvent(t *testing.T, c *controlPlane, ns, sub, what string) {
	t.Helper()
	waitFor(t, 90*time.Second, what, func() (bool, string) {
		ev, _ := c.kubectl(nil, "get", "events", "-n", ns, "-o", "json")
		return strings.Contains(ev, sub), "no event saying " + sub
	})
}
