{{/*
Named templates of the egress-gateway chart.

The sidecar templates take one dict argument, so an agent's chart can call them with its
own root context and this chart's values:

  in this chart:                         (dict "root" $ "gateway" $.Values)
  in an agent chart depending on it:     (dict "root" $ "gateway" (index $.Values "egress-gateway"))

An optional "replicas" key (the Deployment's replicas) lets the policy check warn about
local budgets that each replica counts alone.

What an agent's pod needs, in two includes (three with sidecar.native false):

  egress-gateway.initContainers           list items for initContainers: the policy check
                                          (policy.validateOnStart), the netfilter rules
                                          (egress.enforce), and the sidecar itself when
                                          sidecar.native
  egress-gateway.containers               list items for containers: the sidecar when not
                                          sidecar.native (nothing otherwise)
  egress-gateway.volumes                  list items for volumes: what those containers mount

The finer pieces, and pod-level settings an agent's chart may also take:

  egress-gateway.sidecarContainer         the sidecar alone, one list item
  egress-gateway.sidecarVolumes           the same as egress-gateway.volumes
  egress-gateway.agentEnv                 EGRESS_GATEWAY_URL for the agent container
  egress-gateway.podAnnotations           checksum/policy and Prometheus annotations
  egress-gateway.podLabels                the label the metrics Service selects on
  egress-gateway.podSecurityContext       pod-level non-root, fsGroup, RuntimeDefault
  egress-gateway.serviceAccountName       the account a Vault Kubernetes-auth role binds
  egress-gateway.terminationGracePeriodSeconds
*/}}

