{{- define "batchfleet.name" -}}{{ .Release.Name }}-batchfleet{{- end -}}

{{- define "batchfleet.labels" -}}
app.kubernetes.io/name: batchfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "batchfleet.workerSelector" -}}
app.kubernetes.io/name: batchfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end -}}

{{/* Redis environment: the password comes from a Secret, never from values. */}}
{{- define "batchfleet.redisEnv" -}}
{{- if .Values.redis.passwordSecret.name }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.passwordSecret.name }}
      key: {{ .Values.redis.passwordSecret.key }}
- name: REDIS_URL
  value: "{{ if .Values.redis.tls }}rediss{{ else }}redis{{ end }}://:$(REDIS_PASSWORD)@{{ .Values.redis.host }}:{{ .Values.redis.port }}"
{{- else }}
- name: REDIS_URL
  value: "{{ if .Values.redis.tls }}rediss{{ else }}redis{{ end }}://{{ .Values.redis.host }}:{{ .Values.redis.port }}"
{{- end }}
{{- end -}}

{{/* Comma-separated job names. */}}
{{- define "batchfleet.jobNames" -}}
{{- $names := list -}}
{{- range .Values.jobs }}{{ $names = append $names .name }}{{ end -}}
{{- join "," $names -}}
{{- end -}}
