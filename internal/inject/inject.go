// Package inject adds idem to a Pod as a sidecar in front of the app, as a
// Kubernetes mutating admission webhook asks (idem injector serves it).
//
// A pod asks for idem with the label idem.dev/inject=true (the webhook's
// objectSelector, so the API server calls the webhook for those pods only)
// and says how with the annotations in Annotations. The mutation is a pure
// function of the pod and the injector's Config: Mutate returns the JSON
// Patch, or an error naming the annotation that is wrong, and a pod that
// carries idem already is returned unchanged.
//
// The pod is handled as JSON (maps), not as a typed Pod, so that fields
// this package does not know, from newer Kubernetes releases included,
// pass through untouched.
package inject

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idem-dev/idem/etcdstore"
)

// Label is the pod label that asks for idem.
const Label = "idem.dev/inject"

// ContainerName is the name of the injected container.
const ContainerName = "idem"

// The annotations a pod is injected with.
const (
	AnnAppPort    = "idem.dev/app-port"
	AnnPort       = "idem.dev/port"
	AnnTenant     = "idem.dev/tenant"
	AnnRetention  = "idem.dev/retention"
	AnnEndpoints  = "idem.dev/etcd-endpoints"
	AnnEtcdTLS    = "idem.dev/etcd-tls-secret"
	AnnShards     = "idem.dev/shards-configmap"
	AnnInjected   = "idem.dev/injected"
	shardsFileKey = "shards.yaml"
)

// Annotation documents one annotation (deploy/README.md's table is tested
// against this list).
type Annotation struct {
	Name, Default, Meaning string
}

// Annotations lists every annotation the injector reads or writes.
var Annotations = []Annotation{
	{AnnAppPort, "the pod's only container port", "The app's port, by name or number. idem forwards to it on 127.0.0.1; if it has a name, idem's port takes that name (and the app's port loses it, its probes now naming the number), so a Service whose targetPort is that name reaches idem first."},
	{AnnPort, "9480", "The port idem's proxy listens on; its admin port (probes, /metrics) is the next one."},
	{AnnTenant, "default", "The tenant of every key this pod's idem claims (idem serve --tenant)."},
	{AnnRetention, "the injector's --retention (24h)", "How long keys are kept after their last write (idem serve --retention)."},
	{AnnEndpoints, "the injector's --endpoints", "The etcd client URLs, comma-separated (idem serve --endpoints)."},
	{AnnEtcdTLS, "the injector's --etcd-tls-secret", "A Secret in the pod's namespace with tls.crt, tls.key and ca.crt: idem's client certificate for etcd; \"none\" for an etcd without client TLS."},
	{AnnShards, "none", "A ConfigMap in the pod's namespace whose key shards.yaml is a shards file (idem serve --shards-file); instead of the etcd endpoints."},
	{AnnInjected, "(set by the injector)", "The image injected. A pod that has it, or a container named idem, is not changed again."},
}

// Config is the injector's side of the mutation: what every sidecar gets
// unless the pod's annotations say otherwise.
type Config struct {
	Image      string
	PullPolicy string // "" leaves Kubernetes' default
	// Endpoints are the default etcd client URLs, comma-separated.
	Endpoints string
	// EtcdTLSSecret is the default Secret of idem's etcd client
	// certificate, "" for none.
	EtcdTLSSecret string
	Prefix        string // etcd key prefix, "" for idem's default
	Retention     time.Duration
	SessionTTL    time.Duration
	ShutdownGrace time.Duration
	// PreStopSeconds keeps idem proxying while the app drains.
	PreStopSeconds int
	// Native puts idem among the init containers with restartPolicy:
	// Always (Kubernetes 1.29 and later): started before the app, stopped
	// after it. Otherwise it is one more app container, with no ordering.
	Native bool
	// Resources are the sidecar's resources (requests and limits, as a
	// container's resources are written), nil for none.
	Resources map[string]map[string]string
}

var quantity = regexp.MustCompile(`^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$`)

// CheckResources says whether r is a container's resources as the API
// server takes them: requests and limits of cpu, memory,
// ephemeral-storage or hugepages-*, Kubernetes quantities, no request
// above its limit.
func CheckResources(r map[string]map[string]string) error {
	for k, m := range r {
		if k != "requests" && k != "limits" {
			return fmt.Errorf("%q: only requests and limits", k)
		}
		for name, q := range m {
			if name != "cpu" && name != "memory" && name != "ephemeral-storage" && !strings.HasPrefix(name, "hugepages-") {
				return fmt.Errorf("%s.%s: a sidecar's resources are cpu, memory, ephemeral-storage or hugepages-*", k, name)
			}
			if !quantity.MatchString(q) {
				return fmt.Errorf("%s.%s %q: not a Kubernetes quantity (100m, 64Mi)", k, name, q)
			}
		}
	}
	for name, q := range r["requests"] {
		if l, ok := r["limits"][name]; ok && quantityValue(q) > quantityValue(l) {
			return fmt.Errorf("requests.%s %s is above limits.%s %s", name, q, name, l)
		}
	}
	return nil
}

