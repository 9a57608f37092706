# Kueue on scripts/k8s.sh's control plane: sourced by k8s.sh (`build --kueue`, `up DIR --kueue`,
# `down DIR`), which provides DIR, start, wait_healthy, kubectl_, free_port and die.
#
# Kueue runs as a process, not as its Deployment: its own CRDs, webhook configurations and RBAC
# come from the published module (config/default rendered by kubectl's kustomize, less the
# Deployment, Services, APIServices and ConfigMap); it authenticates as its own ServiceAccount.
# The apiserver reaches webhooks through a Service's EndpointSlice, which may not name a loopback
# address: `up` makes a network namespace and a veth pair with a /30 of 10.213.N.0 that exists
# only between this host and that namespace, and Kueue's webhook listens on the host end
# (10.213.N.1), the address the EndpointSlice names. Kueue's internal cert management writes the
# serving certificate to a Secret and injects the CA; `up` copies the Secret into Kueue's cert
# folder, as the kubelet's secret volume would.

KUEUE_VERSION=0.17.0
KUEUE_CACHE="${FTJOB_K8S_CACHE:-$HOME/.cache/ftjob/k8s}/kueue-v$KUEUE_VERSION"
KUEUE_NS=kueue-system
KUEUE_SA=kueue-controller-manager
KUEUE_SECRET=kueue-webhook-server-cert
KUEUE_SERVICE=kueue-webhook-service
KUEUE_NET_LOCK="${TMPDIR:-/tmp}/ftjob-kueue-net.lock"

kueue_built() { [[ -x "$KUEUE_CACHE/bin/kueue" && -s "$KUEUE_CACHE/kueue-manifests.yaml" ]]; }

