#!/usr/bin/env bash
# The first-contact run on a lent GPU machine (no package registry there), from the repo root:
#
#   bash bench/gpu_kit/run.sh [quick|full|all] [--dry-run]
#
#   quick  environment, the trainer's CUDA tests (tests/gpu), python -m bench --suite gpu --quick
#   full   environment, the full GPU suite (python -m bench --suite gpu)
#   all    (default) both, in that order, as far as the time budget goes: slow parts last
#
# It installs the wheels in .whl/ (python -m bench.gpu_kit.gather, here; carried with the call)
# offline into /tmp/site, then runs each step with its own time limit; a step that fails or
# times out does not stop the next. Every step's output goes to the terminal and to a file in
# $OUT (./gpu-out when OUT is unset), with a line per step in summary.txt. KIT_BUDGET_S (default
# 560) bounds the whole run: a device call may take at most 600 s. See bench/README.md.
set -u -o pipefail

mode=all dry=
for arg in "$@"; do
  case $arg in
    quick | full | all) mode=$arg ;;
    --dry-run) dry=1 ;;
    *) echo "usage: bash bench/gpu_kit/run.sh [quick|full|all] [--dry-run]" >&2; exit 2 ;;
  esac
done
out=${OUT:-$PWD/gpu-out}
py=${PYTHON:-python3}
budget=${KIT_BUDGET_S:-560}
work=${KIT_WORKDIR:-/tmp/ftjob-bench}  # the 1B model is built once for both bench steps
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
start=$SECONDS
spent=0  # a dry run counts each step as taking its whole limit

# step NAME CAP_SECONDS COMMAND...: at most CAP seconds and never past the budget; output
# tee'd to $out/NAME.log; the outcome appended to summary.txt.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((budget - (SECONDS - start) - spent - 10))
  local limit=$((cap < left ? cap : left))
  if ((limit < 30)); then
    local again=quick
    [[ $name == bench-full ]] && again=full
    echo "$name: not run, $((left + 10))s of the ${budget}s budget left; run it in a call of" \
      "its own: bash bench/gpu_kit/run.sh $again" | tee -a "$summary"
    return
  fi
  echo "== $name (at most ${limit}s): $*"
  if [[ -n $dry ]]; then
    echo "$name: dry run, limit ${limit}s, log $out/$name.log" | tee -a "$summary"
    spent=$((spent + limit))
    return
  fi
  local t0=$SECONDS rc
  # timeout signals the step's whole process group (trainer ranks, torchrun) when it expires.
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  local verdict="ok"
  if ((rc == 124 || rc == 137)); then
    verdict="TIMED OUT after ${limit}s"
  elif ((rc != 0)); then
    verdict="failed (exit $rc)"
  fi
  echo "$name: $verdict in $((SECONDS - t0))s" | tee -a "$summary"
}

# Offline install of the carried wheels; the checkout itself is on the path (ftjob, bench).
site=${KIT_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ -n $dry ]]; then
  echo "install: dry run, .whl/*.whl into $site" | tee -a "$summary"
elif ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "install: no .whl/ here (python -m bench.gpu_kit.gather, then carry .whl):" \
    "the image's packages only" | tee -a "$summary"
elif timeout -k 10 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .whl/*.whl >"$out/install.log" 2>&1; then
  export PYTHONPATH=$site:$PYTHONPATH
  echo "install: $(ls .whl/*.whl | wc -l) wheels into $site" | tee -a "$summary"
else
  # A partial install would mix versions: run on the image's packages and say so.
  tail -5 "$out/install.log" | tee -a "$summary"
  echo "install: FAILED (above): the image's packages only" | tee -a "$summary"
fi
rm -f "$out/install.log"

# nvidia-smi, versions and where each package comes from, probes (bench/gpu_kit/env.py).
step env 90 bash -c 'nvidia-smi || echo "nvidia-smi: not found"; "$0" -m bench.gpu_kit.env;
  echo "pip check (the image with the carried wheels):"; "$0" -m pip check' "$py"
if [[ $mode != full ]]; then
  step gpu-tests 210 "$py" -m pytest tests/gpu -x -q -rA -p no:cacheprovider
  step bench-quick 420 "$py" -m bench --suite gpu --quick --workdir "$work" \
    --json "$out/bench-quick.json" --no-results-md
fi
if [[ $mode != quick ]]; then
  step bench-full 540 "$py" -m bench --suite gpu --workdir "$work" \
    --json "$out/bench-full.json" --no-results-md
fi
echo "run.sh $mode: $((SECONDS - start))s; output in $out" | tee -a "$summary"
