#!/usr/bin/env bash
# A real Kubernetes control plane built from the Go module proxy, for the cluster tests
# (tests/cluster/) and anyone who wants one on loopback:
#
#   scripts/k8s.sh build                      etcd, kube-apiserver, kube-controller-manager,
#                                             kube-scheduler and kwok into a cache keyed by version
#   scripts/k8s.sh up DIR [--gpu-nodes N]     start them on 127.0.0.1, all state in DIR; writes
#                                             DIR/admin.kubeconfig; returns when all are healthy
#                [--nodes N [--node-image REF]...]  (opt-in) N real nodes, kubelet + containerd
#                                             (scripts/nodes.sh; `build --nodes` first)
#                [--apiserver-arg ARG]...     (opt-in) one more kube-apiserver flag each, e.g.
#                                             --watch-cache=false or an audit log's flags
#   scripts/k8s.sh down DIR                   stop every process `up` started (by pid), and
#                                             remove the real nodes' containers, mounts, cgroups
#   scripts/k8s.sh bin                        print the folder holding the binaries
#
# Kubernetes' own go.mod replaces its 31 staging modules with ./staging/..., so `go install
# k8s.io/kubernetes/cmd/...@v1.37.2` is refused: the build writes a local module that requires
# k8s.io/kubernetes and replaces each staging module with its published v0.37.2 release. etcd
# gets its own module so that MVS does not raise the libraries the two share. Nothing but the
# Go module proxy is reached; the binaries live outside the repository:
# ${FTJOB_K8S_CACHE:-~/.cache/ftjob/k8s}/<versions>/bin.
set -euo pipefail

KUBE_VERSION=1.37.2
STAGING_VERSION=0.37.2
ETCD_VERSION=3.7.3
KWOK_VERSION=0.8.0
GO_DIRECTIVE=1.26.0
KEY="kube-v${KUBE_VERSION}_etcd-v${ETCD_VERSION}_kwok-v${KWOK_VERSION}"
# Kubernetes 1.37's Workload and PodGroup API (scheduling.k8s.io/v1beta1, KEP-4671; beta, off by
# default): the scheduler places a PodGroup's pods all together or none (its GangScheduling
# plugin), which the operator's gangs use where the API is served. The API server serves it,
# the scheduler acts on it; the controller manager takes the same gate.
WORKLOAD_GATE=GenericWorkload=true
WORKLOAD_API=scheduling.k8s.io/v1beta1=true
CACHE="${FTJOB_K8S_CACHE:-$HOME/.cache/ftjob/k8s}/$KEY"
BIN="$CACHE/bin"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
STAGING=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
  cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
  cri-client cri-streaming csi-translation-lib dynamic-resource-allocation endpointslice
  externaljwt kms kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl
  kubelet metrics mount-utils pod-security-admission sample-apiserver streaming)

die() { echo "k8s.sh: $*" >&2; exit 1; }

# Kueue (`build --kueue`, `up DIR --kueue`): kueue_build, kueue_up, kueue_net_down.
source "$(dirname "${BASH_SOURCE[0]}")/kueue.sh"
# Real nodes (`build --nodes`, `up DIR --nodes N`): nodes_build, nodes_up, nodes_clear, ...
source "$(dirname "${BASH_SOURCE[0]}")/nodes.sh"

# ------------------------------------------------------------------------------------ build

built() {
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
  [[ -s "$CACHE/kwok-stages.yaml" ]]
}

kube_module() {
  echo "module ftjob.dev/controlplane"
  echo
  echo "go $GO_DIRECTIVE"
  echo
  echo "require k8s.io/kubernetes v$KUBE_VERSION"
  echo
  for m in "${STAGING[@]}"; do echo "replace k8s.io/$m => k8s.io/$m v$STAGING_VERSION"; done
  echo
  printf 'tool (\n\tk8s.io/kubernetes/cmd/kube-apiserver\n'
  printf '\tk8s.io/kubernetes/cmd/kube-controller-manager\n\tk8s.io/kubernetes/cmd/kube-scheduler\n)\n'
}

etcd_module() {
  printf 'module ftjob.dev/etcd\n\ngo %s\n\nrequire go.etcd.io/etcd/server/v3 v%s\n\n' \
    "$GO_DIRECTIVE" "$ETCD_VERSION"
  printf 'tool go.etcd.io/etcd/server/v3\n'
}

