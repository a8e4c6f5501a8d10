// Package deploy holds idem's Kubernetes manifests; its tests build every
// overlay with kustomize and check the result offline, without a cluster.
package deploy

import (
	"debug/elf"
	"fmt"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	psaapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

var overlays = []string{"standalone", "external-etcd", "sidecar"}

// certificate is the part of a cert-manager Certificate these manifests use,
// for strict decoding (cert-manager's own types are not a dependency).
type certificate struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		IsCA        bool     `json:"isCA,omitempty"`
		CommonName  string   `json:"commonName,omitempty"`
		SecretName  string   `json:"secretName"`
		Duration    string   `json:"duration,omitempty"`
		RenewBefore string   `json:"renewBefore,omitempty"`
		DNSNames    []string `json:"dnsNames,omitempty"`
		IPAddresses []string `json:"ipAddresses,omitempty"`
		Usages      []string `json:"usages,omitempty"`
		PrivateKey  *struct {
			Algorithm string `json:"algorithm"`
			Size      int    `json:"size"`
		} `json:"privateKey,omitempty"`
		IssuerRef struct {
			Name string `json:"name"`
			Kind string `json:"kind"`
		} `json:"issuerRef"`
	} `json:"spec"`
}

type issuer struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		SelfSigned *struct{} `json:"selfSigned,omitempty"`
		CA         *struct {
			SecretName string `json:"secretName"`
		} `json:"ca,omitempty"`
	} `json:"spec"`
}

// objects is an overlay, built and decoded.
type objects struct {
	deployments  []*appsv1.Deployment
	statefulsets []*appsv1.StatefulSet
	services     []*corev1.Service
	configmaps   map[string]*corev1.ConfigMap
	secrets      map[string]bool // Secrets the overlay provides (cert-manager issues them)
	pdbs         []*policyv1.PodDisruptionBudget
	netpols      []*networkingv1.NetworkPolicy
	pvcs         map[string]bool
	namespaces   []*corev1.Namespace
	accounts     map[string]bool
	issuers      map[string]bool
	monitors     []*monitoringv1.ServiceMonitor
	rules        []*monitoringv1.PrometheusRule
	podmonitors  []*monitoringv1.PodMonitor
	cronjobs     []*batchv1.CronJob
	webhooks     []*admissionregistrationv1.MutatingWebhookConfiguration
	raw          map[string]map[string]any // every object, by Kind/name
}

// build runs kustomize on an overlay and decodes every object strictly into
// its type: an unknown field, a misspelled one, is an error.
func build(t *testing.T, overlay string) *objects {
	t.Helper()
	return buildFS(t, filesys.MakeFsOnDisk(), overlay)
}

func buildFS(t *testing.T, fs filesys.FileSystem, overlay string) *objects {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(fs, filepath.Join("overlays", overlay))
	if err != nil {
		t.Fatalf("kustomize build overlays/%s: %v", overlay, err)
	}
	var docs [][]byte
	for _, r := range rm.Resources() {
		y, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, y)
	}
	return decodeAll(t, "overlays/"+overlay, docs)
}

