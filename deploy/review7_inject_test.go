package deploy

// Review 7 (issue 39): the injector behind a real kube-apiserver, and the
// chart's injector values. Each test fails on the current code because of
// the defects its comments name; the checks marked "guard" inside
// TestReview7InjectorOnARealControlPlane pass and keep documented promises
// (restricted Pod Security for a shards pod without etcd TLS; server-side
// dry runs).

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// r7Pod is a bare pod, admitted by the restricted Pod Security level,
// labelled for idem, with extra JSON spliced into its spec.
func r7Pod(name, annotations, initContainers, ports string) string {
	sc := `"securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}`
	inits := ""
	if initContainers != "" {
		inits = `"initContainers": [` + initContainers + `],`
	}
	return fmt.Sprintf(`{"apiVersion": "v1", "kind": "Pod",
  "metadata": {"name": %q, "labels": {"app": %q, "idem.dev/inject": "true"}, "annotations": {%s}},
  "spec": {
    "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    %s
    "containers": [{"name": "app", "image": "ghcr.io/example/shop:1.0", "ports": [%s], %s}]}}`,
		name, name, annotations, inits, ports, sc)
}

const r7SecCtx = `"securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}`

// The injector, called by a real API server for pods created directly in
// a restricted namespace: what deploy/README.md promises of the pods it
// refuses and of the pods it admits.
func TestReview7InjectorOnARealControlPlane(t *testing.T) {
	c := sharedControlPlane(t)
	bin := buildIdem(t)
	chartWithInjector(t, c, bin, "r7", "r7-system")
	c.restrictedNamespace(t, "r7-shop")

	create := func(pod string, extra ...string) (string, string, error) {
		return c.kubectlErr([]byte(pod), append([]string{"create", "-n", "r7-shop", "-o", "json", "-f", "-"}, extra...)...)
	}

	// Guard: every annotation combination the README lists yields a pod the
	// restricted level admits without a warning; here the shards ConfigMap
	// with no etcd TLS (other volumes, other environment).
	out, stderr, err := create(r7Pod("shards", `"idem.dev/app-port": "http", "idem.dev/shards-configmap": "shop-shards", "idem.dev/etcd-tls-secret": "none", "idem.dev/port": "7000"`,
		"", `{"name": "http", "containerPort": 8080}`))
	if err != nil || strings.TrimSpace(stderr) != "" {
		t.Errorf("guard: a shards pod without etcd TLS: %v\n%s", err, stderr)
	} else if !strings.Contains(out, `"name": "idem"`) {
		t.Errorf("guard: a shards pod was not injected:\n%s", out)
	}

	// Guard: a server-side dry run goes through the webhook (sideEffects
	// None) and stores nothing.
	out, stderr, err = create(r7Pod("dry", `"idem.dev/app-port": "http"`, "", `{"name": "http", "containerPort": 8080}`), "--dry-run=server")
	if err != nil || !strings.Contains(out, `"name": "idem"`) {
		t.Errorf("guard: a dry run: %v %s\n%s", err, stderr, out)
	}
	if o, _ := c.kubectl(nil, "get", "pod", "-n", "r7-shop", "dry", "--ignore-not-found", "-o", "name"); strings.TrimSpace(o) != "" {
		t.Errorf("guard: a dry run stored the pod")
	}

	// Defect: a native sidecar already in the pod declares 9480, idem's
	// default port. README: "a port the pod uses already" is refused with a
	// message naming the annotation. The pod is stored instead, and the API
	// server itself warns of the duplicate port (idem cannot bind it).
	exporter := `{"name": "exporter", "image": "e", "restartPolicy": "Always", "ports": [{"name": "metrics", "containerPort": 9480}], ` + r7SecCtx + `}`
	out, stderr, err = create(r7Pod("busy", `"idem.dev/app-port": "http"`, exporter, `{"name": "http", "containerPort": 8080}`))
	if err == nil {
		t.Errorf("a pod whose own sidecar uses 9480 was stored with idem on 9480 (the API server warned: %q); want it refused naming idem.dev/port", strings.TrimSpace(stderr))
	} else if !strings.Contains(stderr, "idem.dev/port") {
		t.Errorf("refused, but not naming idem.dev/port: %s", stderr)
	}

	// Defect: the app's port is UDP. idem's port takes its name over TCP;
	// a Service with a UDP port targeting that name finds no port on the
	// pod (endpoints match name and protocol). Refused? No: stored.
	out, stderr, err = create(r7Pod("udp", `"idem.dev/app-port": "dns"`, "", `{"name": "dns", "containerPort": 5353, "protocol": "UDP"}`))
	if err == nil {
		var p struct {
			Spec struct {
				InitContainers []struct {
					Name  string
					Ports []map[string]any
				} `json:"initContainers"`
			}
		}
		json.Unmarshal([]byte(out), &p)
		t.Errorf("a pod whose app port is UDP was stored with idem in front of it: %+v; want it refused naming idem.dev/app-port", p.Spec.InitContainers)
	}
	r7PrivilegedCases(t, c)
}

