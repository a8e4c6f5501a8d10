package deploy

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"sigs.k8s.io/yaml"
)

// renderRelease renders the chart as "helm template --namespace ns name
// helm/idem" does, validating values against values.schema.json unless
// skipSchema, and returns the objects as one multi-document YAML.
func renderRelease(t *testing.T, vals map[string]any, name, ns string, skipSchema bool) (string, error) {
	t.Helper()
	chrt, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	caps := chartutil.DefaultCapabilities.Copy()
	kv, err := chartutil.ParseKubeVersion(controlPlaneKubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	caps.KubeVersion = *kv
	rv, err := chartutil.ToRenderValuesWithSchemaValidation(chrt, vals,
		chartutil.ReleaseOptions{Name: name, Namespace: ns, Revision: 1, IsInstall: true}, caps, skipSchema)
	if err != nil {
		return "", err
	}
	files, err := engine.Engine{}.Render(chrt, rv)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, doc := range manifests(files) {
		b.WriteString("---\n")
		b.Write(doc)
		b.WriteString("\n")
	}
	return b.String(), nil
}

// controlPlaneKubeVersion is the release controlplane/go.mod pins.
const controlPlaneKubeVersion = "v1.37.2"

type k8sObject struct {
	Kind     string
	Metadata struct {
		Name      string
		Namespace string
	}
	Spec struct {
		Replicas *int
		Selector struct {
			MatchLabels map[string]string `json:"matchLabels"`
		}
	}
}

// applyChecked server-side applies objects into ns and fails the test on
// any refusal or warning the API server sends back.
func (c *controlPlane) applyChecked(t *testing.T, what, ns, objects string) {
	t.Helper()
	out, stderr, err := c.kubectlErr([]byte(objects), "apply", "--server-side", "--field-manager=helm", "-n", ns, "-f", "-")
	if err != nil {
		t.Fatalf("%s: the API server refused: %v\n%s\n%s", what, err, stderr, out)
	}
	if strings.Contains(stderr, "Warning") || strings.TrimSpace(stderr) != "" {
		t.Errorf("%s: the API server warned:\n%s", what, stderr)
	}
}

func selector(labels map[string]string) string {
	var parts []string
	for k, v := range labels {
		parts = append(parts, k+"="+v)
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

// waitPods waits until the controllers have made n pods matching sel in
// ns, and returns them. With strict, a create refused in ns (an event
// FailedCreate) fails the test at once.
func (c *controlPlane) waitPods(t *testing.T, ns, sel string, n int, what string, strict bool) []map[string]any {
	t.Helper()
	var pods struct{ Items []map[string]any }
	waitFor(t, 90*time.Second, what, func() (bool, string) {
		pods.Items = nil
		c.getJSON(t, &pods, "pods", "-n", ns, "-l", sel)
		if len(pods.Items) >= n {
			return true, ""
		}
		ev, _ := c.kubectl(nil, "get", "events", "-n", ns, "--sort-by=.lastTimestamp")
		if strict && strings.Contains(ev, "FailedCreate") {
			// A controller's create was refused (by admission, Pod Security):
			// it retries, but nothing here changes the answer.
			t.Fatalf("%s: a create was refused; events:\n%s", what, ev)
		}
		return false, fmt.Sprintf("%d pods of %d; events:\n%s", len(pods.Items), n, ev)
	})
	return pods.Items
}

// Issue 39: every documented value set of the chart (ci/*-values.yaml,
// the ones the offline tests render) installs with server-side apply into
// a namespace that enforces the restricted Pod Security level, on a real
// API server with the CRDs installed: every object is accepted with no
// warning, and the controller manager makes each Deployment's and
// StatefulSet's pods (which Pod Security admits) and the backup CronJob's
// Job and pod.
func TestChartOnARealControlPlane(t *testing.T) {
	c := sharedControlPlane(t)
	for _, f := range valuesFiles(t) {
		set := strings.TrimSuffix(filepath.Base(f), "-values.yaml")
		t.Run(set, func(t *testing.T) {
			vals, err := chartutil.ReadValuesFile(f)
			if err != nil {
				t.Fatal(err)
			}
			ns := "chart-" + set
			objects, err := renderRelease(t, vals, "idem", ns, false)
			if err != nil {
				t.Fatal(err)
			}
			c.restrictedNamespace(t, ns)
			t.Cleanup(func() {
				// Cluster-scoped objects (the injector's webhook) would act
				// on the other tests' pods.
				c.kubectl(nil, "delete", "mutatingwebhookconfiguration", "-l", "app.kubernetes.io/part-of=idem", "--ignore-not-found")
			})
			c.applyChecked(t, set, ns, objects)
			workloads := 0
			for _, doc := range strings.Split(objects, "\n---\n") {
				var o k8sObject
				if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
					t.Fatal(err)
				}
				switch o.Kind {
				case "Deployment", "StatefulSet":
					workloads++
					n := 1
					if o.Spec.Replicas != nil {
						n = *o.Spec.Replicas
					}
					pods := c.waitPods(t, ns, selector(o.Spec.Selector.MatchLabels), n, fmt.Sprintf("%s %s's pods", o.Kind, o.Metadata.Name), true)
					for _, p := range pods {
						if phase := p["status"].(map[string]any)["phase"]; phase != "Pending" {
							t.Errorf("%s: pod phase %v; no kubelet runs here", o.Metadata.Name, phase)
						}
					}
				case "CronJob":
					workloads++
					job := o.Metadata.Name + "-now"
					if out, err := c.kubectl(nil, "create", "job", "-n", ns, "--from=cronjob/"+o.Metadata.Name, job); err != nil {
						t.Fatalf("kubectl create job --from=cronjob/%s: %v %s", o.Metadata.Name, err, out)
					}
					c.waitPods(t, ns, "batch.kubernetes.io/job-name="+job, 1, "the backup Job's pod", true)
				}
			}
			if workloads == 0 {
				t.Fatalf("%s made no workload: nothing was checked", set)
			}
		})
	}
}

// A value set the chart's schema refuses is refused with the schema's
// message first, before anything reaches the API server; rendered without
// the schema (helm --skip-schema-validation), the API server refuses it
// too, naming the field.
func TestABadValueSetIsRefused(t *testing.T) {
	c := sharedControlPlane(t)
	vals := map[string]any{"mode": "external", "replicas": -1}
	_, err := renderRelease(t, vals, "idem", "chart-bad", false)
	if err == nil || !strings.HasPrefix(err.Error(), "values don't meet the specifications of the schema") || !strings.Contains(err.Error(), "replicas") {
		t.Fatalf("replicas -1 with the schema: %v; want the schema's message first, naming replicas", err)
	}
	objects, err := renderRelease(t, vals, "idem", "chart-bad", true)
	if err != nil {
		t.Fatal(err)
	}
	c.restrictedNamespace(t, "chart-bad")
	_, stderr, err := c.kubectlErr([]byte(objects), "apply", "--server-side", "--dry-run=server", "--field-manager=helm", "-n", "chart-bad", "-f", "-")
	if err == nil || !strings.Contains(stderr, "spec.replicas") {
		t.Fatalf("replicas -1 past the schema: %v %s; want the API server to refuse spec.replicas", err, stderr)
	}
}
