package inject

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
)

var testConfig = Config{
	Image: "ghcr.io/idem-dev/idem:test", Endpoints: "https://etcd-0.etcd:2379,https://etcd-1.etcd:2379",
	EtcdTLSSecret: "idem-etcd-client-tls", Retention: 24 * time.Hour, SessionTTL: 10 * time.Second,
	ShutdownGrace: 40 * time.Second, PreStopSeconds: 10, Native: true,
	Resources: map[string]map[string]string{"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi", "cpu": "1"}},
}

// podJSON is an app's pod as the API server sends it, with fields the
// injector does not know (they must pass through untouched).
const podJSON = `{
  "apiVersion": "v1", "kind": "Pod",
  "metadata": {"generateName": "shop-", "labels": {"app": "shop", "idem.dev/inject": "true"},
               "annotations": {"idem.dev/app-port": "http", "idem.dev/tenant": "shop", "other.io/x": "y"}},
  "spec": {
    "futureField": {"a": 1},
    "initContainers": [{"name": "migrate", "image": "shop:1", "args": ["migrate"]}],
    "containers": [{
      "name": "shop", "image": "shop:1",
      "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}, {"name": "debug", "containerPort": 6060}],
      "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
      "livenessProbe": {"tcpSocket": {"port": "http"}},
      "startupProbe": {"httpGet": {"path": "/start", "port": "debug"}},
      "lifecycle": {"preStop": {"httpGet": {"path": "/drain", "port": "http"}}}
    }],
    "volumes": [{"name": "data", "emptyDir": {}}]
  }
}`

func decode(t *testing.T, s string) obj {
	t.Helper()
	d := json.NewDecoder(strings.NewReader(s))
	d.UseNumber()
	var o obj
	if err := d.Decode(&o); err != nil {
		t.Fatal(err)
	}
	return o
}

// apply applies a JSON Patch of "add" operations, as RFC 6902 says (an
// add on an existing member replaces it), to a copy of doc.
func apply(t *testing.T, doc obj, ops []Op) obj {
	t.Helper()
	b, _ := json.Marshal(doc)
	out := decode(t, string(b))
	for _, op := range ops {
		if op.Op != "add" {
			t.Fatalf("op %q: the injector only adds", op.Op)
		}
		parts := strings.Split(strings.TrimPrefix(op.Path, "/"), "/")
		cur := out
		for _, p := range parts[:len(parts)-1] {
			next, ok := cur[unescape(p)].(obj)
			if !ok {
				t.Fatalf("op %s: the parent %q does not exist", op.Path, p)
			}
			cur = next
		}
		vb, _ := json.Marshal(op.Value)
		d := json.NewDecoder(bytes.NewReader(vb))
		d.UseNumber()
		var v any
		if err := d.Decode(&v); err != nil {
			t.Fatal(err)
		}
		cur[unescape(parts[len(parts)-1])] = v
	}
	return out
}

func unescape(p string) string {
	return strings.ReplaceAll(strings.ReplaceAll(p, "~1", "/"), "~0", "~")
}

func env(ct obj) map[string]string {
	m := map[string]string{}
	for _, e := range list(ct["env"]) {
		em := e.(obj)
		m[em["name"].(string)] = em["value"].(string)
	}
	return m
}

func named(l []any, name string) obj {
	for _, c := range l {
		if c.(obj)["name"] == name {
			return c.(obj)
		}
	}
	return nil
}