// quantityValue is a quantity that CheckResources took, as a number.
func quantityValue(q string) float64 {
	m := quantity.FindStringSubmatch(q)
	v, _ := strconv.ParseFloat(strings.TrimSuffix(q, m[2]), 64)
	mult := map[string]float64{"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
		"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}[m[2]]
	return v * mult
}

// DefaultPort is the port of idem's proxy in the pod unless idem.dev/port
// says otherwise; its admin port is the next one.
const DefaultPort = 9480

// Op is one JSON Patch (RFC 6902) operation.
type Op struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// ErrInvalid marks a pod the injector refuses: an annotation it cannot
// honour. The message names the annotation.
var ErrInvalid = errors.New("invalid idem annotations")

// Wants reports whether a pod (its labels) asks for idem.
func Wants(labels map[string]string) bool { return labels[Label] == "true" }

type obj = map[string]any

// Mutate returns the JSON Patch that adds idem to pod (a Pod as JSON
// decoded with UseNumber), or nil when the pod does not ask for it or
// carries it already.
func (c Config) Mutate(pod obj) ([]Op, error) {
	meta, _ := pod["metadata"].(obj)
	spec, _ := pod["spec"].(obj)
	if spec == nil {
		return nil, fmt.Errorf("%w: the pod has no spec", ErrInvalid)
	}
	labels := stringMap(meta["labels"])
	anns := stringMap(meta["annotations"])
	if !Wants(labels) {
		return nil, nil
	}
	if _, ok := anns[AnnInjected]; ok || hasContainer(spec, ContainerName) {
		return nil, nil // injected already: never twice
	}
	for k := range anns {
		if strings.HasPrefix(k, "idem.dev/") && !slices.ContainsFunc(Annotations, func(a Annotation) bool { return a.Name == k }) {
			return nil, fmt.Errorf("%w: unknown annotation %s (known: %s)", ErrInvalid, k, knownNames())
		}
	}
	if podOS, _ := spec["os"].(obj); podOS != nil && podOS["name"] != nil && podOS["name"] != "linux" {
		return nil, fmt.Errorf("%w: the pod's spec.os.name is %v: idem's sidecar runs on Linux; remove the label %s", ErrInvalid, podOS["name"], Label)
	}
	if spec["hostNetwork"] == true {
		return nil, fmt.Errorf("%w: the pod uses the node's network (hostNetwork): idem's ports would be the node's; remove the label %s", ErrInvalid, Label)
	}
	s, err := c.settings(spec, anns)
	if err != nil {
		return nil, err
	}
	containers := list(spec["containers"])
	// The app's port gives its name to idem's, so that a Service naming it
	// reaches idem; whatever in the app's container named it now names the
	// number (another container's port of the same name is its own).
	if s.portName != "" {
		renamePort(containers[s.appIn].(obj), s.portName, s.appPort)
	}
	side := c.container(s)
	var ops []Op
	if c.Native {
		inits := append([]any{side}, list(spec["initContainers"])...)
		ops = append(ops, Op{"add", "/spec/initContainers", inits})
	} else {
		containers = append(containers, side)
	}
	ops = append(ops, Op{"add", "/spec/containers", containers})
	// idem stops after the app (a native sidecar): the pod's grace period
	// must leave it its preStop and its shutdown grace, or the kubelet kills
	// it with saves still pending. A longer grace is kept.
	need := int64(c.PreStopSeconds) + int64(c.ShutdownGrace/time.Second) + 5
	grace, ok := toInt(spec["terminationGracePeriodSeconds"])
	if !ok {
		grace = 30 // Kubernetes' default
	}
	if int64(grace) < need {
		ops = append(ops, Op{"add", "/spec/terminationGracePeriodSeconds", need})
	}
	if vols := c.volumes(s); len(vols) > 0 {
		ops = append(ops, Op{"add", "/spec/volumes", append(list(spec["volumes"]), vols...)})
	}
	if meta == nil || meta["annotations"] == nil {
		if meta == nil {
			ops = append(ops, Op{"add", "/metadata", obj{}})
		}
		ops = append(ops, Op{"add", "/metadata/annotations", obj{AnnInjected: c.Image}})
	} else {
		ops = append(ops, Op{"add", "/metadata/annotations/" + strings.ReplaceAll(AnnInjected, "/", "~1"), c.Image})
	}
	return ops, nil
}

// settings are one pod's: the injector's defaults and its annotations.
type settings struct {
	appPort   int
	appIn     int    // the index of the app's container; -1 for a port no container declares
	portName  string // the app port's name, given to idem's; "" when it had none
	port      int
	tenant    string
	retention time.Duration
	endpoints string
	etcdTLS   string
	shards    string
}

var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)

