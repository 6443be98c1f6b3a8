{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "flowkube.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Prefix of every resource name: the release name, plus the chart name unless the release name
already contains it. Truncated so that suffixed names (`-feedback-responder`) stay valid.
*/}}
{{- define "flowkube.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "flowkube.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of this release, without the name: the generated CRD brings its own name label. */}}
{{- define "flowkube.releaseLabels" -}}
helm.sh/chart: {{ include "flowkube.chart" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "flowkube.labels" -}}
app.kubernetes.io/name: {{ include "flowkube.name" . }}
app.kubernetes.io/part-of: flowkube
{{ include "flowkube.releaseLabels" . }}
{{- end }}

{{/* Selector of the operator pod; never change it (Deployment selectors are immutable). */}}
{{- define "flowkube.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flowkube.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "flowkube.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "flowkube.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The user name the API server gives the operator, to keep its own writes out of the webhooks. */}}
{{- define "flowkube.serviceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "flowkube.serviceAccountName" . }}
{{- end }}

{{- define "flowkube.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "flowkube.runnerImage" -}}
{{- printf "%s:%s" .Values.runner.image.repository (default .Chart.AppVersion .Values.runner.image.tag) }}
{{- end }}

{{- define "flowkube.webhookName" -}}
{{- include "flowkube.fullname" . }}-webhook
{{- end }}

{{/* The status ValidatingAdmissionPolicy and its binding (cluster-scoped: carries the release namespace). */}}
{{- define "flowkube.statusPolicyName" -}}
{{- include "flowkube.fullname" . }}-{{ .Release.Namespace }}.status.flowkube.io
{{- end }}

{{/* The Lease whose holder reconciles (templates/rbac/leader-election.yaml). */}}
{{- define "flowkube.leaseName" -}}
{{- include "flowkube.fullname" . }}-operator
{{- end }}

{{/* The Secret keeping the operator's CA across restarts (templates/ca-secret.yaml). */}}
{{- define "flowkube.caSecretName" -}}
{{- include "flowkube.fullname" . }}-ca
{{- end }}

{{/* Name of both webhook configurations (cluster-scoped, so it carries the release namespace). */}}
{{- define "flowkube.webhookConfigurationName" -}}
{{- printf "%s-%s.flowkube.io" (include "flowkube.fullname" .) .Release.Namespace | trunc 253 }}
{{- end }}

{{/* The scope of the operator's namespaced rights: with watchNamespaces set, always Roles in those
namespaces (a ClusterRole would let it create pods in every namespace, kube-system included, while it
watches only these); otherwise rbac.scope. */}}
{{- define "flowkube.rbacScope" -}}
{{- if .Values.watchNamespaces }}namespaced{{ else }}{{ .Values.rbac.scope }}{{ end }}
{{- end }}

{{/* Validates combinations the schema cannot express; included by the Deployment. */}}
{{- define "flowkube.validate" -}}
{{- if and (eq .Values.rbac.scope "namespaced") (empty .Values.watchNamespaces) }}
{{- fail "rbac.scope=namespaced needs watchNamespaces: the operator may only read Flows where it holds a Role" }}
{{- end }}
{{- /* int: values.yaml numbers are floats, --set ones integers. */}}
{{- $others := list (int .Values.health.port) (int .Values.metrics.port) }}
{{- if .Values.webhook.enabled }}{{ $others = append $others (int .Values.webhook.port) }}{{ end }}
{{- if .Values.validator.enabled }}{{ $others = append $others (int .Values.validator.port) }}{{ end }}
{{- if has (int .Values.state.port) $others }}
{{- fail (printf "state.port %v is already the port of another endpoint of the operator pod" .Values.state.port) }}
{{- end }}
{{- end }}

{{/* Shared fields of every admission webhook entry. */}}
{{- define "flowkube.webhookCommon" -}}
admissionReviewVersions: ["v1"]
sideEffects: None
matchPolicy: Equivalent
timeoutSeconds: {{ .Values.webhook.timeoutSeconds }}
{{- with .Values.watchNamespaces }}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: In
      values:
        {{- toYaml . | nindent 8 }}
{{- end }}
{{- end }}
{{- define "flowkube.webhookClient" -}}
clientConfig:
{{- if .root.Values.webhook.url }}
  url: {{ printf "%s%s" (trimSuffix "/" .root.Values.webhook.url) .path | quote }}
{{- else }}
  service:
    name: {{ include "flowkube.webhookName" .root }}
    namespace: {{ .root.Release.Namespace }}
    path: {{ .path }}
    port: 443
{{- end }}
{{- end }}