{{- define "egress-gateway.name" -}}
{{- default "egress-gateway" .gateway.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-egress-gateway, or the release name when it already holds the chart name. */}}
{{- define "egress-gateway.fullname" -}}
{{- if .gateway.fullnameOverride }}
{{- .gateway.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "egress-gateway.name" . }}
{{- if contains $name .root.Release.Name }}
{{- .root.Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .root.Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of this chart's own resources (.root is this chart here). */}}
{{- define "egress-gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "egress-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "egress-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "egress-gateway.name" . }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{/* On every pod that runs the sidecar; the metrics Service selects on it. */}}
{{- define "egress-gateway.podLabels" -}}
egress-gateway/instance: {{ include "egress-gateway.fullname" . }}
{{- end }}

{{- define "egress-gateway.serviceAccountName" -}}
{{- if .gateway.serviceAccount.create }}
{{- default (include "egress-gateway.fullname" .) .gateway.serviceAccount.name }}
{{- else }}
{{- default "default" .gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "egress-gateway.policyConfigMapName" -}}
{{- default (printf "%s-policy" (include "egress-gateway.fullname" .)) .gateway.policy.existingConfigMap }}
{{- end }}

{{- define "egress-gateway.terminationGracePeriodSeconds" -}}
{{- .gateway.terminationGracePeriodSeconds | int }}
{{- end }}

{{/*
The image reference. The default tag is this chart's appVersion; called from an agent
chart, .root.Chart is the agent's, so the dependency's own chart is looked up.
*/}}
{{- define "egress-gateway.image" -}}
{{- $img := .gateway.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- $appVersion := "" }}
{{- if eq .root.Chart.Name "egress-gateway" }}
{{- $appVersion = .root.Chart.AppVersion }}
{{- else if and .root.Subcharts (hasKey .root.Subcharts "egress-gateway") }}
{{- $appVersion = (index .root.Subcharts "egress-gateway").Chart.AppVersion }}
{{- end }}
{{- $tag := default $appVersion $img.tag }}
{{- if not $tag }}
{{- fail "egress-gateway: set image.tag (or image.digest)" }}
{{- end }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}
{{- end }}

{{- define "egress-gateway.podAnnotations" -}}
{{- if and .gateway.policy.rollOnChange (not .gateway.policy.existingConfigMap) }}
checksum/policy: {{ include "egress-gateway.policyContent" . | sha256sum }}
{{- end }}
{{- if .gateway.metrics.prometheusAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .gateway.sidecar.opsPort | int | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
Pod-level defaults. With egress.enforce the pod-level runAsUser is left out: a container
that sets none must not inherit the sidecar's UID, the one UID whose traffic may leave.
*/}}
{{- define "egress-gateway.podSecurityContext" -}}
runAsNonRoot: true
{{- if not .gateway.egress.enforce }}
runAsUser: {{ .gateway.sidecar.uid | int }}
runAsGroup: {{ .gateway.sidecar.gid | int }}
{{- end }}
fsGroup: {{ .gateway.sidecar.gid | int }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The sidecar's container securityContext, also that of the policy check. */}}
{{- define "egress-gateway.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .gateway.sidecar.uid | int }}
runAsGroup: {{ .gateway.sidecar.gid | int }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "egress-gateway.agentEnv" -}}
- name: EGRESS_GATEWAY_URL
  value: {{ printf "http://127.0.0.1:%d" (.gateway.sidecar.port | int) | quote }}
{{- with .gateway.sidecar.unixSocket }}
- name: EGRESS_GATEWAY_SOCKET
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
An agent container's volume mounts for the sidecar: the Unix socket's directory (with
sidecar.unixSocket), as list items at column 0; nothing otherwise.
*/}}
{{- define "egress-gateway.agentVolumeMounts" -}}
{{- with .gateway.sidecar.unixSocket }}
- name: egress-gateway-socket
  mountPath: {{ dir . | quote }}
{{- end }}
{{- end }}

{{/*
An agent's container securityContext: agent.securityContext with the agent's own UID
(agents[].uid) as runAsUser and runAsNonRoot true, so that the UID the kernel reports
for its calls is the one the policy's agents: section gives it. Called with (dict
"gateway" .Values "agent" ID); an agent's own chart uses it for each agent container.
*/}}
{{- define "egress-gateway.agentSecurityContext" -}}
{{- $id := .agent }}
{{- $found := dict }}
{{- range .gateway.agents }}{{ if eq .id $id }}{{ $found = . }}{{ end }}{{ end }}
{{- if not $found }}
{{- fail (printf "egress-gateway: no agent %q in agents (each agent container runs as the UID its agents entry gives)" $id) }}
{{- end }}
{{- $own := dict "runAsUser" ($found.uid | int64) "runAsNonRoot" true }}
{{- toYaml (merge $own (deepCopy (default dict .gateway.agent.securityContext))) }}
{{- end }}

{{/*
The example Deployment's agent containers: one per agents entry (named by its
containerName, else its id; its image, command, args and env, else agent.*'s; its UID:
egress-gateway.agentSecurityContext); without agents, the one "agent" container.
Called with the Deployment's context (dict "root" "gateway" "replicas").
*/}}
{{- define "egress-gateway.agentContainers" -}}
{{- $g := .gateway }}
{{- $items := list }}
{{- $names := dict }}
{{- range $g.agents }}
{{- $name := default .id .containerName }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" $name) }}
{{- fail (printf "egress-gateway: agents %s: %q is not a container name (lowercase letters, digits and '-'); set its containerName" .id $name) }}
{{- end }}
{{- if or (eq $name "egress-gateway") (hasPrefix "egress-gateway-" $name) }}
{{- fail (printf "egress-gateway: agents %s: container name %q is the chart's own (egress-gateway*); set its containerName" .id $name) }}
{{- end }}
{{- if hasKey $names $name }}
{{- fail (printf "egress-gateway: agents %s and %s have one container name (%q): set containerName" (get $names $name) .id $name) }}
{{- end }}
{{- $_ := set $names $name .id }}
{{- $security := include "egress-gateway.agentSecurityContext" (dict "gateway" $g "agent" .id) | fromYaml }}
{{- $items = append $items (dict "name" $name "spec" . "securityContext" $security) }}
{{- end }}
{{- if not $g.agents }}
{{- $items = list (dict "name" "agent" "spec" dict "securityContext" $g.agent.securityContext) }}
{{- end }}
{{- range $items }}
{{- $spec := .spec }}
{{- $image := default $g.agent.image $spec.image }}
- name: {{ .name }}
  image: {{ printf "%s:%s" $image.repository $image.tag | quote }}
  imagePullPolicy: {{ default $g.agent.image.pullPolicy $image.pullPolicy }}
  {{- with (hasKey $spec "command" | ternary $spec.command $g.agent.command) }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (hasKey $spec "args" | ternary $spec.args $g.agent.args) }}
  args:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    {{- include "egress-gateway.agentEnv" $ | nindent 4 }}
    {{- with (hasKey $spec "env" | ternary $spec.env $g.agent.env) }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml $g.agent.resources | nindent 4 }}
  {{- with .securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: agent-tmp
      mountPath: /tmp
    {{- with include "egress-gateway.agentVolumeMounts" $ }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end }}
{{- end }}

{{/*
The policy file's text: policy.content, and with agents its agents: section rendered
from the values (each id: {uid, targets, rate_limit_group}).
*/}}
{{- define "egress-gateway.policyContent" -}}
{{- $g := .gateway -}}
{{- if $g.agents -}}
{{- $agents := dict -}}
{{- range $g.agents -}}
{{- $entry := dict "uid" (.uid | int64) -}}
{{- if hasKey . "targets" }}{{ $_ := set $entry "targets" .targets }}{{ end -}}
{{- if hasKey . "rateLimitGroup" }}{{ $_ := set $entry "rate_limit_group" .rateLimitGroup }}{{ end -}}
{{- $_ := set $agents .id $entry -}}
{{- end -}}
{{- printf "%s\n%s\n" (trimSuffix "\n" $g.policy.content) (toYaml (dict "agents" $agents)) -}}
{{- else -}}
{{- $g.policy.content -}}
{{- end -}}
{{- end }}

{{/*
Checks across values and the policy that a JSON schema cannot express. Renders nothing;
fails the render with a message naming the keys to fix.
*/}}
{{- define "egress-gateway.validate" -}}
{{- $g := .gateway }}
{{- if eq ($g.sidecar.port | int) ($g.sidecar.opsPort | int) }}
{{- fail "egress-gateway: sidecar.port and sidecar.opsPort must differ" }}
{{- end }}
{{- if and $g.agents $g.policy.existingConfigMap }}
{{- fail "egress-gateway: agents are rendered into policy.content; with policy.existingConfigMap write them in that policy" }}
{{- end }}
{{- if not $g.policy.existingConfigMap }}
{{- if not $g.policy.content }}
{{- fail "egress-gateway: set policy.content or policy.existingConfigMap" }}
{{- end }}
{{- $policy := fromYaml $g.policy.content }}
{{- if hasKey $policy "Error" }}
{{- fail (printf "egress-gateway: policy.content is not a YAML mapping: %s" $policy.Error) }}
{{- end }}
{{- if and $g.agents (hasKey $policy "agents") }}
{{- fail "egress-gateway: the policy.content has an agents: section and the values list agents: write them in one place" }}
{{- end }}
{{- $uids := dict }}
{{- $ids := dict }}
{{- range $g.agents }}
{{- /* one policy entry per id: a second would take the first's place and its container's UID */}}
{{- if hasKey $ids .id }}
{{- fail (printf "egress-gateway: agents %s is listed twice: one entry per agent" .id) }}
{{- end }}
{{- $_ := set $ids .id true }}
{{- $uid := toString (.uid | int64) }}
{{- if eq (.uid | int64) ($g.sidecar.uid | int64) }}
{{- fail (printf "egress-gateway: agents %s has sidecar.uid (%s): give each agent a UID of its own" .id $uid) }}
{{- end }}
{{- if hasKey $uids $uid }}
{{- fail (printf "egress-gateway: agents %s and %s have one UID (%s): one UID, one agent" (get $uids $uid) .id $uid) }}
{{- end }}
{{- $_ := set $uids $uid .id }}
{{- end }}
{{- $drain := 20.0 }}
{{- with $policy.server }}{{ if hasKey . "drain_s" }}{{ $drain = .drain_s | float64 }}{{ end }}{{ end }}
{{- if le ($g.terminationGracePeriodSeconds | float64) $drain }}
{{- fail (printf "egress-gateway: terminationGracePeriodSeconds (%v) must exceed the policy's server.drain_s (%v)" $g.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- include "egress-gateway.validateAudit" (dict "gateway" $g "policy" $policy) }}
{{- $auth := dict }}
{{- with $policy.secrets }}{{ with .vault }}{{ with .auth }}{{ $auth = . }}{{ end }}{{ end }}{{ end }}
{{- $k8sAuth := eq (toString (default "" $auth.method)) "kubernetes" }}
{{- $v := $g.vault.kubernetesAuth }}
{{- if and $k8sAuth (not $v.enabled) }}
{{- fail "egress-gateway: the policy uses Vault Kubernetes auth (secrets.vault.auth.method: kubernetes); set vault.kubernetesAuth.enabled=true so the projected token is mounted" }}
{{- end }}
{{- if $v.enabled }}
{{- if not $k8sAuth }}
{{- fail "egress-gateway: vault.kubernetesAuth.enabled is true but the policy's secrets.vault.auth.method is not kubernetes" }}
{{- end }}
{{- if ne (toString $auth.role) $v.role }}
{{- fail (printf "egress-gateway: vault.kubernetesAuth.role (%q) differs from the policy's secrets.vault.auth.role (%q)" $v.role (toString $auth.role)) }}
{{- end }}
{{- $jwtPath := default "/var/run/secrets/kubernetes.io/serviceaccount/token" $auth.jwt_path }}
{{- if ne $jwtPath $v.tokenPath }}
{{- if hasKey $auth "jwt_path" }}
{{- fail (printf "egress-gateway: the policy's secrets.vault.auth.jwt_path (%q) must be vault.kubernetesAuth.tokenPath (%q), where the token is mounted" $jwtPath $v.tokenPath) }}
{{- else }}
{{- fail (printf "egress-gateway: the policy's secrets.vault.auth has no jwt_path, so the sidecar would read %q, which the chart does not mount (the API token is never mounted); add jwt_path: %s to secrets.vault.auth (vault.kubernetesAuth.tokenPath, where the projected token is)" $jwtPath $v.tokenPath) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The sidecar container, as one list item at column 0: indent it with nindent. The calls
API binds 127.0.0.1 only and gets no containerPort; only the ops port is declared.
*/}}
{{- define "egress-gateway.sidecarContainer" -}}
{{- include "egress-gateway.validate" . }}
{{- $g := .gateway -}}
- name: egress-gateway
  image: {{ include "egress-gateway.image" . | quote }}
  imagePullPolicy: {{ $g.image.pullPolicy }}
  {{- if $g.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args: ["serve", "--policy", "/etc/egress-gateway/policy.yaml"]
  env:
    - name: GATEWAY_POLICY
      value: /etc/egress-gateway/policy.yaml
    - name: GATEWAY_HOST
      value: "127.0.0.1"
    - name: GATEWAY_PORT
      value: {{ $g.sidecar.port | int | quote }}
    - name: GATEWAY_OPS_HOST
      value: "0.0.0.0"
    - name: GATEWAY_OPS_PORT
      value: {{ $g.sidecar.opsPort | int | quote }}
    {{- /* Local budget spend kept across a restart of the sidecar, on the pod's /tmp. */}}
    - name: GATEWAY_BUDGET_JOURNAL
      value: /tmp/egress-gateway/budgets.journal
    {{- if $g.sidecar.native }}
    {{- /* Stopped only after the agent has exited: no one is left to send a new call,
    so the drain refuses them and ends as soon as nothing is in flight. As a regular
    container the policy's server.shutdown.accept_new_calls (default true) applies. */}}
    - name: GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS
      value: "false"
    {{- end }}
    {{- with $g.vault.address }}
    - name: VAULT_ADDR
      value: {{ . | quote }}
    {{- end }}
    {{- with $g.vault.namespace }}
    - name: VAULT_NAMESPACE
      value: {{ . | quote }}
    {{- end }}
    {{- if $g.vault.skipVerify }}
    - name: VAULT_SKIP_VERIFY
      value: "true"
    {{- end }}
    {{- if $g.vault.caCert.configMap }}
    - name: VAULT_CACERT
      value: /etc/egress-gateway-vault-ca/ca.crt
    {{- end }}
    {{- if $g.redis.urlSecret.name }}
    - name: REDIS_URL
      valueFrom:
        secretKeyRef:
          name: {{ $g.redis.urlSecret.name | quote }}
          key: {{ $g.redis.urlSecret.key | quote }}
    {{- else if $g.redis.url }}
    - name: REDIS_URL
      value: {{ $g.redis.url | quote }}
    {{- end }}
    {{- with $g.sidecar.unixSocket }}
    - name: GATEWAY_UNIX_SOCKET
      value: {{ . | quote }}
    {{- end }}
    {{- with $g.sidecar.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: gateway-ops
      containerPort: {{ $g.sidecar.opsPort | int }}
      protocol: TCP
  startupProbe:
    httpGet:
      path: /healthz
      port: gateway-ops
    periodSeconds: {{ $g.sidecar.startupProbe.periodSeconds | int }}
    failureThreshold: {{ $g.sidecar.startupProbe.failureThreshold | int }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: gateway-ops
    periodSeconds: {{ $g.sidecar.livenessProbe.periodSeconds | int }}
    timeoutSeconds: {{ $g.sidecar.livenessProbe.timeoutSeconds | int }}
    failureThreshold: {{ $g.sidecar.livenessProbe.failureThreshold | int }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: gateway-ops
    periodSeconds: {{ $g.sidecar.readinessProbe.periodSeconds | int }}
    timeoutSeconds: {{ $g.sidecar.readinessProbe.timeoutSeconds | int }}
    failureThreshold: {{ $g.sidecar.readinessProbe.failureThreshold | int }}
  resources:
    {{- toYaml $g.sidecar.resources | nindent 4 }}
  # A refused policy or setting is the last lines of the log: shown by kubectl describe.
  terminationMessagePolicy: FallbackToLogsOnError
  securityContext:
    {{- include "egress-gateway.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: egress-gateway-policy
      mountPath: /etc/egress-gateway
      readOnly: true
    - name: egress-gateway-tmp
      mountPath: /tmp
    {{- if (($g.audit).volume).type }}
    - name: egress-gateway-audit
      mountPath: {{ $g.audit.volume.mountPath | quote }}
    {{- end }}
    {{- if $g.vault.kubernetesAuth.enabled }}
    - name: egress-gateway-vault-token
      mountPath: {{ dir $g.vault.kubernetesAuth.tokenPath | quote }}
      readOnly: true
    {{- end }}
    {{- if $g.vault.caCert.configMap }}
    - name: egress-gateway-vault-ca
      mountPath: /etc/egress-gateway-vault-ca
      readOnly: true
    {{- end }}
    {{- with $g.sidecar.unixSocket }}
    - name: egress-gateway-socket
      mountPath: {{ dir . | quote }}
    {{- end }}
    {{- with $g.sidecar.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The pod volumes of the sidecar, as list items at column 0. The policy ConfigMap is
mounted as a directory (no subPath) so updates arrive by the kubelet's symlink swap.
*/}}
{{- define "egress-gateway.sidecarVolumes" -}}
{{- $g := .gateway -}}
- name: egress-gateway-policy
  configMap:
    name: {{ include "egress-gateway.policyConfigMapName" . | quote }}
    items:
      - key: {{ ternary $g.policy.existingConfigMapKey "policy.yaml" (not (empty $g.policy.existingConfigMap)) | quote }}
        path: policy.yaml
- name: egress-gateway-tmp
  emptyDir:
    sizeLimit: {{ $g.sidecar.tmpSizeLimit | quote }}
{{- with (($g.audit).volume) }}
{{- if eq .type "emptyDir" }}
- name: egress-gateway-audit
  emptyDir:
    sizeLimit: {{ .size | quote }}
{{- else if eq .type "ephemeral" }}
- name: egress-gateway-audit
  ephemeral:
    volumeClaimTemplate:
      spec:
        accessModes: ["ReadWriteOnce"]
        {{- with .storageClassName }}
        storageClassName: {{ . | quote }}
        {{- end }}
        resources:
          requests:
            storage: {{ .size | quote }}
{{- else if eq .type "persistentVolumeClaim" }}
{{- if not .claimName }}
{{- fail "egress-gateway: audit.volume.type persistentVolumeClaim needs audit.volume.claimName" }}
{{- end }}
- name: egress-gateway-audit
  persistentVolumeClaim:
    claimName: {{ .claimName | quote }}
{{- end }}
{{- end }}
{{- if $g.vault.kubernetesAuth.enabled }}
- name: egress-gateway-vault-token
  projected:
    {{- /* Readable by the sidecar's UID without a pod fsGroup (an agent's chart may set
    its own or none). The volume is mounted in the sidecar container only; Kubernetes'
    own kube-api-access token volume has mode 0644. */}}
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          audience: {{ $g.vault.kubernetesAuth.audience | quote }}
          expirationSeconds: {{ $g.vault.kubernetesAuth.expirationSeconds | int }}
          path: {{ base $g.vault.kubernetesAuth.tokenPath | quote }}
{{- end }}
{{- if $g.vault.caCert.configMap }}
- name: egress-gateway-vault-ca
  configMap:
    name: {{ $g.vault.caCert.configMap | quote }}
    items:
      - key: {{ $g.vault.caCert.key | quote }}
        path: ca.crt
{{- end }}
{{- if $g.sidecar.unixSocket }}
- name: egress-gateway-socket
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- end }}
{{- with $g.sidecar.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The policy check: `egress-gateway validate` on the mounted policy, before the sidecar
starts. It fails the pod's start with FILE:LINE problems in its log and its termination
message; env:// variables that sidecar.extraEnv does not set are warnings (exit 0).
*/}}
{{- define "egress-gateway.validateContainer" -}}
{{- $g := .gateway -}}
- name: egress-gateway-validate
  image: {{ include "egress-gateway.image" . | quote }}
  imagePullPolicy: {{ $g.image.pullPolicy }}
  {{- /* .replicas: the agent Deployment's replicas, when the caller knows them; past
  one, local budgets are warned about (each replica counts alone). */}}
  args: ["validate", "/etc/egress-gateway/policy.yaml"{{ if gt (int (default 0 .replicas)) 1 }}, "--replicas", {{ .replicas | int | quote }}{{ end }}]
  {{- with $g.sidecar.extraEnv }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationMessagePolicy: FallbackToLogsOnError
  resources:  # the sidecar's program: the same memory
    {{- toYaml $g.sidecar.resources | nindent 4 }}
  securityContext:
    {{- include "egress-gateway.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: egress-gateway-policy
      mountPath: /etc/egress-gateway
      readOnly: true
    - name: egress-gateway-tmp
      mountPath: /tmp
{{- end }}

{{/*
The netfilter rules of egress.enforce: deploy/egress-gateway-enforce in the image. The
only container with NET_ADMIN; UID 0 because Kubernetes grants a non-root process no
effective capabilities. Everything else stays locked down.
*/}}
{{- define "egress-gateway.enforceContainer" -}}
{{- $g := .gateway -}}
{{- $e := $g.egress -}}
- name: egress-gateway-enforce
  image: {{ include "egress-gateway.image" . | quote }}
  imagePullPolicy: {{ $g.image.pullPolicy }}
  command: ["egress-gateway-enforce"]
  args:
    - --uid
    - {{ $g.sidecar.uid | int | quote }}
    - --dns-port
    - {{ $e.dns.port | int | quote }}
    {{- range $e.dns.servers }}
    - --dns
    - {{ . | quote }}
    {{- end }}
    {{- range $e.allow }}
    - --allow
    {{- if .ports }}
    - {{ printf "%s %s %s" .cidr (default "tcp" .protocol) (join "," .ports) | quote }}
    {{- else }}
    - {{ .cidr | quote }}
    {{- end }}
    {{- end }}
  terminationMessagePolicy: FallbackToLogsOnError
  resources:
    {{- toYaml $e.resources | nindent 4 }}
  securityContext:
    runAsNonRoot: false
    runAsUser: 0
    runAsGroup: 0
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    privileged: false
    capabilities:
      drop: ["ALL"]
      add: ["NET_ADMIN"]
    seccompProfile:
      type: RuntimeDefault
{{- end }}

{{/*
Everything an agent's pod lists under initContainers, in order: the policy check, the
netfilter rules (both finish before any other container starts), then the native sidecar.
*/}}
{{- define "egress-gateway.initContainers" -}}
{{- $g := .gateway -}}
{{- $items := list }}
{{- if $g.policy.validateOnStart }}
{{- $items = append $items (include "egress-gateway.validateContainer" .) }}
{{- end }}
{{- if $g.egress.enforce }}
{{- $items = append $items (include "egress-gateway.enforceContainer" .) }}
{{- end }}
{{- if $g.sidecar.native }}
{{- $items = append $items (include "egress-gateway.sidecarContainer" .) }}
{{- end }}
{{- join "\n" $items }}
{{- end }}

{{/* Everything an agent's pod lists under containers: the sidecar, unless native. */}}
{{- define "egress-gateway.containers" -}}
{{- if not .gateway.sidecar.native }}
{{- include "egress-gateway.sidecarContainer" . }}
{{- end }}
{{- end }}

{{- define "egress-gateway.volumes" -}}
{{- include "egress-gateway.sidecarVolumes" . }}
{{- end }}

{{/*
The TCP ports the sidecar connects to, as a JSON list: each target's base_url port (443
for https, 80 for http unless written), Vault's and Redis' (from the values or the
policy, with their defaults 8200 and 6379), and networkPolicy.extraPorts.
*/}}
{{- define "egress-gateway.egressPorts" -}}
{{- $g := .gateway }}
{{- $urls := list }}
{{- $policy := dict }}
{{- if not $g.policy.existingConfigMap }}
{{- $policy = fromYaml $g.policy.content }}
{{- end }}
{{- range $name, $target := (default dict $policy.targets) }}
{{- if kindIs "map" $target }}{{ $urls = append $urls (toString (default "" $target.base_url)) }}{{ end }}
{{- end }}
{{- $vault := dict }}
{{- with $policy.secrets }}{{ with .vault }}{{ $vault = . }}{{ end }}{{ end }}
{{- if $g.vault.address }}
{{- $urls = append $urls $g.vault.address }}
{{- else if $vault }}
{{- $urls = append $urls (toString (default "http://127.0.0.1:8200" $vault.address)) }}
{{- end }}
{{- $ports := list }}
{{- range $urls }}
{{- $u := urlParse . }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $u.host) }}
{{- if not $port }}{{ $port = ternary "443" "80" (eq $u.scheme "https") }}{{ end }}
{{- $ports = append $ports ($port | int) }}
{{- end }}
{{- if or $g.redis.url $g.redis.urlSecret.name $policy.redis }}
{{- $redisUrl := $g.redis.url }}
{{- if and (not $redisUrl) $policy.redis }}{{ $redisUrl = toString (default "" $policy.redis.url) }}{{ end }}
{{- $redisPort := "" }}
{{- if $redisUrl }}{{ $redisPort = regexFind "[0-9]+$" (regexFind ":[0-9]+$" (urlParse $redisUrl).host) }}{{ end }}
{{- $ports = append $ports (default "6379" $redisPort | int) }}
{{- end }}
{{- range $g.networkPolicy.extraPorts }}
{{- $ports = append $ports (. | int) }}
{{- end }}
{{- $ports | uniq | sortAlpha | toJson }}
{{- end }}

{{/* The injector's name, and the labels of its pods (which the webhook never injects). */}}
{{- define "egress-gateway.injectorName" -}}
{{- printf "%s-injector" (include "egress-gateway.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "egress-gateway.injectorSelectorLabels" -}}
{{ include "egress-gateway.selectorLabels" . }}
app.kubernetes.io/component: injector
egress-gateway.io/injector: "true"
{{- end }}

{{/*
The injection template (JSON, the shape gateway/inject/patch.py reads): what the named
templates above give a hand-written agent pod, with the sidecar always native.
*/}}
{{- define "egress-gateway.injectionTemplate" -}}
{{- $values := deepCopy .gateway }}
{{- $_ := set $values.sidecar "native" true }}
{{- $ctx := dict "root" .root "gateway" $values }}
{{- $tpl := dict
  "initContainers" (include "egress-gateway.initContainers" $ctx | fromYamlArray)
  "containers" list
  "volumes" (include "egress-gateway.volumes" $ctx | fromYamlArray)
  "labels" (include "egress-gateway.podLabels" $ctx | fromYaml)
  "agentEnv" (include "egress-gateway.agentEnv" $ctx | fromYamlArray)
  "policyVolume" "egress-gateway-policy" }}
{{- toJson $tpl }}
{{- end }}

{{/* A Kubernetes quantity ("64Mi", "1Gi", "500M", "1048576") as bytes; fails on others. */}}
{{- define "egress-gateway.quantityBytes" -}}
{{- $q := toString . }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $unit := trimPrefix $num $q }}
{{- $mult := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- if or (not $num) (not (hasKey $mult $unit)) }}
{{- fail (printf "egress-gateway: %q is not a size this chart reads (e.g. 64Mi, 1Gi, 500M)" $q) }}
{{- end }}
{{- mulf (float64 $num) (index $mult $unit) | int64 }}
{{- end }}

{{/*
The audit file sink against the volume it is written to: the path must be on /tmp or on
audit.volume, and the rotation (max_bytes x (backup_count + 1)), with the OTLP spool when
it shares the volume, must fit that volume: a file that outgrows an emptyDir's sizeLimit
gets the pod evicted.
*/}}
{{- define "egress-gateway.validateAudit" -}}
{{- $g := .gateway }}
{{- $audit := default dict .policy.audit }}
{{- if eq (toString $audit.sink) "file" }}
{{- $path := toString $audit.path }}
{{- $vol := default dict (default dict $g.audit).volume }}
{{- $name := "" }}{{ $size := 0 }}
{{- if and $vol.type (hasPrefix (printf "%s/" (trimSuffix "/" $vol.mountPath)) $path) }}
{{- $name = "audit.volume.size" }}{{ $size = include "egress-gateway.quantityBytes" $vol.size | int64 }}
{{- else if hasPrefix "/tmp/" $path }}
{{- $name = "sidecar.tmpSizeLimit" }}{{ $size = include "egress-gateway.quantityBytes" $g.sidecar.tmpSizeLimit | int64 }}
{{- else }}
{{- fail (printf "egress-gateway: the policy's audit.path (%s) is on no writable volume (the root filesystem is read-only): put it under /tmp or set audit.volume and put it under audit.volume.mountPath (%s)" $path (default "/var/log/egress-gateway" $vol.mountPath)) }}
{{- end }}
{{- if not $audit.max_bytes }}
{{- fail (printf "egress-gateway: the policy's audit sink file has no max_bytes, so it grows without bound on a volume of %s (%s): set audit.max_bytes and audit.backup_count" (toString (ternary $vol.size $g.sidecar.tmpSizeLimit (eq $name "audit.volume.size"))) $name) }}
{{- end }}
{{- $keep := add1 (hasKey $audit "backup_count" | ternary ($audit.backup_count | int64) 5) }}
{{- $rotation := mul ($audit.max_bytes | int64) $keep }}
{{- $spool := 0 }}
{{- with $audit.otlp }}
{{- $spoolPath := default "/tmp/egress-gateway/audit-spool" .spool_path }}
{{- if or (and (eq $name "sidecar.tmpSizeLimit") (hasPrefix "/tmp/" $spoolPath)) (and (eq $name "audit.volume.size") (hasPrefix $vol.mountPath $spoolPath)) }}
{{- $spool = default 33554432 .spool_max_bytes | int64 }}
{{- end }}
{{- end }}
{{- if gt (add $rotation $spool) $size }}
{{- fail (printf "egress-gateway: the audit file's rotation (max_bytes %d x %d files = %d bytes%s) is larger than its volume (%s: %d bytes): lower audit.max_bytes or audit.backup_count, or give it a larger volume (audit.volume)" ($audit.max_bytes | int64) $keep $rotation (ternary (printf ", plus the OTLP spool's %d" $spool) "" (gt $spool 0)) $name $size) }}
{{- end }}
{{- end }}
{{- end }}