// decodeAll decodes every object strictly into its type: an unknown field,
// a misspelled one, is an error. src names where the objects come from.
func decodeAll(t *testing.T, src string, docs [][]byte) *objects {
	t.Helper()
	o := &objects{configmaps: map[string]*corev1.ConfigMap{}, secrets: map[string]bool{}, pvcs: map[string]bool{},
		accounts: map[string]bool{"default": true}, issuers: map[string]bool{}, raw: map[string]map[string]any{}}
	for _, y := range docs {
		var head struct {
			Kind     string
			Metadata struct{ Name string }
		}
		if err := yaml.Unmarshal(y, &head); err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		kind := head.Kind
		var raw map[string]any
		if err := yaml.Unmarshal(y, &raw); err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		if o.raw[kind+"/"+head.Metadata.Name] != nil {
			t.Fatalf("%s: two objects %s/%s", src, kind, head.Metadata.Name)
		}
		o.raw[kind+"/"+head.Metadata.Name] = raw
		strict := func(v any) {
			if err := yaml.UnmarshalStrict(y, v); err != nil {
				t.Fatalf("%s: %s %s does not decode strictly: %v", src, kind, head.Metadata.Name, err)
			}
		}
		switch kind {
		case "Deployment":
			var d appsv1.Deployment
			strict(&d)
			o.deployments = append(o.deployments, &d)
		case "StatefulSet":
			var s appsv1.StatefulSet
			strict(&s)
			o.statefulsets = append(o.statefulsets, &s)
		case "CronJob":
			var c batchv1.CronJob
			strict(&c)
			o.cronjobs = append(o.cronjobs, &c)
		case "Service":
			var s corev1.Service
			strict(&s)
			o.services = append(o.services, &s)
		case "ConfigMap":
			var c corev1.ConfigMap
			strict(&c)
			o.configmaps[c.Name] = &c
		case "PodDisruptionBudget":
			var p policyv1.PodDisruptionBudget
			strict(&p)
			o.pdbs = append(o.pdbs, &p)
		case "NetworkPolicy":
			var n networkingv1.NetworkPolicy
			strict(&n)
			o.netpols = append(o.netpols, &n)
		case "PersistentVolumeClaim":
			var p corev1.PersistentVolumeClaim
			strict(&p)
			o.pvcs[p.Name] = true
		case "Namespace":
			var n corev1.Namespace
			strict(&n)
			o.namespaces = append(o.namespaces, &n)
		case "ServiceAccount":
			var s corev1.ServiceAccount
			strict(&s)
			o.accounts[s.Name] = true
		case "ServiceMonitor":
			var s monitoringv1.ServiceMonitor
			strict(&s)
			o.monitors = append(o.monitors, &s)
		case "PodMonitor":
			var m monitoringv1.PodMonitor
			strict(&m)
			o.podmonitors = append(o.podmonitors, &m)
		case "PrometheusRule":
			var r monitoringv1.PrometheusRule
			strict(&r)
			o.rules = append(o.rules, &r)
		case "Certificate":
			var c certificate
			strict(&c)
			o.secrets[c.Spec.SecretName] = true
			if c.Spec.IssuerRef.Kind != "Issuer" {
				t.Fatalf("%s: Certificate %s: issuer kind %q", src, c.Metadata.Name, c.Spec.IssuerRef.Kind)
			}
		case "MutatingWebhookConfiguration":
			var w admissionregistrationv1.MutatingWebhookConfiguration
			strict(&w)
			o.webhooks = append(o.webhooks, &w)
		case "Issuer":
			var i issuer
			strict(&i)
			o.issuers[i.Metadata.Name] = true
		default:
			t.Fatalf("%s: %s %s: kind not checked by this test; add it", src, kind, head.Metadata.Name)
		}
	}
	return o
}

// pods returns every pod template of an overlay, by workload name.
func (o *objects) pods() map[string]*corev1.PodTemplateSpec {
	p := map[string]*corev1.PodTemplateSpec{}
	for _, d := range o.deployments {
		p["Deployment/"+d.Name] = &d.Spec.Template
	}
	for _, s := range o.statefulsets {
		p["StatefulSet/"+s.Name] = &s.Spec.Template
	}
	for _, c := range o.cronjobs {
		p["CronJob/"+c.Name] = &c.Spec.JobTemplate.Spec.Template
	}
	return p
}

// builds is every overlay and every rendering of the Helm chart (one per
// values file in helm/idem/ci), by name: the checks on objects apply to all.
func builds(t *testing.T) map[string]*objects {
	t.Helper()
	all := map[string]*objects{}
	for _, ov := range overlays {
		all["overlays/"+ov] = build(t, ov)
	}
	for name, o := range helmRenders(t) {
		all[name] = o
	}
	return all
}

