package inject

// Review 7 (issue 39): pods the injector mishandles. Each test fails on
// the current code because of the defect its comment names.

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// idem proxies HTTP over TCP. An app port that is UDP cannot be put
// behind it: idem's port takes the UDP port's name with protocol TCP, so a
// Service whose UDP port targets that name finds no port at all (the
// endpoints controller matches name and protocol), and the app's port has
// lost its name. The injector must refuse the pod, naming the annotation.
func TestReview7UDPAppPortIsRefused(t *testing.T) {
	pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": "dns"}},
		"spec": {"containers": [{"name": "app", "ports": [{"name": "dns", "containerPort": 5353, "protocol": "UDP"}]}]}}`)
	ops, err := testConfig.Mutate(pod)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), AnnAppPort) {
		t.Fatalf("an app port over UDP: ops %d, err %v; want the pod refused naming %s (idem proxies HTTP over TCP)", len(ops), err, AnnAppPort)
	}
}

// deploy/README.md: a pod whose annotations the injector cannot honour ("a
// port the pod uses already") is refused. Native sidecars already in the
// pod (initContainers with restartPolicy Always: a service mesh's proxy, a
// log shipper) share the pod's network too; the injector only looks at
// spec.containers, so idem is given 9480/9481 while another sidecar
// declares 9480, and idem cannot bind it.
func TestReview7PortOfAnExistingSidecarIsInUse(t *testing.T) {
	pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": "http"}},
		"spec": {
		  "initContainers": [{"name": "exporter", "image": "e", "restartPolicy": "Always", "ports": [{"name": "metrics", "containerPort": 9480}]}],
		  "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}}`)
	ops, err := testConfig.Mutate(pod)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "9480") {
		t.Fatalf("another sidecar declares 9480: ops %d, err %v; want the pod refused, as one whose containers use idem's port", len(ops), err)
	}
}

// The app's port gives its name to idem's, and "whatever in the app named
// it now names the number". The injector renames in every container: a
// second container's own port of the same name (Kubernetes allows it,
// with a warning) loses its name too, and that container's probe is
// pointed at the app's port number: the kubelet now probes the wrong
// process.
func TestReview7RenameTouchesOnlyTheAppsContainer(t *testing.T) {
	pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": "8080"}},
		"spec": {"containers": [
		  {"name": "app", "ports": [{"name": "http", "containerPort": 8080}]},
		  {"name": "admin", "ports": [{"name": "http", "containerPort": 9090}],
		   "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}}}]}}`)
	ops, err := testConfig.Mutate(pod)
	if errors.Is(err, ErrInvalid) && strings.Contains(err.Error(), AnnAppPort) {
		return // refused, naming the annotation (review 8: the shared name would take idem's traffic)
	}
	if err != nil {
		t.Fatal(err)
	}
	got := apply(t, pod, ops)
	admin := named(list(got["spec"].(obj)["containers"]), "admin")
	port := admin["readinessProbe"].(obj)["httpGet"].(obj)["port"]
	if fmt.Sprint(port) == "8080" {
		t.Fatalf("the admin container's readiness probe (its own port 9090, named http) now probes %v, the app's port", port)
	}
}

// idem.dev/app-port "by name or number": "08080" (or "+8080") is the
// number 8080, which the pod declares with the name http. The injector
// takes it as an undeclared port: idem's port is named "idem", the app's
// keeps "http", and a Service with targetPort http sends every request
// straight to the app, past idem, with no error anywhere.
func TestReview7AppPortNumberSpelledDifferently(t *testing.T) {
	for _, v := range []string{"08080", "+8080"} {
		pod := decode(t, fmt.Sprintf(`{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/app-port": %q}},
			"spec": {"containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}}`, v))
		ops, err := testConfig.Mutate(pod)
		if errors.Is(err, ErrInvalid) {
			continue // refused: fine
		}
		if err != nil {
			t.Fatal(err)
		}
		got := apply(t, pod, ops)
		app := named(list(got["spec"].(obj)["containers"]), "app")
		if p := list(app["ports"])[0].(obj); p["name"] == "http" {
			t.Errorf("idem.dev/app-port %q: the app's port 8080 keeps the name http (idem's is %v): a Service naming http bypasses idem",
				v, list(list(got["spec"].(obj)["initContainers"])[0].(obj)["ports"])[0].(obj)["name"])
		}
	}
}

// README: a pod whose annotations the injector cannot honour ("a retention
// that is not a duration") is refused. idem serve takes a retention of
// whole seconds only (lease buckets: "must be a whole number of seconds,
// at least 1s"), so "1500ms" or "500ms" cannot be honoured either; the
// injector admits the pod, and its idem exits 2 at every start
// (CrashLoopBackOff), the app behind it never reached.
func TestReview7SubSecondRetentionIsRefused(t *testing.T) {
	for _, v := range []string{"1500ms", "500ms", "90.5s"} {
		pod := decode(t, fmt.Sprintf(`{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {"idem.dev/retention": %q}},
			"spec": {"containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}}`, v))
		ops, err := testConfig.Mutate(pod)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), AnnRetention) {
			t.Errorf("idem.dev/retention %q: ops %d, err %v; want the pod refused naming %s (idem serve takes whole seconds only)", v, len(ops), err, AnnRetention)
		}
	}
}
