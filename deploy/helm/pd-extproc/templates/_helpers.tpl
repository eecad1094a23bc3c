{{/* Names and labels. */}}
{{- define "pd-extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pd-extproc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "pd-extproc.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pd-extproc.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pd-extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pd-extproc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pd-extproc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end }}

{{- define "pd-extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pd-extproc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pd-extproc.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "pd-extproc.tlsSecret" -}}
{{- default (printf "%s-tls" (include "pd-extproc.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{- define "pd-extproc.poolName" -}}
{{- default (include "pd-extproc.fullname" .) .Values.inferencePool.name }}
{{- end }}

{{/* The EPP Service's in-cluster DNS name: what the Gateway dials and the certificate names. */}}
{{- define "pd-extproc.serviceHost" -}}
{{ include "pd-extproc.fullname" . }}.{{ .Release.Namespace }}.svc
{{- end }}

{{- define "pd-extproc.checkMode" -}}
{{- if not (has .Values.mode (list "gateway" "epp")) }}
{{- fail (printf "mode must be gateway or epp (got %q)" .Values.mode) }}
{{- end }}
{{- end }}

{{/* The NetworkPolicy: networkPolicy.create, or by default on in epp mode only. */}}
{{- define "pd-extproc.networkPolicy" -}}
{{- $create := .Values.networkPolicy.create }}
{{- if kindIs "invalid" $create }}{{ $create = eq .Values.mode "epp" }}{{ end }}
{{- if $create }}true{{ end }}
{{- end }}

{{- define "pd-extproc.tlsEnabled" -}}
{{- if and (eq .Values.mode "epp") (or .Values.tls.secretName .Values.tls.certManager.issuerRef.name) }}true{{ end }}
{{- end }}

{{/* The pools from `engines`: watched pods by label (gateway) or the InferencePool (epp). */}}
{{- define "pd-extproc.pools" -}}
{{- $pools := dict }}
{{- range $role := list "prefill" "decode" }}
{{- if eq $.Values.mode "epp" }}
{{- $_ := set $pools $role (dict "inference_pool" (dict
      "name" (include "pd-extproc.poolName" $) "role_label" $.Values.engines.roleLabel)) }}
{{- else }}
{{- $labels := list }}
{{- range $key, $value := $.Values.engines.matchLabels }}
{{- $labels = append $labels (printf "%s=%s" $key $value) }}
{{- end }}
{{- $labels = append $labels (printf "%s=%s" $.Values.engines.roleLabel $role) }}
{{- $_ := set $pools $role (dict "kubernetes" (dict
      "label_selector" (join "," $labels) "port" $.Values.engines.port)) }}
{{- end }}
{{- end }}
{{- toYaml $pools }}
{{- end }}

{{/*
The pd-extproc config (YAML): the chart's settings for this mode, with .Values.config on top
(what you set wins), and the release's namespace filled into every Kubernetes pool source that
names none. Every template reads ports from this result, so the Service, the probes and the
InferencePool always match what the ext_proc really binds.
*/}}
{{- define "pd-extproc.config" -}}
{{- $p := .Values.ports }}
{{- $managed := dict "metrics" (dict "host" "0.0.0.0" "port" $p.metrics) }}
{{- if eq .Values.mode "gateway" }}
{{- $_ := set $managed "extproc" (dict "host" "127.0.0.1" "port" $p.extproc) }}
{{- $_ := set $managed "envoy" (dict
      "listen" (dict "host" "0.0.0.0" "port" $p.http)
      "admin" (dict "host" "127.0.0.1" "port" $p.envoyAdmin)
      "prefill_listener" (printf "127.0.0.1:%v" $p.prefillListener)) }}
{{- else }}
{{- $_ := set $managed "extproc" (dict "host" "0.0.0.0" "port" $p.extproc) }}
{{- $_ := set $managed "endpoint_picker" (dict "health_port" $p.health) }}
{{- if include "pd-extproc.tlsEnabled" . }}
{{- $_ := set $managed.extproc "tls" (dict
      "cert_file" "/etc/pd-extproc-tls/tls.crt"
      "key_file" "/etc/pd-extproc-tls/tls.key"
      "ca_file" "/etc/pd-extproc-tls/ca.crt"
      "server_name" (include "pd-extproc.serviceHost" .)) }}
{{- end }}
{{- end }}
{{- /* a role whose pool names a source in config takes none of the chart's */}}
{{- $user := deepCopy .Values.config }}
{{- $engines := include "pd-extproc.pools" . | fromYaml }}
{{- range $role := list "prefill" "decode" }}
{{- $mine := get $user $role | default dict }}
{{- $sources := pick $mine "endpoints" "dns" "kubernetes" "inference_pool" }}
{{- if not $sources }}{{ $_ := set $managed $role (get $engines $role) }}{{ end }}
{{- end }}
{{- $cfg := mergeOverwrite $managed $user }}
{{- $pools := list }}
{{- range $role := list "prefill" "decode" }}
{{- if hasKey $cfg $role }}{{ $pools = append $pools (get $cfg $role) }}{{ end }}
{{- end }}
{{- range $model, $group := ($cfg.models | default dict) }}
{{- range $role := list "prefill" "decode" }}
{{- if hasKey $group $role }}{{ $pools = append $pools (get $group $role) }}{{ end }}
{{- end }}
{{- end }}
{{- range $pool := $pools }}
{{- range $source := list "kubernetes" "inference_pool" }}
{{- if and (kindIs "map" $pool) (kindIs "map" (get $pool $source)) }}
{{- if not (hasKey (get $pool $source) "namespace") }}
{{- $_ := set (get $pool $source) "namespace" $.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* Seconds a pod may take to stop: time before draining + config.timeouts.drain_s + 15 s. */}}
{{- define "pd-extproc.grace" -}}
{{- $cfg := include "pd-extproc.config" . | fromYaml }}
{{- $before := ternary .Values.envoy.drainTimeSeconds .Values.preStopSleepSeconds (eq .Values.mode "gateway") }}
{{- add (int $before) (int (ceil (dig "timeouts" "drain_s" 10 $cfg))) 15 }}
{{- end }}
