{{/* The release's idem name: the release name when it contains "idem". */}}
{{- define "idem.fullname" -}}
{{- if contains "idem" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-idem" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "idem.etcdName" -}}
{{- default (printf "%s-etcd" (include "idem.fullname" .)) .Values.etcd.nameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries; name is the component (idem, etcd, the app). */}}
{{- define "idem.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: idem
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "idem.selector" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "idem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* etcd client URLs for idem: the bundled cluster's members, or etcd.endpoints. */}}
{{- define "idem.endpoints" -}}
{{- if .Values.etcd.bundled -}}
{{- $name := include "idem.etcdName" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $urls = append $urls (printf "https://%s-%d.%s:2379" $name $i $name) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/* The restricted Pod Security profile, for pods and containers. */}}
{{- define "idem.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "idem.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "idem.probes" -}}
startupProbe: # alive, not ready: idem starts, and passes unkeyed traffic, while etcd is away
  httpGet:
    path: /livez
    port: admin
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: admin
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
livenessProbe:
  httpGet:
    path: /livez
    port: admin
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
{{- end -}}

{{/* Volumes and mounts for TLS and tokens shared by the Deployment and the sidecar. */}}
{{- define "idem.secretMounts" -}}
{{- if and (ne .Values.mode "standalone") .Values.etcd.clientTLS.secretName }}
- name: etcd-tls
  mountPath: /etc/idem/etcd-tls
  readOnly: true
{{- end }}
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: /etc/idem/tls
  readOnly: true
{{- end }}
{{- if .Values.tokens.secretName }}
- name: tokens
  mountPath: /etc/idem/tokens
  readOnly: true
{{- end }}
{{- end -}}

{{- define "idem.secretVolumes" -}}
{{- if and (ne .Values.mode "standalone") .Values.etcd.clientTLS.secretName }}
- name: etcd-tls
  secret:
    secretName: {{ .Values.etcd.clientTLS.secretName }}
{{- end }}
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- if .Values.tokens.secretName }}
- name: tokens
  secret:
    secretName: {{ .Values.tokens.secretName }}
    defaultMode: 0440 # readable by the pod's fsGroup (idem's), by no one else
{{- end }}
{{- end -}}

{{/* idem's settings as IDEM_* variables (a map), shared by the ConfigMap and the sidecar. */}}
{{- define "idem.settings" -}}
{{- $s := dict "IDEM_LISTEN" "0.0.0.0:8080" "IDEM_ADMIN_LISTEN" "0.0.0.0:8081" -}}
{{- if ne .Values.mode "standalone" -}}
{{- $_ := set $s "IDEM_ENDPOINTS" (include "idem.endpoints" .) -}}
{{- if .Values.etcd.clientTLS.secretName -}}
{{- $_ := set $s "IDEM_CACERT" "/etc/idem/etcd-tls/ca.crt" -}}
{{- $_ := set $s "IDEM_CERT" "/etc/idem/etcd-tls/tls.crt" -}}
{{- $_ := set $s "IDEM_KEY" "/etc/idem/etcd-tls/tls.key" -}}
{{- end -}}
{{- if .Values.etcd.prefix }}{{ $_ := set $s "IDEM_PREFIX" .Values.etcd.prefix }}{{ end -}}
{{- else -}}
{{- $_ := set $s "IDEM_DATA_DIR" "/var/lib/idem" -}}
{{- end -}}
{{- if .Values.tls.secretName -}}
{{- $_ := set $s "IDEM_TLS_CERT_FILE" "/etc/idem/tls/tls.crt" -}}
{{- $_ := set $s "IDEM_TLS_KEY_FILE" "/etc/idem/tls/tls.key" -}}
{{- if .Values.tls.clientCA }}{{ $_ := set $s "IDEM_TLS_CLIENT_CA_FILE" "/etc/idem/tls/ca.crt" }}{{ end -}}
{{- end -}}
{{- if .Values.tokens.secretName }}{{ $_ := set $s "IDEM_TOKENS_FILE" (printf "/etc/idem/tokens/%s" .Values.tokens.key) }}{{ end -}}
{{- if gt (int64 .Values.config.cacheSize) 0 }}{{ $_ := set $s "IDEM_CACHE_SIZE" (toString (int64 .Values.config.cacheSize)) }}{{ end -}}
{{- range $k, $v := .Values.config.extra }}
{{- if and (kindIs "float64" $v) (eq $v (floor $v)) }}{{ $v = int64 $v }}{{ end }}
{{- $_ := set $s $k (toString $v) }}
{{- end -}}
{{- toYaml $s -}}
{{- end -}}

{{/*
idem as a native sidecar (an init container with restartPolicy: Always:
started before the app, stopped after it), proxying to the app on
127.0.0.1:app.port. For a chart of your own that depends on this one:
  initContainers:
    {{- include "idem.sidecarContainer" . | nindent 4 }}
and the volumes of "idem.secretVolumes".
*/}}
{{- define "idem.sidecarContainer" -}}
- name: idem
  image: {{ include "idem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  restartPolicy: Always
  args: ["serve"]
  env:
    {{- $s := fromYaml (include "idem.settings" .) }}
    {{- $_ := set $s "IDEM_UPSTREAM" (printf "http://127.0.0.1:%d" (int .Values.app.port)) }}
    {{- $_ := set $s "IDEM_SHUTDOWN_GRACE" .Values.sidecar.shutdownGrace }}
    {{- $_ := set $s "IDEM_LOG_FORMAT" .Values.config.logFormat }}
    {{- $_ := set $s "IDEM_RETENTION" .Values.config.retention }}
    {{- $_ := set $s "IDEM_SESSION_TTL" .Values.config.sessionTTL }}
    {{- /* NOSPACE must not take the app's pods out of service: replays and unkeyed traffic still work. */}}
    {{- $_ := set $s "IDEM_READY_WHEN_FULL" "true" }}
    {{- range $k, $v := $s }}
    - name: {{ $k }}
      value: {{ $v | quote }}
    {{- end }}
  ports:
    - name: http
      containerPort: 8080
    - name: admin
      containerPort: 8081
  {{- include "idem.probes" . | nindent 2 }}
  lifecycle:
    preStop:
      # Keep proxying while the app drains: the kubelet stops the app
      # first, but endpoints may still route here for a moment.
      sleep:
        seconds: {{ .Values.sidecar.preStopSeconds }}
  resources:
    {{- toYaml .Values.sidecar.resources | nindent 4 }}
  securityContext:
    {{- include "idem.containerSecurity" . | nindent 4 }}
  volumeMounts:
    {{- include "idem.secretMounts" . | indent 4 }}
{{- end -}}

{{/* The ConfigMap's data: the settings, and the service-wide ones. */}}
{{- define "idem.configData" -}}
{{- $s := fromYaml (include "idem.settings" .) -}}
{{- $_ := set $s "IDEM_LOG_FORMAT" .Values.config.logFormat -}}
{{- $_ := set $s "IDEM_RETENTION" .Values.config.retention -}}
{{- $_ := set $s "IDEM_SESSION_TTL" .Values.config.sessionTTL -}}
{{- $_ := set $s "IDEM_SHUTDOWN_GRACE" .Values.config.shutdownGrace -}}
{{- if .Values.config.upstream }}{{ $_ := set $s "IDEM_UPSTREAM" .Values.config.upstream }}{{ end -}}
{{- toYaml $s -}}
{{- end -}}

{{/* Egress to your etcd: the ports of etcd.endpoints (2379 when a URL has none). */}}
{{- define "idem.etcdPorts" -}}
{{- $ports := dict -}}
{{- range .Values.etcd.endpoints -}}
{{- $host := (urlParse .).host -}}
{{- $port := "2379" -}}
{{- if regexMatch ":[0-9]+$" $host }}{{ $port = regexFind "[0-9]+$" $host }}{{ end -}}
{{- $_ := set $ports $port true -}}
{{- end -}}
{{- keys $ports | sortAlpha | join "," -}}
{{- end -}}
