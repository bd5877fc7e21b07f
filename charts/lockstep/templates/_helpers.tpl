{{/* The operator's identity as the API server names it; the barrier admission policy trusts only it. */}}
{{- define "lockstep.operatorUsername" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ .Values.serviceAccount.name }}
{{- end }}

{{- define "lockstep.labels" -}}
app.kubernetes.io/name: lockstep
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{- define "lockstep.selector" -}}
app.kubernetes.io/name: lockstep
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