func TestOverlaysBuildAndDecodeStrictly(t *testing.T) {
	for _, ov := range overlays {
		o := build(t, ov)
		if len(o.pods()) == 0 {
			t.Errorf("%s has no workload", ov)
		}
	}
}

// Every pod template passes the upstream Pod Security "restricted" checks,
// and every namespace enforces them.
func TestPodSecurityRestricted(t *testing.T) {
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for ov, o := range builds(t) {
		for name, tpl := range o.pods() {
			res := policy.AggregateCheckResults(eval.EvaluatePod(psaapi.LevelVersion{Level: psaapi.LevelRestricted, Version: psaapi.LatestVersion()}, &tpl.ObjectMeta, &tpl.Spec))
			if !res.Allowed {
				t.Errorf("%s %s is not restricted: %s", ov, name, strings.Join(res.ForbiddenDetails, "; "))
			}
			for _, c := range append(append([]corev1.Container{}, tpl.Spec.InitContainers...), tpl.Spec.Containers...) {
				sc := c.SecurityContext
				if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
					t.Errorf("%s %s container %s: root filesystem is not read-only", ov, name, c.Name)
				}
				if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
					t.Errorf("%s %s container %s: no resource requests", ov, name, c.Name)
				}
			}
		}
		for _, ns := range o.namespaces {
			if ns.Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
				t.Errorf("%s: namespace %s does not enforce restricted", ov, ns.Name)
			}
		}
	}
}