func TestInjectsANativeSidecarInFrontOfTheAppsNamedPort(t *testing.T) {
	pod := decode(t, podJSON)
	ops, err := testConfig.Mutate(pod)
	if err != nil {
		t.Fatal(err)
	}
	got := apply(t, pod, ops)
	spec := got["spec"].(obj)
	inits := list(spec["initContainers"])
	if len(inits) != 2 || inits[0].(obj)["name"] != "idem" || inits[1].(obj)["name"] != "migrate" {
		t.Fatalf("init containers = %v; want idem first, then the pod's own", inits)
	}
	idem := inits[0].(obj)
	if idem["restartPolicy"] != "Always" || idem["image"] != testConfig.Image {
		t.Fatalf("idem is not a native sidecar of the configured image: %v", idem)
	}
	e := env(idem)
	want := map[string]string{
		"IDEM_LISTEN": "0.0.0.0:9480", "IDEM_ADMIN_LISTEN": "0.0.0.0:9481", "IDEM_UPSTREAM": "http://127.0.0.1:8080",
		"IDEM_TENANT": "shop", "IDEM_RETENTION": "24h0m0s", "IDEM_ENDPOINTS": testConfig.Endpoints,
		"IDEM_CACERT": "/etc/idem/etcd-tls/ca.crt", "IDEM_CERT": "/etc/idem/etcd-tls/tls.crt", "IDEM_KEY": "/etc/idem/etcd-tls/tls.key",
		"IDEM_SESSION_TTL": "10s", "IDEM_SHUTDOWN_GRACE": "40s", "IDEM_READY_WHEN_FULL": "true", "IDEM_LOG_FORMAT": "json",
	}
	if !reflect.DeepEqual(e, want) {
		t.Fatalf("idem's environment:\n got %v\nwant %v", e, want)
	}
	// idem took the app port's name; the app's probes and handlers that
	// named it now name its number, the others are unchanged.
	if p := list(idem["ports"])[0].(obj); p["name"] != "http" || fmt.Sprint(p["containerPort"]) != "9480" {
		t.Fatalf("idem's port = %v; want http on 9480", p)
	}
	app := list(spec["containers"])[0].(obj)
	ports := list(app["ports"])
	if _, has := ports[0].(obj)["name"]; has || fmt.Sprint(ports[0].(obj)["containerPort"]) != "8080" || ports[1].(obj)["name"] != "debug" {
		t.Fatalf("the app's ports = %v; want 8080 without its name, debug unchanged", ports)
	}
	for path, want := range map[string]string{
		"readinessProbe.httpGet": "8080", "livenessProbe.tcpSocket": "8080", "startupProbe.httpGet": "debug",
	} {
		k := strings.Split(path, ".")
		if got := fmt.Sprint(app[k[0]].(obj)[k[1]].(obj)["port"]); got != want {
			t.Errorf("the app's %s port = %s; want %s", path, got, want)
		}
	}
	if got := fmt.Sprint(app["lifecycle"].(obj)["preStop"].(obj)["httpGet"].(obj)["port"]); got != "8080" {
		t.Errorf("the app's preStop port = %s; want 8080", got)
	}
	// Restricted Pod Security on its own.
	sc := idem["securityContext"].(obj)
	if sc["runAsNonRoot"] != true || sc["allowPrivilegeEscalation"] != false || sc["seccompProfile"].(obj)["type"] != "RuntimeDefault" {
		t.Fatalf("idem's securityContext is not restricted: %v", sc)
	}
	if v := named(list(spec["volumes"]), "idem-etcd-tls"); v == nil || v["secret"].(obj)["secretName"] != "idem-etcd-client-tls" {
		t.Fatalf("volumes = %v; want the etcd client secret", spec["volumes"])
	}
	if r := idem["resources"].(obj); r["limits"].(obj)["cpu"] != "1" || r["requests"].(obj)["memory"] != "64Mi" {
		t.Fatalf("idem's resources = %v; want the injector's", r)
	}
	if named(list(spec["volumes"]), "data") == nil {
		t.Fatal("the pod's own volume is gone")
	}
	if !reflect.DeepEqual(spec["futureField"], pod["spec"].(obj)["futureField"]) {
		t.Fatal("a field the injector does not know was changed")
	}
	// The grace period leaves idem its preStop and shutdown grace after
	// the app (10 + 40 + 5 s), where the default (30 s) would not.
	if g := fmt.Sprint(spec["terminationGracePeriodSeconds"]); g != "55" {
		t.Errorf("terminationGracePeriodSeconds = %s; want 55", g)
	}
	long := decode(t, strings.Replace(podJSON, `"futureField"`, `"terminationGracePeriodSeconds": 120, "futureField"`, 1))
	ops, _ = testConfig.Mutate(long)
	if g := fmt.Sprint(apply(t, long, ops)["spec"].(obj)["terminationGracePeriodSeconds"]); g != "120" {
		t.Errorf("a longer grace period was changed to %s", g)
	}
	anns := got["metadata"].(obj)["annotations"].(obj)
	if anns[AnnInjected] != testConfig.Image || anns["other.io/x"] != "y" {
		t.Fatalf("annotations = %v", anns)
	}
	// Injected once: a second pass changes nothing.
	again, err := testConfig.Mutate(got)
	if err != nil || again != nil {
		t.Fatalf("a second injection = %v, %v; want no change", again, err)
	}
}

