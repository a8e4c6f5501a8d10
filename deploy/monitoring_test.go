package deploy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// metricsOf parses a PromQL expression and returns the metric names it
// selects.
func metricsOf(t *testing.T, where, expr string) []string {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		t.Errorf("%s: %q does not parse: %v", where, expr, err)
		return nil
	}
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == model.MetricNameLabel {
					name = m.Value
				}
			}
			names = append(names, name)
		}
		return nil
	})
	if len(names) == 0 {
		t.Errorf("%s: %q selects no metric", where, expr)
	}
	return names
}

// family maps a series name to its metric family (a histogram's _bucket,
// _sum and _count belong to it).
func family(name string, families map[string]string) string {
	if _, ok := families[name]; ok {
		return name
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suf); ok && (families[base] == "histogram" || families[base] == "summary") {
			return base
		}
	}
	return ""
}

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// idemBinary builds the idem binary once for the package's tests.
func idemBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idem-deploy-test-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "idem")
		build := exec.Command("go", "build", "-C", "..", "-o", binPath, "./cmd/idem")
		build.Env = append(os.Environ(), "GOWORK=off")
		if b, err := build.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build ./cmd/idem: %v\n%s", err, b)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// Every IDEM_* setting the chart renders (ConfigMaps and container env)
// is one idem serve accepts, with a value it parses: serve reads its
// environment before -h stops it.
func TestChartSettingsAreIdemFlags(t *testing.T) {
	bin := idemBinary(t)
	for name, o := range helmRenders(t) {
		var envs [][]string
		for _, cm := range o.configmaps {
			var env []string
			for k, v := range cm.Data {
				if strings.HasPrefix(k, "IDEM_") {
					env = append(env, k+"="+v)
				}
			}
			envs = append(envs, env)
		}
		for _, tpl := range o.pods() {
			for _, c := range append(append([]corev1.Container{}, tpl.Spec.InitContainers...), tpl.Spec.Containers...) {
				var env []string
				for _, e := range c.Env {
					if strings.HasPrefix(e.Name, "IDEM_") {
						env = append(env, e.Name+"="+e.Value)
					}
				}
				envs = append(envs, env)
			}
		}
		checked := 0
		for _, env := range envs {
			if len(env) == 0 {
				continue
			}
			checked++
			run := exec.Command(bin, "serve", "-h")
			run.Env = append(os.Environ(), env...)
			if b, err := run.CombinedOutput(); err != nil {
				t.Errorf("%s: idem serve refuses the settings %v: %v\n%s", name, env, err, b)
			}
		}
		if checked == 0 {
			t.Errorf("%s: no IDEM_* settings rendered", name)
		}
	}
}

// idemMetrics starts the real idem serve (embedded etcd, proxy mode, the
// replay cache on), sends it keyed requests, and returns the metric
// families its /metrics exports, by type.
func idemMetrics(t *testing.T) map[string]string {
	t.Helper()
	dir := t.TempDir()
	bin := idemBinary(t)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"ok":true}`)
	}))
	t.Cleanup(up.Close)
	cmd := exec.Command(bin, "serve", "--data-dir", filepath.Join(dir, "data"), "--embedded-peer-url", "unix://peer.sock",
		"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-format", "json",
		"--upstream", up.URL, "--cache-size", "1048576")
	cmd.Dir = dir
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	addrs := make(chan [2]string, 1)
	go func() {
		defer close(exited)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == "idem listening" {
				addrs <- [2]string{m["listen"].(string), m["admin"].(string)}
			}
		}
		cmd.Wait()
	}()
	var listen, admin string
	select {
	case a := <-addrs:
		listen, admin = "http://"+a[0], "http://"+a[1]
	case <-exited:
		t.Fatal("idem serve exited before listening")
	case <-time.After(90 * time.Second):
		t.Fatal("idem serve did not listen within 90 s")
	}
	for i, body := range []string{`{"a":1}`, `{"a":1}`, `{"a":2}`} { // claimed, replayed, mismatch
		req, _ := http.NewRequest("POST", listen+"/charges", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "k1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := []int{201, 201, 422}[i]; resp.StatusCode != want {
			t.Fatalf("request %d: %d, want %d", i, resp.StatusCode, want)
		}
	}
	resp, err := http.Get(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	families := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^# TYPE (\S+) (\S+)$`).FindAllStringSubmatch(string(b), -1) {
		families[m[1]] = m[2]
	}
	if families["idem_requests_total"] != "counter" {
		t.Fatalf("idem's /metrics lacks idem_requests_total:\n%s", b)
	}
	return families
}