func selects(sel map[string]string, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// Names and labels that must agree across objects do.
func TestCrossReferences(t *testing.T) {
	for ov, o := range builds(t) {
		pods := o.pods()
		podsMatching := func(sel map[string]string) []*corev1.PodTemplateSpec {
			var out []*corev1.PodTemplateSpec
			for _, p := range pods {
				if selects(sel, p.Labels) {
					out = append(out, p)
				}
			}
			return out
		}
		for name, p := range pods {
			var sel map[string]string
			for _, d := range o.deployments {
				if &d.Spec.Template == p {
					sel = d.Spec.Selector.MatchLabels
				}
			}
			for _, c := range o.cronjobs {
				if &c.Spec.JobTemplate.Spec.Template == p {
					sel = p.Labels // a Job's pods are its own
				}
			}
			for _, s := range o.statefulsets {
				if &s.Spec.Template == p {
					sel = s.Spec.Selector.MatchLabels
					if !slices.ContainsFunc(o.services, func(svc *corev1.Service) bool { return svc.Name == s.Spec.ServiceName && svc.Spec.ClusterIP == "None" }) {
						t.Errorf("%s %s: no headless Service %q", ov, name, s.Spec.ServiceName)
					}
				}
			}
			if !selects(sel, p.Labels) {
				t.Errorf("%s %s: its selector %v does not select its own pods %v", ov, name, sel, p.Labels)
			}
			if sa := p.Spec.ServiceAccountName; sa != "" && !o.accounts[sa] {
				t.Errorf("%s %s: ServiceAccount %q is not defined", ov, name, sa)
			}
			for _, c := range append(append([]corev1.Container{}, p.Spec.InitContainers...), p.Spec.Containers...) {
				ports := map[string]bool{}
				for _, cp := range c.Ports {
					ports[cp.Name] = true
					ports[fmt.Sprint(cp.ContainerPort)] = true
				}
				for _, pr := range []*corev1.Probe{c.StartupProbe, c.ReadinessProbe, c.LivenessProbe} {
					if pr == nil || pr.HTTPGet == nil {
						continue
					}
					if !ports[pr.HTTPGet.Port.String()] {
						t.Errorf("%s %s container %s: probe port %s is not a port of the container", ov, name, c.Name, pr.HTTPGet.Port.String())
					}
				}
				for _, ef := range c.EnvFrom {
					if ef.ConfigMapRef != nil && o.configmaps[ef.ConfigMapRef.Name] == nil {
						t.Errorf("%s %s container %s: ConfigMap %q is not defined", ov, name, c.Name, ef.ConfigMapRef.Name)
					}
				}
				mounts := map[string]bool{}
				for _, vm := range c.VolumeMounts {
					mounts[vm.Name] = true
				}
				for _, vol := range p.Spec.Volumes {
					delete(mounts, vol.Name)
				}
				for _, vct := range claimTemplates(o, p) {
					delete(mounts, vct)
				}
				for m := range mounts {
					t.Errorf("%s %s container %s: volume %q is mounted but not defined", ov, name, c.Name, m)
				}
				// A file an argument names is in a mounted volume.
				for _, a := range append(append([]string{}, c.Command...), c.Args...) {
					flag, path, ok := strings.Cut(a, "=")
					if !ok || !strings.HasPrefix(flag, "--") || !strings.HasPrefix(path, "/etc/") {
						continue
					}
					mounted := false
					for _, vm := range c.VolumeMounts {
						mounted = mounted || strings.HasPrefix(path, vm.MountPath+"/")
					}
					if !mounted {
						t.Errorf("%s %s container %s: %s names %s, in no mounted volume", ov, name, c.Name, flag, path)
					}
				}
			}
			for _, vol := range p.Spec.Volumes {
				switch {
				case vol.Secret != nil && !o.secrets[vol.Secret.SecretName]:
					t.Errorf("%s %s: Secret %q is neither defined nor issued by a Certificate", ov, name, vol.Secret.SecretName)
				case vol.ConfigMap != nil && o.configmaps[vol.ConfigMap.Name] == nil:
					t.Errorf("%s %s: ConfigMap %q is not defined", ov, name, vol.ConfigMap.Name)
				case vol.PersistentVolumeClaim != nil && !o.pvcs[vol.PersistentVolumeClaim.ClaimName]:
					t.Errorf("%s %s: PersistentVolumeClaim %q is not defined", ov, name, vol.PersistentVolumeClaim.ClaimName)
				}
			}
		}
		for _, svc := range o.services {
			matched := podsMatching(svc.Spec.Selector)
			if len(matched) == 0 {
				t.Errorf("%s: Service %s selects no pods (%v)", ov, svc.Name, svc.Spec.Selector)
				continue
			}
			for _, sp := range svc.Spec.Ports {
				if !portExists(matched, sp.TargetPort) {
					t.Errorf("%s: Service %s port %s targets %s, which its pods do not have", ov, svc.Name, sp.Name, sp.TargetPort.String())
				}
			}
		}
		for _, pm := range o.podmonitors {
			matched := podsMatching(pm.Spec.Selector.MatchLabels)
			if len(matched) == 0 {
				t.Errorf("%s: PodMonitor %s selects no pods", ov, pm.Name)
			}
			for _, ep := range pm.Spec.PodMetricsEndpoints {
				if ep.Port == nil || !portExists(matched, intstr.FromString(*ep.Port)) {
					t.Errorf("%s: PodMonitor %s scrapes a port its pods do not have", ov, pm.Name)
				}
			}
		}
		for _, sm := range o.monitors {
			var scraped []*corev1.Service
			for _, svc := range o.services {
				if selects(sm.Spec.Selector.MatchLabels, svc.Labels) {
					scraped = append(scraped, svc)
				}
			}
			if len(scraped) != 1 {
				t.Errorf("%s: ServiceMonitor %s selects %d Services, want 1", ov, sm.Name, len(scraped))
			}
		}
		for _, pdb := range o.pdbs {
			if len(podsMatching(pdb.Spec.Selector.MatchLabels)) == 0 {
				t.Errorf("%s: PodDisruptionBudget %s selects no pods", ov, pdb.Name)
			}
		}
		for _, np := range o.netpols {
			matched := podsMatching(np.Spec.PodSelector.MatchLabels)
			if len(matched) == 0 {
				t.Errorf("%s: NetworkPolicy %s applies to no pods", ov, np.Name)
			}
			for _, in := range np.Spec.Ingress {
				for _, p := range in.Ports {
					if p.Port != nil && !portExists(matched, *p.Port) {
						t.Errorf("%s: NetworkPolicy %s opens port %s, which its pods do not have", ov, np.Name, p.Port.String())
					}
				}
			}
		}
	}
}

func claimTemplates(o *objects, p *corev1.PodTemplateSpec) []string {
	var names []string
	for _, s := range o.statefulsets {
		if &s.Spec.Template == p {
			for _, v := range s.Spec.VolumeClaimTemplates {
				names = append(names, v.Name)
			}
		}
	}
	return names
}

func portExists(pods []*corev1.PodTemplateSpec, port intstr.IntOrString) bool {
	for _, p := range pods {
		for _, c := range append(append([]corev1.Container{}, p.Spec.InitContainers...), p.Spec.Containers...) {
			for _, cp := range c.Ports {
				if port.Type == intstr.String && cp.Name == port.StrVal || port.Type == intstr.Int && cp.ContainerPort == port.IntVal {
					return true
				}
			}
		}
	}
	return false
}

// The ways idem must be wired in each overlay.
func TestOverlayWiring(t *testing.T) {
	ext := build(t, "external-etcd")
	cfg := ext.configmaps["idem-config"].Data
	if !strings.HasPrefix(cfg["IDEM_ENDPOINTS"], "https://") || cfg["IDEM_CERT"] == "" || cfg["IDEM_CACERT"] == "" {
		t.Errorf("external-etcd: idem does not talk TLS to etcd: %v", cfg)
	}
	if len(ext.statefulsets) != 1 || *ext.statefulsets[0].Spec.Replicas != 3 {
		t.Error("external-etcd: want one 3-member etcd StatefulSet")
	}
	etcdArgs := strings.Join(ext.statefulsets[0].Spec.Template.Spec.Containers[0].Args, " ")
	for _, want := range []string{"--client-cert-auth", "--peer-client-cert-auth", "--auto-compaction-retention", "--quota-backend-bytes", "LeaseCheckpoint=true"} {
		if !strings.Contains(etcdArgs, want) {
			t.Errorf("external-etcd: etcd lacks %s", want)
		}
	}
	for _, port := range ext.services[0].Spec.Ports {
		if ext.services[0].Name == "etcd" && !strings.HasPrefix(port.Name, "etcd-") {
			t.Errorf("etcd headless Service port %q is not named for DNS SRV discovery", port.Name)
		}
	}

	st := build(t, "standalone")
	d := st.deployments[0]
	if *d.Spec.Replicas != 1 || d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Error("standalone: want one replica, recreated (one writer of the data volume)")
	}
	if _, ok := st.configmaps["idem-config"].Data["IDEM_ENDPOINTS"]; ok {
		t.Error("standalone: idem is given etcd endpoints; it should start its embedded etcd")
	}

	sc := build(t, "sidecar")
	pod := sc.deployments[0].Spec.Template.Spec
	if len(pod.InitContainers) != 1 || pod.InitContainers[0].RestartPolicy == nil || *pod.InitContainers[0].RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Fatal("sidecar: idem is not a native sidecar (an init container with restartPolicy Always)")
	}
	idem := pod.InitContainers[0]
	if idem.Lifecycle == nil || idem.Lifecycle.PreStop == nil || idem.Lifecycle.PreStop.Sleep == nil {
		t.Error("sidecar: idem has no preStop to outlive the app's requests")
	}
	upstream := ""
	for _, e := range idem.Env {
		if e.Name == "IDEM_UPSTREAM" {
			upstream = e.Value
		}
	}
	if !strings.Contains(upstream, "127.0.0.1") {
		t.Errorf("sidecar: the app is reached as %q, not on loopback behind idem", upstream)
	}
	for _, svc := range sc.services {
		if svc.Name == "shop" && svc.Spec.Ports[0].TargetPort.StrVal != "http" {
			t.Error("sidecar: the shop Service does not send traffic to idem's port")
		}
	}
}

