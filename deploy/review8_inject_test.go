package deploy

// Review 8: what a real API server and controller manager do with the pods
// the injector writes.

import (
	"strings"
	"testing"
	"time"
)

// README: "Traffic reaches idem first ... a Service with targetPort: http
// sends every request through idem." A pod whose second container also
// declares a port named http (the API server admits it, with a warning)
// is injected; the EndpointSlice controller then resolves the Service's
// targetPort http to the first *app* container declaring the name, before
// any native sidecar: the other container's 9090. Before injection the
// Service reached the app (8080); after it, neither the app nor idem.
// Also: an app port named idem-admin makes idem's container declare two
// ports of that name, and the API server refuses the pod with an error on
// a container its author never wrote, not naming idem.dev/app-port.
func TestReview8InjectedServiceRoutingOnARealControlPlane(t *testing.T) {
	c := sharedControlPlane(t)
	bin := buildIdem(t)
	chartWithInjector(t, c, bin, "r8", "r8-system")
	c.restrictedNamespace(t, "r8-shop")

	// A node for the pod to be bound to (no kubelet runs it: the test
	// writes the pod's status as a kubelet would).
	if out, err := c.kubectl([]byte(`{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "r8-node"}}`), "apply", "-f", "-"); err != nil {
		t.Fatalf("node: %v %s", err, out)
	}
	t.Cleanup(func() { c.kubectl(nil, "delete", "node", "r8-node", "--ignore-not-found") })

	pod := `{"apiVersion": "v1", "kind": "Pod",
  "metadata": {"name": "twin", "labels": {"app": "twin", "idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": "http"}},
  "spec": {
    "nodeName": "r8-node",
    "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
      {"name": "app", "image": "ghcr.io/example/shop:1.0", "ports": [{"name": "http", "containerPort": 8080}], ` + r7SecCtx + `},
      {"name": "admin", "image": "ghcr.io/example/admin:1.0", "ports": [{"name": "http", "containerPort": 9090}], ` + r7SecCtx + `}]}}`
	svc := `{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "twin"},
  "spec": {"selector": {"app": "twin"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}`
	if out, stderr, err := c.kubectlErr([]byte(svc), "apply", "-n", "r8-shop", "-f", "-"); err != nil {
		t.Fatalf("service: %v %s %s", err, out, stderr)
	}
	out, stderr, err := c.kubectlErr([]byte(pod), "create", "-n", "r8-shop", "-o", "json", "-f", "-")
	refused := err != nil && strings.Contains(stderr, "idem.dev/app-port")
	if err != nil && !refused {
		t.Fatalf("the pod: %v %s", err, stderr)
	}
	if refused {
		// Refused by the injector, naming the annotation: fine.
	} else if !strings.Contains(out, `"idem.dev/injected"`) {
		t.Fatalf("the pod was not injected:\n%s", out)
	}
	if !refused {
		if o, err := c.kubectl(nil, "patch", "pod", "twin", "-n", "r8-shop", "--subresource=status", "--type=merge",
			"-p", `{"status": {"phase": "Running", "podIP": "10.244.0.8", "podIPs": [{"ip": "10.244.0.8"}]}}`); err != nil {
			t.Fatalf("pod status: %v %s", err, o)
		}
		var port string
		waitFor(t, 60*time.Second, "the Service's EndpointSlice", func() (bool, string) {
			o, err := c.kubectl(nil, "get", "endpointslices", "-n", "r8-shop", "-l", "kubernetes.io/service-name=twin",
				"-o", `jsonpath={.items[*].ports[*].port}`)
			port = strings.TrimSpace(o)
			return err == nil && port != "", o
		})
		if port != "9480" {
			t.Errorf("the Service's targetPort http reaches port %s of the injected pod, not idem's 9480 (before injection it reached the app's 8080): the pod's traffic bypasses idem", port)
		}
	}

	// An app port named idem-admin.
	pod2 := r7Pod("admin-named", `"idem.dev/app-port": "idem-admin"`, "", `{"name": "idem-admin", "containerPort": 8080}`)
	_, stderr, err = c.kubectlErr([]byte(pod2), "create", "-n", "r8-shop", "-o", "json", "-f", "-")
	if err == nil {
		t.Errorf("a pod whose app port is named idem-admin was stored")
	} else if !strings.Contains(stderr, "idem.dev/app-port") {
		t.Errorf("a pod whose app port is named idem-admin is refused, but not naming idem.dev/app-port: %s", strings.TrimSpace(stderr))
	}
}