// The alerts: each expression parses with Prometheus' own parser and names
// only metrics a running idem serve exports; each has a severity, a
// summary and a runbook that exists in docs/OPERATIONS.md.
func TestAlertsAndDashboard(t *testing.T) {
	families := idemMetrics(t)
	b, err := os.ReadFile("components/alerts/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rule monitoringv1.PrometheusRule
	if err := yaml.UnmarshalStrict(b, &rule); err != nil {
		t.Fatal(err)
	}
	ops, err := os.ReadFile("../docs/OPERATIONS.md")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, h := range regexp.MustCompile(`(?m)^#+ (.+)$`).FindAllStringSubmatch(string(ops), -1) {
		a := strings.ToLower(strings.TrimSpace(h[1]))
		a = regexp.MustCompile(`[^a-z0-9 _-]`).ReplaceAllString(a, "")
		anchors[strings.ReplaceAll(a, " ", "-")] = true
	}
	want := []string{"IdemEtcdUnavailable", "IdemSessionLost", "IdemClaimsStuck", "IdemUnavailableAnswers", "IdemReplayMismatch", "IdemEtcdQuotaNearlyFull", "IdemEtcdOutOfSpace", "IdemExpiryStall"}
	seen := map[string]bool{}
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			where := "alert " + r.Alert
			seen[r.Alert] = true
			for _, name := range metricsOf(t, where, r.Expr.String()) {
				if family(name, families) == "" {
					t.Errorf("%s: metric %s is not one idem exports", where, name)
				}
			}
			if r.For != nil {
				if _, err := model.ParseDuration(string(*r.For)); err != nil {
					t.Errorf("%s: for %q: %v", where, *r.For, err)
				}
			}
			switch r.Labels["severity"] {
			case "critical", "warning", "info":
			default:
				t.Errorf("%s: severity %q", where, r.Labels["severity"])
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: no summary or description", where)
			}
			_, anchor, _ := strings.Cut(r.Annotations["runbook_url"], "docs/OPERATIONS.md#")
			if !anchors[anchor] {
				t.Errorf("%s: runbook %q is not a heading of docs/OPERATIONS.md", where, r.Annotations["runbook_url"])
			}
		}
	}
	for _, a := range want {
		if !seen[a] {
			t.Errorf("no alert %s", a)
		}
	}

	// The dashboard: Grafana's JSON, every panel's queries parse and name
	// metrics idem exports.
	b, err = os.ReadFile(filepath.Join(chartDir, "files", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title         string `json:"title"`
		UID           string `json:"uid"`
		SchemaVersion int    `json:"schemaVersion"`
		Panels        []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	if dash.UID == "" || dash.SchemaVersion < 36 || len(dash.Panels) < 8 {
		t.Fatalf("dashboard %q: uid %q, schema %d, %d panels", dash.Title, dash.UID, dash.SchemaVersion, len(dash.Panels))
	}
	grafana := strings.NewReplacer("$__rate_interval", "5m", `"$namespace"`, `".*"`)
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			for _, name := range metricsOf(t, fmt.Sprintf("panel %q", p.Title), grafana.Replace(tg.Expr)) {
				if family(name, families) == "" {
					t.Errorf("panel %q: metric %s is not one idem exports", p.Title, name)
				}
			}
		}
	}
}
