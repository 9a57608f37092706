#!/usr/bin/env bash
# Build ftjob's two images from the Dockerfile, as it is, with podman:
#
#   bash scripts/images.sh                         # localhost/ftjob-operator:dev, localhost/ftjob-trainer:dev
#   FTJOB_IMAGE_TAG=0.1.0 bash scripts/images.sh   # another tag
#
# Only the bases may differ from a release build. Each base is the Dockerfile's default
# (ARG PYTHON_IMAGE, ARG TRAINER_IMAGE) when podman has it locally (`podman pull` it first
# where a registry can be reached); otherwise a stand-in, made here once and kept:
#   python:  a Debian bookworm root filesystem (debootstrap --variant=minbase) with Debian's
#            Python 3.11, pip and venv, a `python` link, and where this machine's pip gets packages from;
#   trainer: that + torch at constraints.txt's pin, as pip resolves it here (where pip is set
#            up with a CPU wheel, the CPU build, else the registry's CUDA build).
# The last lines say which bases stood in. Needs podman and debootstrap (scripts/podman-host.sh)
# and root (debootstrap; rootful podman storage).
#
# pip inside every build step uses where this machine's pip gets packages from (`pip config
# list`: indexes, find-links, trusted hosts, proxy, CA file) and nothing else of its settings
# (a constraint file is this machine's own): scripts/pip_forward.py says which. The local
# folders they name are mounted read-only into the steps, the CA file is copied into the
# stand-in, so the images install the same packages the tests here use.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TAG=${FTJOB_IMAGE_TAG:-dev}
OPERATOR=localhost/ftjob-operator:$TAG
TRAINER=localhost/ftjob-trainer:$TAG
TORCH=$(sed -n 's/^torch==//p' constraints.txt)
PY_REAL=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
TR_REAL=$(sed -n 's/^ARG TRAINER_IMAGE=//p' Dockerfile)
PY_STANDIN=localhost/ftjob-standin/python:3.11-bookworm
TR_STANDIN=localhost/ftjob-standin/pytorch:$TORCH-cpu
: "${TORCH:?constraints.txt pins no torch}" "${PY_REAL:?}" "${TR_REAL:?}"

work=$(mktemp -d /var/tmp/ftjob-images.XXXXXX)
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
say() { echo "images: [$(($(date +%s) - t0)) s] $*"; }

# Where this machine's pip gets packages from, as a pip.conf, with the local folders it names
# (mounted into each build step) and the certificates (copied into the stand-in base):
# scripts/pip_forward.py, which says what it leaves out.
"$PYTHON" scripts/pip_forward.py "$work"
mounts=()
while read -r dir; do
  [ -n "$dir" ] && mounts+=(-v "$dir:$dir:ro")
done <"$work/mounts"

have() { podman image exists "$1"; }

make_python_standin() {
  say "making $PY_STANDIN: debootstrap bookworm (minbase + python3, pip, venv)"
  local root=$work/rootfs
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
    || { tail -30 "$work/debootstrap.log"; exit 1; }
  ln -sf python3 "$root/usr/bin/python"
  # The image's pip installs into the system Python, as in python:*-slim (no PEP 668 guard).
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  cp "$work/pip.conf" "$root/etc/pip.conf"
  while read -r file; do
    [ -n "$file" ] || continue
    mkdir -p "$root$(dirname "$file")"
    cp "$file" "$root$file"
  done <"$work/files"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$PY_STANDIN" >/dev/null
}

make_trainer_standin() {
  say "making $TR_STANDIN: $PY_STANDIN + torch==$TORCH"
  printf 'FROM %s\nRUN pip install --no-cache-dir torch==%s && python -c "import torch"\n' \
    "$PY_STANDIN" "$TORCH" >"$work/Containerfile.torch"
  podman build --isolation chroot --network host --pull=never "${mounts[@]}" \
    -f "$work/Containerfile.torch" -t "$TR_STANDIN" "$work" >"$work/torch.log" 2>&1 \
    || { tail -30 "$work/torch.log"; exit 1; }
}

py_base=$PY_REAL
tr_base=$TR_REAL
if ! have "$PY_REAL"; then
  py_base=$PY_STANDIN
  have "$PY_STANDIN" && say "$PY_STANDIN: kept from an earlier run" || make_python_standin
fi
if ! have "$TR_REAL"; then
  tr_base=$TR_STANDIN
  if have "$TR_STANDIN"; then
    say "$TR_STANDIN: kept from an earlier run"
  else
    have "$PY_STANDIN" || make_python_standin
    make_trainer_standin
  fi
fi

build() {  # target tag base-arg
  local before
  before=$(podman image inspect --format '{{.Id}}' "$2" 2>/dev/null || true)
  say "building target $1 -> $2"
  podman build --isolation chroot --network host --pull=never "${mounts[@]}" \
    --target "$1" --build-arg "$3" -t "$2" . >"$work/$1.log" 2>&1 \
    || { tail -40 "$work/$1.log"; exit 1; }
  # The image the tag named before, untagged now: every build of changed code left one behind
  # (~1 GB for the trainer's top layers), until a machine's disk was full.
  if [[ -n "$before" && "$before" != "$(podman image inspect --format '{{.Id}}' "$2")" ]]; then
    podman rmi "$before" >/dev/null 2>&1 || true
  fi
}
build operator "$OPERATOR" "PYTHON_IMAGE=$py_base"
build trainer "$TRAINER" "TRAINER_IMAGE=$tr_base"

say "done"
for pair in "operator|$OPERATOR|PYTHON_IMAGE|$PY_REAL|$py_base" \
            "trainer|$TRAINER|TRAINER_IMAGE|$TR_REAL|$tr_base"; do
  IFS='|' read -r target image arg real used <<<"$pair"
  size=$(podman image inspect --format '{{.Size}}' "$image")
  if [ "$used" = "$real" ]; then
    echo "images: $image ($target, $((size / 1000000)) MB): base $real (the Dockerfile's default)"
  else
    echo "images: $image ($target, $((size / 1000000)) MB): base $used STOOD IN for $arg=$real"
  fi
done
