#!/usr/bin/env bash
# ftjob's operator on one machine, no cluster needed (docs/try-the-operator.md):
#
#   scripts/try-operator.sh up DIR      the images (scripts/images.sh), a real control plane with
#                                       two real nodes (scripts/k8s.sh --nodes 2: kubelet,
#                                       containerd holding the trainer image, CNI, CoreDNS; no
#                                       fake GPU nodes), the chart's manifests, a volume holding
#                                       the tiny example's model and data, and the operator;
#                                       prints the KUBECONFIG to export
#   scripts/try-operator.sh down DIR    stops the operator, then the plane and its nodes (their
#                                       containers, mounts, bridges, cgroups, imported images)
#
# Needs root, podman and containerd (scripts/podman-host.sh), Go for the first plane build, a
# Python with ftjob installed (pip install -e '.[test]'; PYTHON=... picks it; kubectl beside it
# or on PATH), and ~14 GB of disk: one unpacked copy of the ~6 GB trainer image that both nodes'
# containerds share (hard links), and the archive's layers beside it while node 0 imports it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
TAG=${FTJOB_IMAGE_TAG:-dev}
export KUBECTL=${KUBECTL:-$(command -v "$(dirname "$PYTHON")/kubectl" || command -v kubectl)}

die() { echo "try-operator: $*" >&2; exit 1; }

# The claim examples/tiny.yaml names, bound to a hostPath volume: the folder DIR/volume.
claim() {
  cat <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: ftjob-shared-default}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteMany]
  storageClassName: manual
  hostPath: {path: $1}
  claimRef: {namespace: default, name: ftjob-shared}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: ftjob-shared, namespace: default}
spec:
  accessModes: [ReadWriteMany]
  storageClassName: manual
  resources: {requests: {storage: 1Gi}}
EOF
}

# background NAME ARGV...: a process of ours, its pid in DIR/try.pids, output in DIR/logs.
background() {
  local name=$1
  shift
  setsid "$@" </dev/null >"$DIR/logs/$name.log" 2>&1 &
  echo "$name $!" >>"$DIR/try.pids"
}

cmd_up() {
  [[ -e "$DIR/try.pids" ]] && die "$DIR/try.pids exists: 'try-operator.sh down $DIR' first"
  bash "$ROOT/scripts/k8s.sh" build --nodes
  FTJOB_IMAGE_TAG=$TAG PYTHON=$PYTHON bash "$ROOT/scripts/images.sh"
  # The nodes' containerds get the trainer image (the operator runs as a process here).
  bash "$ROOT/scripts/k8s.sh" up "$DIR" --gpu-nodes 0 --nodes 2 \
    --node-image "localhost/ftjob-trainer:$TAG"
  export KUBECONFIG=$DIR/admin.kubeconfig
  "$KUBECTL" apply --server-side -f "$ROOT/manifests/install.yaml" >/dev/null
  "$KUBECTL" wait --for=condition=Established --timeout=60s crd/finetunejobs.ftjob.dev >/dev/null
  # The pods run as uid 1000; a kubelet does not chown a hostPath volume for them.
  mkdir -p "$DIR/volume"
  cp -r "$ROOT/examples/tiny-model" "$ROOT/examples/data" "$DIR/volume/"
  chown -R 1000:1000 "$DIR/volume"
  claim "$DIR/volume" | "$KUBECTL" apply -f - >/dev/null
  background operator "$PYTHON" -m ftjob operator --all-namespaces \
    --default-image "localhost/ftjob-trainer:$TAG"
  echo "try-operator: up. export KUBECONFIG=$KUBECONFIG"
  echo "  kubectl apply -f examples/tiny.yaml && kubectl get ftj -w"
}

cmd_down() {
  local name pid
  if [[ -f "$DIR/try.pids" ]]; then
    # The operator (SIGTERM: it ends its watches); k8s.sh down then stops the nodes.
    tac "$DIR/try.pids" | while read -r name pid; do
      kill -TERM "$pid" 2>/dev/null || continue
      for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      echo "try-operator: stopped $name ($pid)"
    done
    rm -f "$DIR/try.pids"
  fi
  bash "$ROOT/scripts/k8s.sh" down "$DIR"
}

DIR=${2:-}
[[ -n "$DIR" ]] || die "usage: try-operator.sh up DIR | down DIR"
mkdir -p "$DIR/logs" && DIR=$(cd "$DIR" && pwd)
case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  *) die "usage: try-operator.sh up DIR | down DIR" ;;
esac
