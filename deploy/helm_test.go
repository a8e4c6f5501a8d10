package deploy

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	"sigs.k8s.io/yaml"
)

const (
	chartDir    = "helm/idem"
	kubeVersion = "v1.33.0"
)

// render renders the chart as "helm template --namespace idem idem
// helm/idem -f values" does, validating values against values.schema.json.
func render(t *testing.T, vals map[string]any) (map[string]string, error) {
	t.Helper()
	chrt, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return renderChart(chrt, vals)
}

func renderChart(chrt *chart.Chart, vals map[string]any) (map[string]string, error) {
	caps := chartutil.DefaultCapabilities.Copy()
	kv, err := chartutil.ParseKubeVersion(kubeVersion)
	if err != nil {
		return nil, err
	}
	caps.KubeVersion = *kv
	rv, err := chartutil.ToRenderValues(chrt, vals, chartutil.ReleaseOptions{Name: "idem", Namespace: "idem", Revision: 1, IsInstall: true}, caps)
	if err != nil {
		return nil, err
	}
	return engine.Engine{}.Render(chrt, rv)
}

// manifests splits a rendering into its objects' YAML, in a stable order.
func manifests(files map[string]string) [][]byte {
	var names []string
	for name := range files {
		if strings.HasSuffix(name, ".yaml") {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	var docs [][]byte
	for _, name := range names {
		split := releaseutil.SplitManifests(files[name])
		var keys []string
		for k := range split {
			keys = append(keys, k)
		}
		sort.Sort(releaseutil.BySplitManifestsOrder(keys))
		for _, k := range keys {
			if strings.TrimSpace(split[k]) != "" {
				docs = append(docs, []byte(split[k]))
			}
		}
	}
	return docs
}

func valuesFiles(t *testing.T) []string {
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	if err != nil || len(files) < 4 {
		t.Fatalf("values examples in %s/ci: %v %v", chartDir, files, err)
	}
	return files
}

var (
	rendersOnce sync.Once
	rendered    map[string][][]byte
	renderErr   error
)

// helmRenders decodes the chart rendered with each values example; the
// Secrets those values say the user provides count as provided.
func helmRenders(t *testing.T) map[string]*objects {
	t.Helper()
	rendersOnce.Do(func() {
		rendered = map[string][][]byte{}
		for _, f := range valuesFiles(t) {
			vals, err := chartutil.ReadValuesFile(f)
			if err != nil {
				renderErr = err
				return
			}
			files, err := render(t, vals)
			if err != nil {
				renderErr = err
				return
			}
			rendered[f] = manifests(files)
		}
	})
	if renderErr != nil {
		t.Fatal(renderErr)
	}
	out := map[string]*objects{}
	for f, docs := range rendered {
		o := decodeAll(t, f, docs)
		vals, _ := chartutil.ReadValuesFile(f)
		for _, path := range []string{"tls.secretName", "tokens.secretName", "etcd.clientTLS.secretName", "backup.clientTLS.secretName"} {
			if v, err := vals.PathValue(path); err == nil && v != "" {
				o.secrets[v.(string)] = true
			}
		}
		out[f] = o
	}
	return out
}

// helm lint, as "helm lint --strict" runs it: no message above info.
func TestHelmLint(t *testing.T) {
	kv, err := chartutil.ParseKubeVersion(kubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range append([]string{""}, valuesFiles(t)...) {
		vals := map[string]any{}
		if f != "" {
			if vals, err = chartutil.ReadValuesFile(f); err != nil {
				t.Fatal(err)
			}
		}
		res := lint.AllWithKubeVersion(chartDir, vals, "idem", kv)
		for _, m := range res.Messages {
			if m.Severity > support.InfoSev {
				t.Errorf("helm lint with %q: %s", f, m.Error())
			}
		}
	}
}

// Bad values fail at install time, with a message that names the value.
func TestHelmSchemaRefusesBadValues(t *testing.T) {
	for _, c := range []struct {
		yaml, want string
	}{
		{"mode: sidecars", "mode"},
		{"replicas: 0", "replicas"},
		{"config: {retention: 24 hours}", "retention"},
		{"config: {upstream: ftp://x}", "upstream"},
		{"config: {extra: {LISTEN: x}}", "LISTEN"},
		{"etcd: {replicas: 2}", "replicas"},
		{"etcd: {bundled: false}", "etcd.endpoints: etcd.bundled is false"},
		{"etcd: {quotaBackendBytes: 17179869184}", "quotaBackendBytes"},
		{"mode: standalone\nbackup: {enabled: true}", "backup.enabled: backups need an etcd cluster"},
		{"backup: {schedule: hourly}", "schedule"},
		{"app: {port: 8080}", "app.port 8080: collides with idem's own ports"},
		{"mode: sidecar\napp: {port: 8081}", "app.port 8081: collides"},
		{"resources: {requests: {cpu: lots}}", "cpu"},
		{"replica: 3", "replica"},
		{"injector: {enabled: true, failurePolicy: Sometimes}", "failurePolicy"},
		{"injector: {enabled: true, timeoutSeconds: 60}", "timeoutSeconds"},
		{"injector: {enabled: true, url: http://x}", "url"},
		{"injector: {enabled: true, tls: {secretName: inj}}", "injector.tls.caBundle: with injector.tls.secretName"},
		{"injector: {enabled: true}\ncertManager: {enabled: false}", "injector.tls.secretName: the injector's webhook needs a certificate"},
		{"mode: standalone\ninjector: {enabled: true}", "injector.enabled: injected sidecars need an etcd cluster"},
		{"injector: {enabled: true, url: https://injector.example.com}", "injector.url: an injector outside the cluster needs its own certificate"},
	} {
		var vals map[string]any
		if err := yaml.Unmarshal([]byte(c.yaml), &vals); err != nil {
			t.Fatal(err)
		}
		_, err := render(t, vals)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("values %q: %v, want an error naming %q", c.yaml, err, c.want)
		}
	}
}

// The chart and the kustomize overlays describe the same objects where
// they overlap: every field an overlay sets, the chart sets to the same
// value (the chart may add: Helm's labels, more settings), in the objects
// both have. So the two cannot drift apart silently.
func TestHelmMatchesOverlays(t *testing.T) {
	pairs := map[string]string{
		"standalone-values.yaml": "standalone",
		"external-values.yaml":   "external-etcd",
		"sidecar-values.yaml":    "sidecar",
	}
	renders := helmRenders(t)
	for file, ov := range pairs {
		h := renders[filepath.Join(chartDir, "ci", file)]
		if h == nil {
			t.Fatalf("no rendering with %s", file)
		}
		k := build(t, ov)
		shared := 0
		for id, kobj := range k.raw {
			hobj, ok := h.raw[id]
			if !ok {
				if !strings.HasPrefix(id, "Namespace/") { // the chart installs into a namespace; it does not make one
					t.Errorf("%s: overlays/%s has %s, the chart does not", file, ov, id)
				}
				continue
			}
			shared++
			for _, d := range subset(normalise(kobj), normalise(hobj), id) {
				t.Errorf("%s vs overlays/%s: %s", file, ov, d)
			}
		}
		for id := range h.raw {
			if _, ok := k.raw[id]; !ok && !strings.HasPrefix(id, "ServiceAccount/") {
				t.Errorf("%s: the chart has %s, overlays/%s does not", file, id, ov)
			}
		}
		if shared < 3 {
			t.Errorf("%s and overlays/%s share %d objects: the comparison compares nothing", file, ov, shared)
		}
	}
}

// normalise drops what only one side has by design: the namespace (the
// overlay sets it; Helm installs into one), Helm's own labels, and the
// pod template's config checksum.
func normalise(v any) any {
	switch x := v.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, e := range x {
			switch k {
			case "namespace", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version", "helm.sh/chart", "checksum/config", "helm.sh/resource-policy":
				continue
			}
			out[k] = normalise(e)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = normalise(e)
		}
		return out
	}
	return v
}

// subset reports where want (the overlay) sets something got (the chart)
// does not set the same way. Lists of named things (containers, ports,
// env, volumes) are matched by name; other lists element by element.
func subset(want, got any, path string) []string {
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			return []string{path + ": not an object in the chart"}
		}
		var diffs []string
		for k, wv := range w {
			if isEmptyMap(wv) { // {} on one side, absent on the other
				if _, ok := g[k]; !ok {
					continue
				}
			}
			gv, ok := g[k]
			if !ok {
				diffs = append(diffs, path+"."+k+": missing in the chart")
				continue
			}
			diffs = append(diffs, subset(wv, gv, path+"."+k)...)
		}
		return diffs
	case []any:
		g, ok := got.([]any)
		if !ok {
			return []string{path + ": not a list in the chart"}
		}
		if named(w) && named(g) {
			byName := map[string]any{}
			for _, e := range g {
				byName[e.(map[string]any)["name"].(string)] = e
			}
			var diffs []string
			for _, e := range w {
				n := e.(map[string]any)["name"].(string)
				ge, ok := byName[n]
				if !ok {
					diffs = append(diffs, path+"["+n+"]: missing in the chart")
					continue
				}
				diffs = append(diffs, subset(e, ge, path+"["+n+"]")...)
			}
			return diffs
		}
		if len(w) != len(g) {
			return []string{path + ": overlay " + short(w) + ", chart " + short(g)}
		}
		var diffs []string
		for i := range w {
			diffs = append(diffs, subset(w[i], g[i], path+"["+string(rune('0'+i))+"]")...)
		}
		return diffs
	}
	if !reflect.DeepEqual(want, got) {
		return []string{path + ": overlay " + short(want) + ", chart " + short(got)}
	}
	return nil
}

