#!/usr/bin/env bash
# The test venv, .venv, with the project installed editable and what its extras pin:
#
#   bash scripts/venv.sh            # extras operator,trainer,test (the README's test command)
#
# A checkout with no .venv gets a link to a venv in a cache folder outside it (FTJOB_ENV_CACHE,
# default ~/.cache/ftjob-envs, beside scripts/torch-floor.sh's), named by a hash of what its
# packages come from (constraints.txt, the extras' requirements, the python version): a second
# clean clone on one machine (every CI run) reuses torch, transformers & co instead of
# installing ~6 GB again (~90 s of a warm CI run), and a changed pin builds a new one. The
# project itself is installed (editable, from this checkout) every time, with whatever a
# requirement edited since needs. A checkout that has a .venv of its own (the README's first
# command makes one) keeps it. One checkout at a time uses a cached venv: its editable install
# points at the checkout that ran this last.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=operator,trainer,test
python=${PYTHON:-python3}
if [[ ! -e .venv ]]; then
  cache=${FTJOB_ENV_CACHE:-$HOME/.cache/ftjob-envs}
  wanted=$("$python" - "$extras" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print(sorted(project["dependencies"] + [r for e in sys.argv[1].split(",") for r in extras[e]]))
PY
)
  key=$({ cat constraints.txt; echo "$wanted"; "$python" -V; } | sha256sum | cut -c1-16)
  venv=$cache/test-$key
  if [[ ! -x $venv/bin/python || ! -f $venv/.complete ]]; then
    echo "venv: building $venv (the first build downloads ~3 GB)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$python" -m venv "$venv"
  fi
  ln -s "$venv" .venv
fi
.venv/bin/pip install -q --no-compile -c constraints.txt -e ".[$extras]"
if [[ -L .venv ]]; then
  venv=$(readlink .venv)
  touch "$venv/.complete"
  # Venvs of older pins (~6 GB each) go: this script made every test-* folder in its cache.
  for old in "$(dirname "$venv")"/test-*; do
    [[ $old == "$venv" ]] || rm -rf "$old"
  done
fi