build_kube() {
  local src="$CACHE/src/kube" v="k8s.io/component-base/version"
  mkdir -p "$src" && kube_module >"$src/go.mod"
  (cd "$src" && go mod tidy)
  # Without the version ldflags /version says v0.0.0-master and clients' version checks break.
  local flags="-s -w -X $v.gitVersion=v$KUBE_VERSION -X $v.gitMajor=${KUBE_VERSION%%.*}"
  flags+=" -X $v.gitMinor=$(echo "$KUBE_VERSION" | cut -d. -f2) -X $v.gitTreeState=clean"
  flags+=" -X $v.buildDate=1970-01-01T00:00:00Z"
  (cd "$src" && go build -trimpath -ldflags "$flags" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler)
}

build_etcd() {
  local src="$CACHE/src/etcd"
  mkdir -p "$src" && etcd_module >"$src/go.mod"
  (cd "$src" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" \
    go.etcd.io/etcd/server/v3)
}

build_kwok() {
  # kwok has no replaces: `go install` of the published module is enough.
  GOBIN="$BIN" GOFLAGS=-trimpath go install -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
}

# The kwok binary has no stages of its own (kwokctl embeds them): take the published module's
# "fast" ones from the module cache -- nodes become Ready and keep a heartbeat, pods become
# Running once scheduled and go away when deleted; Succeeded/Failed are the tests' patches.
kwok_stages() {
  local dir s
  dir=$(go mod download -json "sigs.k8s.io/kwok@v$KWOK_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  for s in node/fast/node-initialize node/heartbeat/node-heartbeat pod/fast/pod-ready \
    pod/fast/pod-delete; do
    echo "---" && cat "$dir/kustomize/stage/$s.yaml"
  done >"$CACHE/kwok-stages.yaml.new"
  mv "$CACHE/kwok-stages.yaml.new" "$CACHE/kwok-stages.yaml"
}

cmd_build() {
  if built; then echo "k8s.sh: cached in $BIN"; return; fi
  command -v go >/dev/null || die "go is not installed (Go >= $GO_DIRECTIVE builds the plane)"
  mkdir -p "$BIN"
  [[ -x "$BIN/kube-scheduler" ]] || build_kube
  [[ -x "$BIN/etcd" ]] || build_etcd
  [[ -x "$BIN/kwok" ]] || build_kwok
  kwok_stages
  built || die "the build left no binaries in $BIN"
  echo "k8s.sh: built into $BIN"
}

# ------------------------------------------------------------------------------------ up

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# cert NAME SUBJECT [EXT]: a key and a certificate signed by DIR/pki/ca.
cert() {
  local name=$1 subj=$2 ext=${3:-} pki="$DIR/pki"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$pki/$name.key" -subj "$subj" \
    -out "$pki/$name.csr" 2>/dev/null
  local extfile="$pki/$name.ext"
  printf '%s\n' "$ext" >"$extfile"
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 365 -extfile "$extfile" -out "$pki/$name.crt" 2>/dev/null
}

make_pki() {
  local pki="$DIR/pki"
  mkdir -p "$pki"
  openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -days 365 \
    -subj "/CN=ftjob-test-ca" -out "$pki/ca.crt" 2>/dev/null
  cert apiserver "/CN=kube-apiserver" \
    "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes.default.svc"
  cert admin "/O=system:masters/CN=kubernetes-admin" "extendedKeyUsage=clientAuth"
  cert controller-manager "/CN=system:kube-controller-manager" "extendedKeyUsage=clientAuth"
  cert scheduler "/CN=system:kube-scheduler" "extendedKeyUsage=clientAuth"
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
}

# kubeconfig NAME USER: DIR/NAME.kubeconfig with USER's client certificate.
kubeconfig() {
  local pki="$DIR/pki"
  cat >"$DIR/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ftjob-test
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $pki/ca.crt
users:
- name: $2
  user:
    client-certificate: $pki/$2.crt
    client-key: $pki/$2.key
contexts:
- name: ftjob-test
  context: {cluster: ftjob-test, user: $2}
current-context: ftjob-test
EOF
}

# start NAME ARGV...: a detached process (own session, so the caller's signals miss it);
# its pid goes to DIR/pids, its output to DIR/logs/NAME.log.
start() {
  local name=$1
  shift
  setsid "$@" </dev/null >"$DIR/logs/$name.log" 2>&1 &
  echo "$name $!" >>"$DIR/pids"
}

# wait_healthy NAME URL [CURL ARGS]: poll until URL answers "ok" (any case: CoreDNS says "OK";
# 60 s).
wait_healthy() {
  local name=$1 url=$2 pid
  shift 2
  pid=$(awk -v n="$name" '$1 == n {p = $2} END {print p}' "$DIR/pids")  # the latest
  for _ in $(seq 600); do
    if curl -fsS --max-time 2 "$@" "$url" 2>/dev/null | grep -qi '^ok\|"health":"true"'; then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { tail -20 "$DIR/logs/$name.log" >&2; die "$name exited"; }
    sleep 0.1
  done
  tail -20 "$DIR/logs/$name.log" >&2
  die "$name did not answer healthy at $url within 60 s"
}

start_etcd() {
  local port peer
  port=$(free_port) peer=$(free_port)
  ETCD_URL="http://127.0.0.1:$port"
  start etcd "$BIN/etcd" --data-dir "$DIR/etcd" --listen-client-urls "$ETCD_URL" \
    --advertise-client-urls "$ETCD_URL" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "default=http://127.0.0.1:$peer" --unsafe-no-fsync
  wait_healthy etcd "$ETCD_URL/health"
}

start_apiserver() {
  local pki="$DIR/pki"
  # --endpoint-reconciler-type=none: the reconciler refuses a loopback address.
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "$ETCD_URL" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --authorization-mode Node,RBAC --enable-admission-plugins OwnerReferencesPermissionEnforcement \
    --service-cluster-ip-range 10.0.0.0/24 --endpoint-reconciler-type none \
    --enable-aggregator-routing=true --allow-privileged=true \
    --feature-gates "$WORKLOAD_GATE" --runtime-config "$WORKLOAD_API" "${APISERVER_ARGS[@]}"
  wait_healthy kube-apiserver "https://127.0.0.1:$API_PORT/readyz" --cacert "$pki/ca.crt" \
    --cert "$pki/admin.crt" --key "$pki/admin.key"
}

start_controllers() {
  local kcm sched
  kcm=$(free_port) sched=$(free_port)
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$DIR/controller-manager.kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$kcm" --use-service-account-credentials \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --cluster-signing-cert-file "$DIR/pki/ca.crt" --cluster-signing-key-file "$DIR/pki/ca.key" \
    --feature-gates "$WORKLOAD_GATE"
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$DIR/scheduler.kubeconfig" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port "$sched" \
    --feature-gates "$WORKLOAD_GATE"
  wait_healthy kube-controller-manager "https://127.0.0.1:$kcm/healthz" -k
  wait_healthy kube-scheduler "https://127.0.0.1:$sched/healthz" -k
}

# gpu_nodes N: N fake nodes kwok manages (by annotation), each with 8 nvidia.com/gpu.
gpu_nodes() {
  local i
  for ((i = 0; i < $1; i++)); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-$i
  annotations: {kwok.x-k8s.io/node: fake}
  labels:
    kubernetes.io/hostname: gpu-node-$i
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    nvidia.com/gpu.present: "true"
spec: {}
status:
  allocatable: {cpu: "96", memory: 1Ti, pods: "110", nvidia.com/gpu: "8"}
  capacity: {cpu: "96", memory: 1Ti, pods: "110", nvidia.com/gpu: "8"}
EOF
  done
}

start_kwok() {
  local port
  port=$(free_port)
  start kwok "$BIN/kwok" --kubeconfig "$DIR/admin.kubeconfig" --config "$CACHE/kwok-stages.yaml" \
    --config "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/kwok-terminate.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --node-ip 127.0.0.1 --cidr 10.244.0.0/16 --server-address "127.0.0.1:$port"
  wait_healthy kwok "http://127.0.0.1:$port/healthz"
}

kubectl_() { "${KUBECTL:-kubectl}" --kubeconfig "$DIR/admin.kubeconfig" "$@"; }

cmd_up() {
  local nodes=4 kueue=0 real=0
  APISERVER_ARGS=() NODE_IMAGES=()
  DIR=${1:-}
  [[ -n "$DIR" ]] || die "usage: k8s.sh up DIR [--gpu-nodes N]"
  shift
  while [[ $# -gt 0 ]]; do
    case $1 in
      --gpu-nodes) nodes=${2:-}; shift 2 ;;
      --gpu-nodes=*) nodes=${1#*=}; shift ;;
      --kueue) kueue=1; shift ;;
      --nodes) real=${2:?--nodes takes a number of nodes}; shift 2 ;;
      --nodes=*) real=${1#*=}; shift ;;
      --node-image) NODE_IMAGES+=("${2:?--node-image takes an image}"); shift 2 ;;
      --node-image=*) NODE_IMAGES+=("${1#*=}"); shift ;;
      --apiserver-arg) APISERVER_ARGS+=("${2:?--apiserver-arg takes a flag}"); shift 2 ;;
      --apiserver-arg=*) APISERVER_ARGS+=("${1#*=}"); shift ;;
      *) die "unknown option $1 (usage: k8s.sh up DIR [--gpu-nodes N] [--kueue] [--nodes N])" ;;
    esac
  done
  [[ "$nodes" =~ ^[0-9]+$ ]] || die "--gpu-nodes takes a number of nodes, not '$nodes'"
  [[ "$real" =~ ^[0-9]+$ ]] || die "--nodes takes a number of nodes, not '$real'"
  built || die "no binaries in $BIN: run 'scripts/k8s.sh build' first"
  command -v "${KUBECTL:-kubectl}" >/dev/null || die "kubectl is not on PATH (set KUBECTL)"
  [[ -e "$DIR/pids" ]] && die "$DIR/pids exists: a plane runs there ('k8s.sh down $DIR')"
  mkdir -p "$DIR/logs" && DIR=$(cd "$DIR" && pwd)
  ((real == 0)) || nodes_apiserver_args
  : >"$DIR/pids"
  # Whatever fails before the end stops what was started.
  trap '[[ $? == 0 ]] || cmd_down "$DIR" >/dev/null 2>&1' EXIT
  API_PORT=$(free_port)
  make_pki
  kubeconfig admin admin
  kubeconfig controller-manager controller-manager
  kubeconfig scheduler scheduler
  start_etcd
  start_apiserver
  start_controllers
  start_kwok
  # --gpu-nodes 0: no kwok nodes (scripts/try-operator.sh brings real nodes instead).
  if ((nodes > 0)); then
    gpu_nodes "$nodes" | kubectl_ apply -f - >/dev/null
    # kwok readies a few tens of nodes a second here: the fleet's 1,000 jobs bring ~1,100 nodes,
    # which a fixed 60 s did not cover.
    kubectl_ wait --for=condition=Ready node --all --timeout=$((60 + nodes / 5))s >/dev/null
  fi
  # The default ServiceAccount (the ServiceAccount controller) is what pods of tests need.
  for _ in $(seq 300); do kubectl_ get sa default >/dev/null 2>&1 && break; sleep 0.2; done
  ((kueue == 0)) || kueue_up
  ((real == 0)) || nodes_up "$real"
  echo "k8s.sh: up in $DIR (KUBECONFIG=$DIR/admin.kubeconfig, $nodes GPU nodes, $real real nodes)"
}