func (c Config) settings(spec obj, anns map[string]string) (settings, error) {
	s := settings{port: DefaultPort, tenant: etcdstore.DefaultTenant, retention: c.Retention,
		endpoints: c.Endpoints, etcdTLS: c.EtcdTLSSecret}
	bad := func(ann, format string, a ...any) error {
		return fmt.Errorf("%w: %s %q: %s", ErrInvalid, ann, anns[ann], fmt.Sprintf(format, a...))
	}
	// The app's port: the pod's containers' ports; every container's
	// (init containers and sidecars share the pod's network) for a clash.
	var ports, all []port
	for i, ct := range list(spec["containers"]) {
		ports = append(ports, portsOf(ct, i)...)
	}
	all = ports
	for _, ct := range list(spec["initContainers"]) {
		all = append(all, portsOf(ct, -1)...)
	}
	s.appIn = -1
	if v, ok := anns[AnnAppPort]; ok {
		n, err := strconv.Atoi(v)
		isNum := err == nil
		i := slices.IndexFunc(ports, func(p port) bool { return isNum && p.num == n || !isNum && p.name == v })
		switch {
		case i >= 0:
			if ports[i].proto != "TCP" {
				return s, bad(AnnAppPort, "the port is %s: idem proxies HTTP, over TCP", ports[i].proto)
			}
			if ports[i].host != 0 {
				return s, bad(AnnAppPort, "the port has hostPort %d, whose traffic would reach the app past idem", ports[i].host)
			}
			s.appPort, s.portName, s.appIn = ports[i].num, ports[i].name, ports[i].in
		case !isNum:
			return s, bad(AnnAppPort, "no container port has this name, and it is not a port number (1-65535)")
		case n < 1 || n > 65535:
			return s, bad(AnnAppPort, "not a port number (1-65535)")
		default:
			s.appPort = n // a port the app listens on without declaring it
		}
	} else {
		if len(ports) != 1 {
			return s, fmt.Errorf("%w: %s is not set and the pod declares %d container ports: say which one is the app's", ErrInvalid, AnnAppPort, len(ports))
		}
		if ports[0].proto != "TCP" {
			return s, fmt.Errorf("%w: the pod's only port is %s: idem proxies HTTP, over TCP", ErrInvalid, ports[0].proto)
		}
		if ports[0].host != 0 {
			return s, fmt.Errorf("%w: the pod's only port has hostPort %d, whose traffic would reach the app past idem", ErrInvalid, ports[0].host)
		}
		s.appPort, s.portName, s.appIn = ports[0].num, ports[0].name, ports[0].in
	}
	if s.portName == "idem-admin" {
		return s, fmt.Errorf("%w: %s: the app's port is named idem-admin, the name of idem's admin port; rename the app's port", ErrInvalid, AnnAppPort)
	}
	if s.portName != "" {
		// A Service names a port of the first container that declares it
		// (app containers before sidecars): another container's port of
		// the same name would take idem's traffic.
		for _, p := range all {
			if p.name == s.portName && p.in != s.appIn {
				return s, fmt.Errorf("%w: %s: another container also declares a port named %s, which a Service naming it would reach instead of idem; rename one of them", ErrInvalid, AnnAppPort, s.portName)
			}
		}
	}
	if v, ok := anns[AnnPort]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 65534 {
			return s, bad(AnnPort, "must be a port number from 1 to 65534 (idem's admin port is the next one)")
		}
		s.port = n
	}
	for _, p := range all {
		if p.num == s.port || p.num == s.port+1 {
			return s, fmt.Errorf("%w: idem's ports %d and %d: the pod's containers use %d already; set %s to free ones", ErrInvalid, s.port, s.port+1, p.num, AnnPort)
		}
	}
	if s.appPort == s.port || s.appPort == s.port+1 {
		return s, fmt.Errorf("%w: idem's ports %d and %d: the app's port is %d; set %s to free ones", ErrInvalid, s.port, s.port+1, s.appPort, AnnPort)
	}
	if v, ok := anns[AnnTenant]; ok {
		if err := etcdstore.ValidateTenant(v); err != nil {
			return s, bad(AnnTenant, "%v", err)
		}
		s.tenant = v
	}
	if v, ok := anns[AnnRetention]; ok {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Second || d%time.Second != 0 {
			return s, bad(AnnRetention, "must be a whole number of seconds, at least 1s, such as 24h or 90m")
		}
		s.retention = d
	}
	if v, ok := anns[AnnEndpoints]; ok {
		if err := CheckEndpoints(v); err != nil {
			return s, bad(AnnEndpoints, "%v", err)
		}
		s.endpoints = v
	}
	if v, ok := anns[AnnEtcdTLS]; ok {
		switch {
		case v == "none":
			s.etcdTLS = ""
		case len(v) > 253 || !dnsLabel.MatchString(v):
			return s, bad(AnnEtcdTLS, "must be a Secret's name, or none")
		default:
			s.etcdTLS = v
		}
	}
	if v, ok := anns[AnnShards]; ok {
		if _, both := anns[AnnEndpoints]; both {
			return s, fmt.Errorf("%w: %s and %s exclude each other: a shards file names every cluster", ErrInvalid, AnnShards, AnnEndpoints)
		}
		if len(v) > 253 || !dnsLabel.MatchString(v) {
			return s, bad(AnnShards, "must be a ConfigMap's name")
		}
		s.shards, s.endpoints = v, ""
	}
	if s.endpoints == "" && s.shards == "" {
		return s, fmt.Errorf("%w: no etcd to use: set %s or %s (the injector has no --endpoints)", ErrInvalid, AnnEndpoints, AnnShards)
	}
	return s, nil
}