func isEmptyMap(v any) bool { m, ok := v.(map[string]any); return ok && len(m) == 0 }

func named(l []any) bool {
	for _, e := range l {
		m, ok := e.(map[string]any)
		if !ok {
			return false
		}
		if _, ok := m["name"].(string); !ok {
			return false
		}
	}
	return len(l) > 0
}

func short(v any) string {
	b, _ := yaml.Marshal(v)
	s := strings.TrimSpace(string(b))
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return strings.ReplaceAll(s, "\n", " ")
}

// The PrometheusRule the chart installs is the kustomize component's.
func TestAlertsSameInChartAndComponent(t *testing.T) {
	comp, err := os.ReadFile("components/alerts/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var k struct{ Spec any }
	if err := yaml.Unmarshal(comp, &k); err != nil {
		t.Fatal(err)
	}
	var h any
	b, err := os.ReadFile(filepath.Join(chartDir, "files", "alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &h); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(k.Spec, h) {
		t.Fatal("helm/idem/files/alerts.yaml differs from components/alerts/prometheusrule.yaml's spec")
	}
}

// deploy/README.md states the chart's minimum Kubernetes version.
func TestReadmeNamesTheChartsKubernetesVersion(t *testing.T) {
	chrt, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`^>=(\d+\.\d+)\.0-0$`).FindStringSubmatch(chrt.Metadata.KubeVersion)
	if m == nil {
		t.Fatalf("Chart.yaml kubeVersion %q: want >=X.Y.0-0", chrt.Metadata.KubeVersion)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "**Kubernetes "+m[1]+" or later**") {
		t.Errorf("deploy/README.md does not say \"Kubernetes %s or later\", the chart's kubeVersion %s", m[1], chrt.Metadata.KubeVersion)
	}
}