func TestAPodThatDoesNotAskIsUntouched(t *testing.T) {
	for _, labels := range []string{`{}`, `{"idem.dev/inject": "false"}`, `{"idem.dev/inject": "True"}`} {
		pod := decode(t, strings.Replace(podJSON, `{"app": "shop", "idem.dev/inject": "true"}`, labels, 1))
		if ops, err := testConfig.Mutate(pod); err != nil || ops != nil {
			t.Errorf("labels %s: %v, %v; want no change", labels, ops, err)
		}
	}
	// A pod that carries an idem container of its own (the chart's sidecar
	// mode, or an injection of another injector) is left alone.
	pod := decode(t, strings.Replace(podJSON, `"name": "migrate"`, `"name": "idem"`, 1))
	if ops, err := testConfig.Mutate(pod); err != nil || ops != nil {
		t.Errorf("a pod with an idem container: %v, %v; want no change", ops, err)
	}
}

func TestContainerModeAndAnnotations(t *testing.T) {
	c := testConfig
	c.Native = false
	pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": {
		"idem.dev/app-port": "3000", "idem.dev/port": "7000", "idem.dev/retention": "90m",
		"idem.dev/shards-configmap": "shop-shards", "idem.dev/etcd-tls-secret": "none"}},
		"spec": {"containers": [{"name": "app", "image": "a"}]}}`)
	ops, err := c.Mutate(pod)
	if err != nil {
		t.Fatal(err)
	}
	got := apply(t, pod, ops)
	spec := got["spec"].(obj)
	if spec["initContainers"] != nil {
		t.Fatal("container mode added an init container")
	}
	idem := named(list(spec["containers"]), "idem")
	if idem == nil || idem["restartPolicy"] != nil || idem["lifecycle"] != nil {
		t.Fatalf("container mode: idem = %v; want an app container without restartPolicy or preStop sleep", idem)
	}
	e := env(idem)
	if e["IDEM_UPSTREAM"] != "http://127.0.0.1:3000" || e["IDEM_LISTEN"] != "0.0.0.0:7000" || e["IDEM_ADMIN_LISTEN"] != "0.0.0.0:7001" ||
		e["IDEM_RETENTION"] != "1h30m0s" || e["IDEM_SHARDS_FILE"] != "/etc/idem/shards/shards.yaml" || e["IDEM_ENDPOINTS"] != "" || e["IDEM_CERT"] != "" {
		t.Fatalf("environment = %v", e)
	}
	if p := list(idem["ports"])[0].(obj); p["name"] != "idem" {
		t.Fatalf("an app port without a name: idem's port is named %v; want idem", p["name"])
	}
	if v := named(list(spec["volumes"]), "idem-shards"); v == nil || v["configMap"].(obj)["name"] != "shop-shards" {
		t.Fatalf("volumes = %v", spec["volumes"])
	}
	if got["metadata"].(obj)["annotations"].(obj)[AnnInjected] != c.Image {
		t.Fatal("no idem.dev/injected annotation")
	}
}

func TestBadAnnotationsAreRefusedNamingThem(t *testing.T) {
	base := `{"metadata": {"labels": {"idem.dev/inject": "true"}, "annotations": %s},
		"spec": {"containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}, {"containerPort": 9481, "hostPort": 30000}]}]}}`
	for _, tc := range []struct{ anns, want string }{
		{`{"idem.dev/app-port": "http", "idem.dev/tennant": "a"}`, "unknown annotation idem.dev/tennant"},
		{`{}`, "idem.dev/app-port is not set and the pod declares 2 container ports"},
		{`{"idem.dev/app-port": "grpc"}`, `idem.dev/app-port "grpc": no container port has this name`},
		{`{"idem.dev/app-port": "http"}`, "idem's ports 9480 and 9481: the pod's containers use 9481 already"},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "8080"}`, "the pod's containers use 8080 already"},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "65535"}`, `idem.dev/port "65535"`},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "7000", "idem.dev/retention": "-1h"}`, `idem.dev/retention "-1h": must be a whole number of seconds`},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "7000", "idem.dev/tenant": "a/b"}`, `idem.dev/tenant "a/b"`},
		{`{"idem.dev/app-port": "70000"}`, `idem.dev/app-port "70000": not a port number`},
		{`{"idem.dev/app-port": "9481", "idem.dev/port": "7000"}`, `idem.dev/app-port "9481": the port has hostPort 30000`},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "7000", "idem.dev/etcd-endpoints": "etcd:2379"}`, `idem.dev/etcd-endpoints "etcd:2379"`},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "7000", "idem.dev/etcd-endpoints": "http://e:2379", "idem.dev/shards-configmap": "s"}`, "exclude each other"},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "7000", "idem.dev/shards-configmap": "Bad_Name"}`, `idem.dev/shards-configmap "Bad_Name"`},
		{`{"idem.dev/app-port": "http", "idem.dev/port": "7000", "idem.dev/etcd-tls-secret": "Bad Name"}`, `idem.dev/etcd-tls-secret "Bad Name"`},
	} {
		pod := decode(t, fmt.Sprintf(base, tc.anns))
		ops, err := testConfig.Mutate(pod)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || ops != nil {
			t.Errorf("annotations %s: %v, %v; want ErrInvalid saying %q", tc.anns, ops, err, tc.want)
		}
	}
	c := testConfig
	c.Endpoints = ""
	pod := decode(t, fmt.Sprintf(base, `{"idem.dev/app-port": "http", "idem.dev/port": "7000"}`))
	if _, err := c.Mutate(pod); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no etcd to use") {
		t.Errorf("no endpoints anywhere: %v", err)
	}
}

// deploy/README.md's table of annotations is this package's list, word
// for word (issue 39: the docs say what the code reads).
func TestREADMEListsEveryAnnotation(t *testing.T) {
	doc, err := os.ReadFile("../../deploy/README.md")
	if err != nil {
		t.Fatal(err)
	}
	var want strings.Builder
	want.WriteString("| annotation | default | what it does |\n|---|---|---|\n")
	for _, a := range Annotations {
		fmt.Fprintf(&want, "| `%s` | %s | %s |\n", a.Name, a.Default, strings.ReplaceAll(a.Meaning, "|", "\\|"))
	}
	if !strings.Contains(string(doc), want.String()) {
		t.Fatalf("deploy/README.md does not have the annotations table; want:\n%s", want.String())
	}
}

// A labelled pod idem cannot serve is refused, saying why: a Windows pod
// (idem's sidecar and its security context are Linux's), a hostNetwork
// pod (idem's ports would be the node's).
func TestPodsIdemCannotServeAreRefused(t *testing.T) {
	for spec, want := range map[string]string{
		`"os": {"name": "windows"}, `: "spec.os.name is windows",
		`"hostNetwork": true, `:       "hostNetwork",
	} {
		pod := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}}, "spec": {`+spec+`"containers": [{"name": "app", "ports": [{"containerPort": 8080}]}]}}`)
		if ops, err := testConfig.Mutate(pod); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) || ops != nil {
			t.Errorf("%s: %v, %v; want refused saying %q", spec, ops, err, want)
		}
	}
	linux := decode(t, `{"metadata": {"labels": {"idem.dev/inject": "true"}}, "spec": {"os": {"name": "linux"}, "containers": [{"name": "app", "ports": [{"containerPort": 8080}]}]}}`)
	if _, err := testConfig.Mutate(linux); err != nil {
		t.Errorf("a Linux pod: %v", err)
	}
}
