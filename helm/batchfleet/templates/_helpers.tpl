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

{{- define "batchfleet.scalerSelector" -}}
app.kubernetes.io/name: batchfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: scaler
{{- end -}}

{{- define "batchfleet.consoleSelector" -}}
app.kubernetes.io/name: batchfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: console
{{- end -}}

{{/* The scaler's work-left URL as the cluster sees it. */}}
{{- define "batchfleet.scalerUrl" -}}
http://{{ include "batchfleet.name" . }}-scaler.{{ .Release.Namespace }}.svc:{{ .Values.scaler.port }}/remaining
{{- end -}}

{{/* Redis environment: user name and password come from a Secret, never
from values. The URL lists every seed node of a cluster, comma-separated. */}}
{{- define "batchfleet.redisEnv" -}}
{{- $r := .Values.redis -}}
{{- $scheme := ternary "rediss" "redis" (default false $r.tls) -}}
{{- $auth := "" -}}
{{- if $r.passwordSecret.name }}
{{- if $r.passwordSecret.usernameKey }}
- name: REDIS_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $r.passwordSecret.name }}
      key: {{ $r.passwordSecret.usernameKey }}
{{- $auth = "$(REDIS_USERNAME):$(REDIS_PASSWORD)@" }}
{{- else }}
{{- $auth = ":$(REDIS_PASSWORD)@" }}
{{- end }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $r.passwordSecret.name }}
      key: {{ $r.passwordSecret.key }}
{{- end }}
{{- $urls := list }}
{{- range (include "batchfleet.redisNodes" . | splitList ",") }}
{{- $urls = append $urls (printf "%s://%s%s" $scheme $auth .) }}
{{- end }}
- name: REDIS_URL
  value: {{ join "," $urls | quote }}
{{- if and $r.caCertSecret $r.caCertSecret.name }}
- name: BATCHFLEET_REDIS_CA_CERT
  value: /etc/batchfleet/redis-ca/{{ $r.caCertSecret.key }}
{{- end }}
{{- end -}}

{{/* host:port of every Redis node batchfleet is given (one unless a cluster). */}}
{{- define "batchfleet.redisNodes" -}}
{{- if .Values.redis.clusterNodes -}}
{{- join "," .Values.redis.clusterNodes -}}
{{- else -}}
{{- printf "%s:%v" .Values.redis.host .Values.redis.port -}}
{{- end -}}
{{- end -}}

{{/* The CA volume mount and volume, when the server's CA comes from a Secret. */}}
{{- define "batchfleet.redisCaMount" -}}
{{- if and .Values.redis.caCertSecret .Values.redis.caCertSecret.name }}
- name: redis-ca
  mountPath: /etc/batchfleet/redis-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "batchfleet.redisCaVolume" -}}
{{- if and .Values.redis.caCertSecret .Values.redis.caCertSecret.name }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.caCertSecret.name }}
{{- end }}
{{- end -}}

{{/* Comma-separated job names. */}}
{{- define "batchfleet.jobNames" -}}
{{- $names := list -}}
{{- range .Values.jobs }}{{ $names = append $names .name }}{{ end -}}
{{- join "," $names -}}
{{- end -}}
