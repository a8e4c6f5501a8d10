package inject

// Review 8: pods the injector still mishandles. Each test fails on the
// current code because of the defect its comment names.

import (
	"errors"
	"strings"
	"testing"
)

// findPort is how Kubernetes resolves a Service's named targetPort on a pod
// (k8s.io/kubernetes/pkg/api/v1/pod.FindPort, used by the EndpointSlice
// controller): the app containers first, in order, then the native
// sidecars (init containers with restartPolicy Always).
func findPort(pod obj, name string) (int, string) {
	spec := pod["spec"].(obj)
	for _, ct := range list(spec["containers"]) {
		for _, p := range portsOf(ct, 0) {
			if p.name == name && p.proto == "TCP" {
				return p.num, ct.(obj)["name"].(string)
			}
		}
	}
	for _, ct := range list(spec["initContainers"]) {
		if ct.(obj)["restartPolicy"] != "Always" {
			continue
		}
		for _, p := range portsOf(ct, 0) {
			if p.name == name && p.proto == "TCP" {
				return p.num, ct.(obj)["name"].(string)
			}
		}
	}
	return 0, ""
}

// README: "Traffic reaches idem first: idem's port takes the name of the
// app's port, and the app's port loses the name, so a Service with
// targetPort: http sends every request through idem." Kubernetes allows
// two containers of a pod to declare ports of the same name (with a
// warning), and review 7 made the injector leave the other container's
// port alone. But a Service's named targetPort resolves to the first app
// container declaring the name, and native sidecars only after every app
// container: after injection, targetPort http no longer reaches the app
// through idem; it reaches the *other* container (9090), which before
// injection got no traffic at all. The injector must refuse such a pod
// (naming idem.dev/app-port), or make the name reach idem.
func TestReview8ServiceOfASharedPortNameReachesIdem(t *testing.T) {
	pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": "http"}},
		"spec": {"containers": [
		  {"name": "app", "ports": [{"name": "http", "containerPort": 8080}]},
		  {"name": "admin", "ports": [{"name": "http", "containerPort": 9090}]}]}}`)
	if n, ct := findPort(pod, "http"); n != 8080 {
		t.Fatalf("guard: before injection targetPort http is %d (%s)", n, ct)
	}
	ops, err := testConfig.Mutate(pod)
	if err != nil {
		if errors.Is(err, ErrInvalid) && strings.Contains(err.Error(), AnnAppPort) {
			return // refused, naming the annotation: fine
		}
		t.Fatalf("refused, but not naming %s: %v", AnnAppPort, err)
	}
	got := apply(t, pod, ops)
	if n, ct := findPort(got, "http"); n != DefaultPort {
		t.Errorf("after injection a Service's targetPort http reaches %d (container %s), not idem's %d: the app's traffic bypasses idem and goes to another container", n, ct, DefaultPort)
	}
}

// idem's own admin port is named idem-admin. An app port of that name
// (idem.dev/app-port: idem-admin) is given to idem's proxy port too, so
// idem's container declares two ports named idem-admin, which the API
// server refuses ("spec.initContainers[0].ports[1].name: Duplicate
// value"), a message about a container the pod's author never wrote. The
// injector refuses other unusable app ports itself, naming the annotation.
func TestReview8AppPortNamedIdemAdmin(t *testing.T) {
	pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": "idem-admin"}},
		"spec": {"containers": [{"name": "app", "ports": [{"name": "idem-admin", "containerPort": 8080}]}]}}`)
	ops, err := testConfig.Mutate(pod)
	if err != nil {
		if errors.Is(err, ErrInvalid) && strings.Contains(err.Error(), AnnAppPort) {
			return
		}
		t.Fatalf("refused, but not naming %s: %v", AnnAppPort, err)
	}
	got := apply(t, pod, ops)
	idem := list(got["spec"].(obj)["initContainers"])[0].(obj)
	seen := map[string]bool{}
	for _, p := range list(idem["ports"]) {
		name, _ := p.(obj)["name"].(string)
		if seen[name] {
			t.Errorf("idem's container declares two ports named %q (the API server refuses the pod): %v", name, idem["ports"])
		}
		seen[name] = true
	}
}