// The image is built from a static binary on a minimal non-root base. It
// cannot be built here (no Docker engine); the binary it builds can.
func TestContainerBuild(t *testing.T) {
	df, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CGO_ENABLED=0", "distroless/static", "USER 65532", "./cmd/idem"} {
		if !strings.Contains(string(df), want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if testing.Short() {
		return
	}
	out := filepath.Join(t.TempDir(), "idem")
	cmd := exec.Command("go", "build", "-C", "..", "-trimpath", "-o", out, "./cmd/idem")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH, "GOWORK=off")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("static build: %v\n%s", err, b)
	}
	f, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatal("the binary needs a dynamic loader: it would not run on distroless/static")
		}
	}
	// The image's defaults (its IDEM_* variables) are ones the binary
	// accepts: serve reads its environment before -h stops it.
	env := regexp.MustCompile(`IDEM_[A-Z_]+=[^\s\\]+`).FindAllString(string(df), -1)
	if len(env) < 3 {
		t.Fatalf("the Dockerfile sets %v; want the listen addresses and the data dir", env)
	}
	run := exec.Command(out, "serve", "-h")
	run.Env = append(os.Environ(), env...)
	if b, err := run.CombinedOutput(); err != nil {
		t.Fatalf("idem serve with the image's environment %v: %v\n%s", env, err, b)
	}
}

