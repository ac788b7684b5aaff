{{/* The chart name. */}}
{{- define "elastic-rollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The full name of the release's objects. */}}
{{- define "elastic-rollout.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "elastic-rollout.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "elastic-rollout.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The operator pods' labels: the Deployment's selector and the NetworkPolicy's operator peer. */}}
{{- define "elastic-rollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastic-rollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The ServiceAccount's name. */}}
{{- define "elastic-rollout.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "elastic-rollout.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when kopf peering is on: several replicas, or asked for. */}}
{{- define "elastic-rollout.peering" -}}
{{- if or (gt (int .Values.replicas) 1) .Values.peering.enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when the database is the embedded SQLite on a volume (no PostgreSQL Secret given). */}}
{{- define "elastic-rollout.sqlite" -}}
{{- if not .Values.database.postgres.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The namespaces that get a NetworkPolicy: the release's and each watched one, without repeats. */}}
{{- define "elastic-rollout.policyNamespaces" -}}
{{- prepend .Values.watchNamespaces .Release.Namespace | uniq | toJson -}}
{{- end -}}
