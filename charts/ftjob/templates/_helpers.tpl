{{/* Names, labels and the operator's command line; shared by every template. */}}

{{- define "ftjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-ftjob, or the release name alone if it already says ftjob. */}}
{{- define "ftjob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Selector labels. component=operator keeps the operator's selector from matching trainer
pods, which carry app.kubernetes.io/name=ftjob too (the children's labels, docs/operator.md).
*/}}
{{- define "ftjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ftjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "ftjob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ftjob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ftjob
{{- end }}

{{- define "ftjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ftjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ftjob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
`ftjob operator`'s arguments (ftjob/operator/__main__.py; tests/unit/test_chart.py parses
them with the operator's own argparse definition):
  scope    --all-namespaces, or one --namespace per watchNamespaces entry
  peering  --peering NAME (kopf peering; replicas need distinct priorities), else --standalone
           so kopf never looks for peering objects it has no RBAC for
  probes   --liveness on operator.healthPort; --metrics-port (0 turns metrics off)
*/}}
{{- define "ftjob.operatorArgs" -}}
- operator
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if .Values.peering.enabled }}
- --peering={{ .Values.peering.name }}
- --peering-lifetime={{ .Values.peering.lifetime }}
{{- else }}
- --standalone
{{- end }}
- --liveness=http://0.0.0.0:{{ .Values.operator.healthPort }}/healthz
- --metrics-port={{ if .Values.metrics.enabled }}{{ .Values.metrics.port }}{{ else }}0{{ end }}
{{- range .Values.operator.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
RBAC rules for the namespaced resources the operator touches: every verb is one call in
ftjob/operator/kube.py or one need of kopf for the handlers in ftjob/operator/handlers.py
(tests/unit/test_chart.py derives both lists from the code and compares them with these).
*/}}
{{- define "ftjob.namespacedRules" -}}
# kopf: one daemon per FineTuneJob needs the jobs listed and watched, and patched for the
# finalizer that stops the daemon before deletion and for kopf's progress annotations.
# get: kube.job_uid, that the job is still the object its daemon serves before creating.
# delete: kube.delete_job, when ttlSecondsAfterFinished runs out.
- apiGroups: [ftjob.dev]
  resources: [finetunejobs]
  verbs: [get, list, watch, patch, delete]
# kube.patch_status: phase, conditions, progress (the status subresource).
- apiGroups: [ftjob.dev]
  resources: [finetunejobs/status]
  verbs: [patch]
# The children's owner reference sets blockOwnerDeletion (render.owner_reference): with
# OwnerReferencesPermissionEnforcement on (OpenShift, hardened clusters) the API server
# refuses to create them unless the creator may update the owner's finalizers.
- apiGroups: [ftjob.dev]
  resources: [finetunejobs/finalizers]
  verbs: [update]
# kopf: the pod index and pod event handler watch the trainer pods.
# kube.create: one pod per node; kube.delete: a failed gang is replaced whole.
# kube.owners (get): whose is a pod of the same name that already exists.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, get, delete]
# kube.create: the headless rendezvous Service and the ConfigMap holding the job's spec.
# Never updated: owner references garbage-collect them. get and delete: one of the same
# name left by a deleted job (another owner UID) is removed, never adopted.
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [create, get, delete]
# kopf.event(): an Event on every phase transition, and kopf's own warnings.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# kube.workload (get): why a queued gang waits and where Kueue admitted it (the Queued and
# Admitted conditions), for jobs with spec.scheduling.queue; read-only, by name.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get]
# Each gang attempt's PodGroup (Kubernetes 1.37, scheduling.k8s.io/v1beta1, where served): the
# scheduler binds its pods all together or none. Made and replaced like the ConfigMap.
- apiGroups: [scheduling.k8s.io]
  resources: [podgroups]
  verbs: [get, create, delete]
{{- if and .Values.peering.enabled .Values.watchNamespaces }}
# kopf peering in namespaced mode: watch every KopfPeering, write keep-alives only to ours.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  resourceNames: [{{ .Values.peering.name | quote }}]
  verbs: [patch]
{{- end }}
{{- end }}

{{/* Cluster-scoped rules, needed in either mode. */}}
{{- define "ftjob.clusterRules" -}}
# kopf: watches CRDs to notice FineTuneJob's CRD being (re)installed or removed; read-only.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# Profiles: kopf's indexes of every FineTuneProfile (cluster-scoped) and of the namespaces'
# labels (one may name the namespace's default profile), read at each reconcile; read-only.
- apiGroups: [ftjob.dev]
  resources: [finetuneprofiles]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- if and .Values.peering.enabled (not .Values.watchNamespaces) }}
# kopf peering cluster-wide: watch every ClusterKopfPeering, write keep-alives only to ours.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch]
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  resourceNames: [{{ .Values.peering.name | quote }}]
  verbs: [patch]
{{- end }}
{{- end }}