# ------------------------------------------------------------------------------------ down

# name pid [name pid]...: SIGTERM to all at once, SIGKILL to any left after 2 s. The plane is
# thrown away (etcd, stopped last, keeps what try-operator's would start again from): nothing
# waits on a graceful drain, and kube-apiserver's took 4-12 s (10 s and a kill after an
# outage, tests/cluster/test_real_outage.py).
stop() {
  local name pid left=() alive
  while (($#)); do
    name=$1 pid=$2
    shift 2
    # A pid that no longer runs our binary (it ended, the pid was reused) is left alone.
    [[ "$(readlink "/proc/$pid/exe" 2>/dev/null)" == */"$name" ]] || continue
    kill -TERM "$pid" 2>/dev/null && left+=("$pid") && echo "k8s.sh: stopping $name ($pid)"
  done
  for _ in $(seq 20); do
    alive=()
    for pid in "${left[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    ((${#alive[@]})) || return 0
    left=("${alive[@]}")
    sleep 0.1
  done
  for pid in "${left[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

cmd_down() {
  local dir=${1:-} name pid d
  [[ -n "$dir" ]] || die "usage: k8s.sh down DIR"
  [[ -f "$dir/pids" ]] || { echo "k8s.sh: nothing runs in $dir"; return 0; }
  dir=$(cd "$dir" && pwd)
  # Real nodes: the kubelets first (they would restart what goes), then every container while
  # its containerd still runs.
  # shellcheck disable=SC2046  # name-pid pairs, one word each
  stop $(awk '$1 == "kubelet"' "$dir/pids")
  for d in "$dir"/nodes/*/; do [[ -d "$d" ]] && nodes_clear "${d%/}"; done
  # Clients first, etcd last (an API server without etcd waits out its grace), each wave at
  # once: one after another, their graceful shutdowns (1-3 s each) took ~10 s a plane.
  # shellcheck disable=SC2046
  stop $(awk '$1 != "etcd" && $1 != "kubelet"' "$dir/pids")
  # shellcheck disable=SC2046
  stop $(awk '$1 == "etcd"' "$dir/pids")
  nodes_down_rest "$dir"
  kueue_net_down "$dir"
  rm -f "$dir/pids"
}

case ${1:-} in
  build)
    cmd_build
    for opt in "${@:2}"; do
      case $opt in
        --kueue) kueue_build ;;
        --nodes) nodes_build ;;
        *) die "unknown option $opt (usage: k8s.sh build [--kueue] [--nodes])" ;;
      esac
    done ;;
  bin) echo "$BIN" ;;
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down "$@" ;;
  *) die "usage: k8s.sh build [--kueue] [--nodes] | up DIR [--gpu-nodes N] [--kueue]" \
    "[--nodes N [--node-image REF]...] | down DIR | bin" ;;
esac
