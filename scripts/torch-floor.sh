#!/usr/bin/env bash
# The GPU image's torch on CPU: prints the path of a venv with torch $TORCH_FLOOR (the registry's
# build, which runs on CPU) and the project's other pins, creating it on first use.
#
#   venv=$(bash scripts/torch-floor.sh)      # progress on stderr, the venv's path on stdout
#
# The venv lies in a cache folder outside the checkout (FTJOB_ENV_CACHE, default
# ~/.cache/ftjob-envs), named by a hash of what it is built from (the torch pin, constraints.txt
# without its torch line, the packages installed, the python version), so a second CI run on one
# machine reuses it and a changed pin builds a new one. The project itself is not installed:
# tests put the checkout on PYTHONPATH (tests/e2e/test_torch_floor.py).
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${TORCH_FLOOR:-2.11.0}  # the GPU image's torch (docs/gpu.md)
python=${PYTHON:-python3}
cache=${FTJOB_ENV_CACHE:-$HOME/.cache/ftjob-envs}
# What the trainer with QLoRA's torchao (as the GPU image has them), the bench baseline
# (TRL + accelerate) and the tests import.
packages=$("$python" - <<'PY'
import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
keep = extras["trainer"] + extras["qlora"] + extras["bench"]
keep += ["pyyaml", "jsonschema", "common-expression-language", "pytest", "pytest-timeout"]
print(" ".join(sorted(set(keep))))
PY
)
key=$({ echo "torch==$torch"; grep -v '^torch==' constraints.txt; echo "$packages";
  "$python" -V; } | sha256sum | cut -c1-16)
venv=$cache/torch-$torch-$key
if [[ -x $venv/bin/python && -f $venv/.complete ]]; then
  echo "torch-floor: reusing $venv" >&2
  echo "$venv"
  exit 0
fi
echo "torch-floor: building $venv (torch==$torch; the first build downloads ~3 GB)" >&2
rm -rf "$venv"
mkdir -p "$cache"
start=$SECONDS
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
grep -v '^torch==' constraints.txt >"$constraints"
"$python" -m venv "$venv"
# torch pinned in the same install: alone, the constraints without it would upgrade torch.
# shellcheck disable=SC2086
"$venv/bin/pip" install -q -c "$constraints" "torch==$torch" $packages >&2
touch "$venv/.complete"
# Venvs of older pins (5 GB each) go: this script made every torch-* folder in its cache.
for old in "$cache"/torch-*; do
  [[ $old == "$venv" ]] || rm -rf "$old"
done
echo "torch-floor: built in $((SECONDS - start)) s" >&2
echo "$venv"