# Kueue's manifests (config/default of the module) without what a process outside the cluster
# replaces: the Deployment, its ConfigMap, the Services (ours has no selector), the APIServices
# of the visibility server (an unavailable aggregated API breaks clients' discovery).
kueue_manifests() {
  local dir
  dir=$(go mod download -json "sigs.k8s.io/kueue@v$KUEUE_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  "${KUBECTL:-kubectl}" kustomize "$dir/config/default" | python3 -c '
import re, sys
drop = {"Deployment", "ConfigMap", "Service", "APIService"}
docs = re.split(r"^---\n", sys.stdin.read(), flags=re.M)
kind = lambda d: (re.search(r"^kind: (\S+)", d, re.M) or [None, None])[1]
print("---\n".join(d for d in docs if d.strip() and kind(d) not in drop), end="")
' >"$KUEUE_CACHE/kueue-manifests.yaml.new"
  mv "$KUEUE_CACHE/kueue-manifests.yaml.new" "$KUEUE_CACHE/kueue-manifests.yaml"
}

kueue_build() {
  if kueue_built; then echo "kueue.sh: cached in $KUEUE_CACHE"; return; fi
  command -v go >/dev/null || die "go is not installed (Kueue v$KUEUE_VERSION needs Go >= 1.25)"
  mkdir -p "$KUEUE_CACHE/bin"
  # Kueue's go.mod has no replaces: `go install` of the published module is enough.
  [[ -x "$KUEUE_CACHE/bin/kueue" ]] || GOBIN="$KUEUE_CACHE/bin" GOFLAGS=-trimpath \
    go install -ldflags "-s -w" "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION"
  command -v "${KUBECTL:-kubectl}" >/dev/null ||
    die "kubectl is not on PATH (set KUBECTL): its kustomize renders Kueue's manifests"
  kueue_manifests
  kueue_built || die "the Kueue build left nothing in $KUEUE_CACHE"
  echo "kueue.sh: built into $KUEUE_CACHE"
}

# ------------------------------------------------------------------------------------ network

# kueue_net: the first N in 1..250 whose 10.213.N.0/30 no interface holds; a namespace
# ftjob-kueue-N with the veth pair ftjk-N (host, .1) / ftjk-N-p (namespace, .2). Under a lock,
# so that two planes brought up at once take different N.
kueue_net() {
  command -v ip >/dev/null || die "ip (iproute2) is not installed: apt-get install iproute2"
  local n used
  exec 9>"$KUEUE_NET_LOCK"
  flock 9
  used=$(ip -o -4 addr show | awk '{print $4}')
  for ((n = 1; n <= 250; n++)); do
    grep -q "^10\.213\.$n\." <<<"$used" || ip netns list | grep -q "^ftjob-kueue-$n\b" || break
  done
  ((n <= 250)) || die "no free 10.213.N.0/30 for Kueue's webhook"
  echo "$n" >"$DIR/kueue/net"
  ip netns add "ftjob-kueue-$n"
  ip link add "ftjk-$n" type veth peer name "ftjk-$n-p"
  ip link set "ftjk-$n-p" netns "ftjob-kueue-$n"
  ip addr add "10.213.$n.1/30" dev "ftjk-$n"
  ip link set "ftjk-$n" up
  ip -n "ftjob-kueue-$n" addr add "10.213.$n.2/30" dev "ftjk-$n-p"
  ip -n "ftjob-kueue-$n" link set "ftjk-$n-p" up
  ip -n "ftjob-kueue-$n" link set lo up
  flock -u 9
  KUEUE_ADDR="10.213.$n.1"
}

kueue_net_down() {
  local n
  [[ -f "$1/kueue/net" ]] || return 0
  n=$(cat "$1/kueue/net")
  # Deleting one end of a veth pair deletes both; the namespace holds the other end.
  ip link del "ftjk-$n" 2>/dev/null || true
  ip netns del "ftjob-kueue-$n" 2>/dev/null || true
  rm -f "$1/kueue/net"
  echo "k8s.sh: removed Kueue's network namespace ftjob-kueue-$n"
}

# ------------------------------------------------------------------------------------ up

kueue_service() {
  cat <<EOF
apiVersion: v1
kind: Service
metadata: {name: $KUEUE_SERVICE, namespace: $KUEUE_NS}
spec:
  ports: [{port: 443, protocol: TCP, targetPort: 9443}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: $KUEUE_SERVICE-host
  namespace: $KUEUE_NS
  labels:
    kubernetes.io/service-name: $KUEUE_SERVICE
    endpointslice.kubernetes.io/managed-by: ftjob.dev-k8s.sh
addressType: IPv4
endpoints: [{addresses: ["$KUEUE_ADDR"], conditions: {ready: true}}]
ports: [{port: 9443, protocol: TCP, name: ""}]
EOF
}

# The Configuration a cluster that runs ftjob needs (docs/install.md shows the same fields):
# the pod integration on, the namespaces Kueue manages; plus what a process outside a pod
# needs: no leader election, the webhook on the veth address, probes on loopback.
kueue_config() {
  cat <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: $KUEUE_NS
health: {healthProbeBindAddress: "127.0.0.1:$1"}
metrics: {bindAddress: "0"}
webhook: {host: "$KUEUE_ADDR", port: 9443, certDir: "$DIR/kueue/certs"}
leaderElection: {leaderElect: false}
internalCertManagement:
  enable: true
  webhookServiceName: $KUEUE_SERVICE
  webhookSecretName: $KUEUE_SECRET
managedJobsNamespaceSelector:
  matchExpressions:
  - {key: kubernetes.io/metadata.name, operator: NotIn, values: [kube-system, $KUEUE_NS]}
integrations:
  frameworks: [batch/job, pod]
EOF
}

# A kubeconfig with a token of Kueue's own ServiceAccount: Kueue gets the RBAC its manifests
# grant, no more.
kueue_kubeconfig() {
  local token
  token=$(kubectl_ create token "$KUEUE_SA" -n "$KUEUE_NS" --duration=168h)
  sed -e '/client-certificate:/d' -e "s|client-key: .*|token: $token|" \
    "$DIR/admin.kubeconfig" >"$DIR/kueue/kueue.kubeconfig"
}

# What the kubelet's secret volume does in a pod: the Secret's certificate into the cert folder.
kueue_mount_certs() {
  local crt
  for _ in $(seq 600); do
    crt=$(kubectl_ get secret "$KUEUE_SECRET" -n "$KUEUE_NS" -o 'jsonpath={.data.tls\.crt}')
    [[ -n "$crt" ]] && break
    kill -0 "$(awk '$1 == "kueue" {print $2}' "$DIR/pids")" 2>/dev/null ||
      { tail -20 "$DIR/logs/kueue.log" >&2; die "kueue exited"; }
    sleep 0.1
  done
  [[ -n "$crt" ]] || die "Kueue wrote no certificate to secret $KUEUE_SECRET within 60 s"
  base64 -d <<<"$crt" >"$DIR/kueue/certs/tls.crt"
  kubectl_ get secret "$KUEUE_SECRET" -n "$KUEUE_NS" -o 'jsonpath={.data.tls\.key}' |
    base64 -d >"$DIR/kueue/certs/tls.key"
}

# Ready means the apiserver can call the webhooks: a server-side dry run of a ResourceFlavor
# goes through Kueue's webhook (with the injected CA) and is admitted.
kueue_wait_webhook() {
  local probe='{"apiVersion":"kueue.x-k8s.io/v1beta2","kind":"ResourceFlavor","metadata":{"name":"ftjob-probe"}}'
  for _ in $(seq 300); do
    kubectl_ create --dry-run=server -f - <<<"$probe" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  kubectl_ create --dry-run=server -f - <<<"$probe" >&2 || true
  tail -20 "$DIR/logs/kueue.log" >&2
  die "the apiserver cannot call Kueue's webhook at $KUEUE_ADDR:9443 within 60 s"
}

kueue_up() {
  kueue_built || die "no Kueue in $KUEUE_CACHE: run 'scripts/k8s.sh build --kueue' first"
  local health
  mkdir -p "$DIR/kueue/certs"
  kueue_net
  kubectl_ apply --server-side -f "$KUEUE_CACHE/kueue-manifests.yaml" >/dev/null
  kubectl_ wait --for=condition=Established --timeout=60s crd -l app.kubernetes.io/name=kueue \
    >/dev/null
  kueue_service | kubectl_ apply -f - >/dev/null
  health=$(free_port)
  kueue_config "$health" >"$DIR/kueue/config.yaml"
  kueue_kubeconfig
  start kueue "$KUEUE_CACHE/bin/kueue" --kubeconfig "$DIR/kueue/kueue.kubeconfig" \
    --config "$DIR/kueue/config.yaml" --feature-gates VisibilityOnDemand=false
  kueue_mount_certs
  wait_healthy kueue "http://127.0.0.1:$health/readyz"
  kueue_wait_webhook
}