// The optional ServiceMonitor component, added to the production overlay
// the way the README says (components: in an overlay), selects idem's
// Service and scrapes a port that Service has.
func TestServiceMonitorComponent(t *testing.T) {
	fs := filesys.MakeFsInMemory()
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".yaml") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return fs.WriteFile(path, b)
	})
	if err != nil {
		t.Fatal(err)
	}
	// As the README says: list the component in the overlay's components.
	k, err := fs.ReadFile("overlays/external-etcd/kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const list = "components:\n  - ../../components/cert-manager\n"
	if !strings.Contains(string(k), list) {
		t.Fatal("overlays/external-etcd lists its components differently; update this test")
	}
	k = []byte(strings.Replace(string(k), list, list+"  - ../../components/servicemonitor\n", 1))
	if err := fs.WriteFile("overlays/external-etcd/kustomization.yaml", k); err != nil {
		t.Fatal(err)
	}
	o := buildFS(t, fs, "external-etcd")
	if len(o.monitors) != 1 {
		t.Fatalf("want one ServiceMonitor, got %d", len(o.monitors))
	}
	m := o.monitors[0]
	if m.Namespace != "idem" {
		t.Errorf("ServiceMonitor in namespace %q, want the overlay's namespace idem", m.Namespace)
	}
	var scraped *corev1.Service
	for _, svc := range o.services {
		sel, err := metav1.LabelSelectorAsSelector(&m.Spec.Selector)
		if err != nil {
			t.Fatal(err)
		}
		if sel.Matches(labels.Set(svc.Labels)) {
			if scraped != nil {
				t.Fatalf("ServiceMonitor selects both %s and %s", scraped.Name, svc.Name)
			}
			scraped = svc
		}
	}
	if scraped == nil || scraped.Name != "idem" {
		t.Fatalf("ServiceMonitor selects %v, want the idem Service", scraped)
	}
	for _, ep := range m.Spec.Endpoints {
		if !slices.ContainsFunc(scraped.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == ep.Port }) {
			t.Errorf("ServiceMonitor scrapes port %q, which Service idem does not have", ep.Port)
		}
		if ep.Path != "/metrics" {
			t.Errorf("ServiceMonitor scrapes %q, want /metrics", ep.Path)
		}
	}
}