// container is idem's container for s.
func (c Config) container(s settings) obj {
	env := []struct{ k, v string }{
		{"IDEM_LISTEN", fmt.Sprintf("0.0.0.0:%d", s.port)},
		{"IDEM_ADMIN_LISTEN", fmt.Sprintf("0.0.0.0:%d", s.port+1)},
		{"IDEM_UPSTREAM", fmt.Sprintf("http://127.0.0.1:%d", s.appPort)},
		{"IDEM_TENANT", s.tenant},
		{"IDEM_RETENTION", s.retention.String()},
		{"IDEM_SESSION_TTL", c.SessionTTL.String()},
		{"IDEM_SHUTDOWN_GRACE", c.ShutdownGrace.String()},
		{"IDEM_LOG_FORMAT", "json"},
		// NOSPACE must not take the app's pods out of service: replays
		// and unkeyed traffic still work.
		{"IDEM_READY_WHEN_FULL", "true"},
	}
	if s.shards != "" {
		env = append(env, struct{ k, v string }{"IDEM_SHARDS_FILE", "/etc/idem/shards/" + shardsFileKey})
	} else {
		env = append(env, struct{ k, v string }{"IDEM_ENDPOINTS", s.endpoints})
	}
	if s.etcdTLS != "" {
		env = append(env,
			struct{ k, v string }{"IDEM_CACERT", "/etc/idem/etcd-tls/ca.crt"},
			struct{ k, v string }{"IDEM_CERT", "/etc/idem/etcd-tls/tls.crt"},
			struct{ k, v string }{"IDEM_KEY", "/etc/idem/etcd-tls/tls.key"})
	}
	if c.Prefix != "" {
		env = append(env, struct{ k, v string }{"IDEM_PREFIX", c.Prefix})
	}
	var envs []any
	for _, e := range env {
		envs = append(envs, obj{"name": e.k, "value": e.v})
	}
	name := s.portName
	if name == "" {
		name = "idem"
	}
	probe := func(path string, period int) obj {
		return obj{"httpGet": obj{"path": path, "port": "idem-admin"}, "periodSeconds": period}
	}
	startup := probe("/livez", 1) // alive, not ready: idem passes unkeyed traffic while etcd is away
	startup["failureThreshold"] = 60
	ready := probe("/readyz", 5)
	ready["timeoutSeconds"] = 3 // /readyz answers within 2 s, a hung shard included
	ct := obj{
		"name":  ContainerName,
		"image": c.Image,
		"args":  []any{"serve"},
		"env":   envs,
		"ports": []any{
			obj{"name": name, "containerPort": s.port, "protocol": "TCP"},
			obj{"name": "idem-admin", "containerPort": s.port + 1, "protocol": "TCP"},
		},
		"startupProbe":   startup,
		"readinessProbe": ready,
		"livenessProbe":  probe("/livez", 10),
		"securityContext": obj{
			"allowPrivilegeEscalation": false,
			"readOnlyRootFilesystem":   true,
			"runAsNonRoot":             true,
			"runAsUser":                65532,
			"runAsGroup":               65532,
			"capabilities":             obj{"drop": []any{"ALL"}},
			"seccompProfile":           obj{"type": "RuntimeDefault"},
		},
	}
	if c.PullPolicy != "" {
		ct["imagePullPolicy"] = c.PullPolicy
	}
	if c.Native {
		ct["restartPolicy"] = "Always"
		if c.PreStopSeconds > 0 {
			// Keep proxying while the app drains: endpoints may still
			// route here for a moment after the app was told to stop.
			ct["lifecycle"] = obj{"preStop": obj{"sleep": obj{"seconds": c.PreStopSeconds}}}
		}
	}
	if len(c.Resources) > 0 {
		res := obj{}
		for k, m := range c.Resources {
			o := obj{}
			for name, q := range m {
				o[name] = q
			}
			res[k] = o
		}
		ct["resources"] = res
	}
	var mounts []any
	if s.etcdTLS != "" {
		mounts = append(mounts, obj{"name": "idem-etcd-tls", "mountPath": "/etc/idem/etcd-tls", "readOnly": true})
	}
	if s.shards != "" {
		mounts = append(mounts, obj{"name": "idem-shards", "mountPath": "/etc/idem/shards", "readOnly": true})
	}
	if len(mounts) > 0 {
		ct["volumeMounts"] = mounts
	}
	return ct
}