// A Windows pod (spec.os.name windows; the privileged level, as the
// restricted one asks for Linux-only fields) that asks for idem: the
// injector adds its Linux security context (seccomp, capabilities,
// runAsUser...), which the API server forbids for Windows pods, so the
// pod is refused with six validation errors on fields its author never
// wrote, none naming idem or the injector. The injector must refuse it
// itself, saying why (idem's image and security context are Linux's).
func r7PrivilegedCases(t *testing.T, c *controlPlane) {
	if out, err := c.kubectl([]byte("apiVersion: v1\nkind: Namespace\nmetadata: {name: r7-host}\n"), "apply", "--server-side", "--field-manager=idem-test", "-f", "-"); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	pod := `{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "windows", "labels": {"idem.dev/inject": "true"}},
	  "spec": {"os": {"name": "windows"}, "containers": [{"name": "app", "image": "a", "ports": [{"name": "http", "containerPort": 8080}]}]}}`
	_, stderr, err := c.kubectlErr([]byte(pod), "create", "-n", "r7-host", "-o", "json", "-f", "-")
	if err == nil {
		t.Errorf("a Windows pod was stored with idem's Linux sidecar")
	} else if !strings.Contains(stderr, "idem injector") {
		t.Errorf("a Windows pod asking for idem: refused by the API server's validation of the sidecar the injector added, not by the injector:\n%s", stderr)
	}
}

// injector.url: "The webhook's URL, for an injector that runs outside the
// cluster". Without injector.tls.secretName the chart still asks
// cert-manager to put its own self-signed CA into the webhook's caBundle,
// for a certificate whose names are the in-cluster Service's only: the API
// server can never verify the injector at the URL, and with failurePolicy
// Fail every labelled pod is refused. The chart installs this value set
// without a word; it must refuse it (asking for injector.tls.caBundle) or
// issue a certificate for the URL's host.
func TestReview7InjectorURLWithCertManagerRefused(t *testing.T) {
	objects, err := renderRelease(t, map[string]any{"injector": map[string]any{"enabled": true, "url": "https://injector.example.com:8443"}}, "idem", "idem", false)
	if err != nil {
		if strings.Contains(err.Error(), "injector.url") || strings.Contains(err.Error(), "injector.tls") {
			return
		}
		t.Fatalf("refused, but naming neither injector.url nor injector.tls: %v", err)
	}
	for _, doc := range strings.Split(objects, "\n---\n") {
		var o struct {
			Kind string
			Spec struct {
				DNSNames []string `json:"dnsNames"`
			}
			Metadata struct{ Name string }
		}
		yaml.Unmarshal([]byte(doc), &o)
		if o.Kind == "Certificate" && strings.HasSuffix(o.Metadata.Name, "-injector") {
			for _, n := range o.Spec.DNSNames {
				if n == "injector.example.com" {
					return
				}
			}
			t.Fatalf("injector.url https://injector.example.com:8443 with cert-manager: installed, the webhook's CA injected from Certificate %s for %v only; the API server cannot verify the URL's host", o.Metadata.Name, o.Spec.DNSNames)
		}
	}
	t.Fatal("no injector Certificate rendered, and no refusal")
}

// sidecar.resources is the injected sidecars' resources too (the chart
// passes it to idem injector), and the schema takes any request or limit.
// idem injector has flags for a CPU request, a memory request and a memory
// limit only: a CPU limit (or an ephemeral-storage request, which a
// namespace's LimitRange or quota may demand) is accepted by the chart and
// silently dropped from every injected sidecar.
func TestReview7SidecarResourcesAreNotDroppedRefused(t *testing.T) {
	objects, err := renderRelease(t, map[string]any{
		"injector": map[string]any{"enabled": true},
		"sidecar": map[string]any{"resources": map[string]any{
			"requests": map[string]any{"cpu": "100m", "memory": "64Mi", "ephemeral-storage": "1Gi"},
			"limits":   map[string]any{"memory": "256Mi", "cpu": "500m"}}},
	}, "idem", "idem", false)
	if err != nil {
		if strings.Contains(err.Error(), "sidecar.resources") {
			return // refused naming it: fine
		}
		t.Fatal(err)
	}
	args := strings.Join(injectorArgs(t, objects, "x", "x", "x"), " ")
	for _, want := range []string{"500m", "1Gi"} {
		if !strings.Contains(args, want) {
			t.Errorf("sidecar.resources %s is accepted and never reaches idem injector (its args: %s)", want, args)
		}
	}
}