func (c Config) volumes(s settings) []any {
	var vols []any
	if s.etcdTLS != "" {
		vols = append(vols, obj{"name": "idem-etcd-tls", "secret": obj{"secretName": s.etcdTLS}})
	}
	if s.shards != "" {
		vols = append(vols, obj{"name": "idem-shards", "configMap": obj{"name": s.shards}})
	}
	return vols
}

// renamePort takes name away from the container's port of that name and
// points every probe and lifecycle handler that named it at num.
func renamePort(ct obj, name string, num int) {
	for _, p := range list(ct["ports"]) {
		if pm, _ := p.(obj); pm["name"] == name {
			delete(pm, "name")
		}
	}
	var handlers []any
	for _, k := range []string{"livenessProbe", "readinessProbe", "startupProbe"} {
		handlers = append(handlers, ct[k])
	}
	if lc, _ := ct["lifecycle"].(obj); lc != nil {
		handlers = append(handlers, lc["postStart"], lc["preStop"])
	}
	for _, h := range handlers {
		hm, _ := h.(obj)
		for _, k := range []string{"httpGet", "tcpSocket"} {
			if a, _ := hm[k].(obj); a != nil && a["port"] == name {
				a["port"] = num
			}
		}
	}
}

// port is a container's declared port.
type port struct {
	name, proto string
	num, in     int // in: its container's index among the app's, -1 for an init container
	host        int // its hostPort, 0 for none
}

// portsOf lists a container's declared ports; in is its index among the
// app's containers, -1 for an init container.
func portsOf(ct any, in int) []port {
	var out []port
	for _, p := range list(ct.(obj)["ports"]) {
		pm, _ := p.(obj)
		n, _ := toInt(pm["containerPort"])
		name, _ := pm["name"].(string)
		proto, _ := pm["protocol"].(string)
		if proto == "" {
			proto = "TCP"
		}
		host, _ := toInt(pm["hostPort"])
		out = append(out, port{name, proto, n, in, host})
	}
	return out
}

// CheckEndpoints says whether v is a comma-separated list of etcd client
// URLs.
func CheckEndpoints(v string) error {
	for _, e := range strings.Split(v, ",") {
		u, err := url.Parse(strings.TrimSpace(e))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%q is not an http or https URL (comma-separated etcd client URLs)", e)
		}
	}
	return nil
}

func hasContainer(spec obj, name string) bool {
	for _, k := range []string{"initContainers", "containers"} {
		for _, ct := range list(spec[k]) {
			if m, _ := ct.(obj); m["name"] == name {
				return true
			}
		}
	}
	return false
}

func list(v any) []any {
	l, _ := v.([]any)
	return l
}

func stringMap(v any) map[string]string {
	m, _ := v.(obj)
	out := make(map[string]string, len(m))
	for k, v := range m {
		if s, ok := v.(string); ok {
			out[k] = s
		}
	}
	return out
}

func toInt(v any) (int, bool) {
	switch n := v.(type) {
	case json.Number:
		i, err := n.Int64()
		return int(i), err == nil
	case float64:
		return int(n), true
	case int:
		return n, true
	}
	return 0, false
}

func knownNames() string {
	var names []string
	for _, a := range Annotations {
		names = append(names, a.Name)
	}
	return strings.Join(names, ", ")
}
