#!/usr/bin/env bash
# The call on a lent GPU machine (no package registry there), from the repo root:
#
#   bash bench/gpu_kit/run.sh [CALL|STEP ...] [rehearse] [--dry-run]
#
#   main      (default) the one call, most valuable first: env, then profile (ftjob's default
#             job under torch.profiler: the device's busy fraction, longest kernels, host
#             syncs), then versus-trl (the default job's tokens/s and peak, TRL at its defaults,
#             TRL with the same settings). Run it with the device's timeout_s=420; KIT_BUDGET_S
#             (default 360) bounds it inside that, so what it measured comes back.
#   rest      a second call, only when 6 minutes of device time are left: env, compile-3b
#             (compiled peak at a second size against the plan), offload (QLoRA + cpuOffload),
#             ckpt-stall (asyncSave), lora-8b (Llama-3-8B-shaped LoRA at seq 4096).
#   tests     a call only when time is left after both: env, tests/gpu, memory (LoRA, QLoRA),
#             ddp (the 1B LoRA replicated as DDP, then fully sharded: on a machine of 2+ GPUs).
#   grpo      grpo-sampling: GRPO's sampling engine on the 1B model, its tokens/s and share of
#             the device's peak against the share the planner assumes (issue 75).
#   fp8       a call of its own (issue 58): env, fp8-1b (the 1B full fine-tune) and fp8-8b
#             (8B-shaped LoRA, seq 4096), each bf16 then fp8, compiled: tokens/s, peak, losses.
#   STEP      any one step of the calls above by its name (profile, lora-8b, fp8-8b, ...).
#             Several calls and steps make one call, env once, in the order given, under one
#             budget: `KIT_BUDGET_S=540 bash bench/gpu_kit/run.sh main fp8-8b compile-3b` is the
#             one long call a lease with no room for a second gets.
#   rehearse  the chosen call on CPU with tiny sizes: the same install, steps, caps and files.
#             The image's role is played by PYTHON (python -m bench.gpu_kit.rehearse uses the
#             torch 2.11 venv of scripts/torch-floor.sh), the wheels come from KIT_WHEELS.
#
# It installs the wheels in KIT_WHEELS (default .whl/, from python -m bench.gpu_kit.gather,
# carried with the call) offline into a fresh folder, then runs each step with its own limit;
# a step that fails or times out does not stop the next, and after each its leftover processes
# are ended by pid (bench/gpu_kit/reap.py). $OUT gets four files: summary.txt (a line per
# step), results.jsonl (each figure the moment it exists: bench/gpu_kit/steps.py),
# profile.json (profile) and steps.log (every step's output as it comes, each after a line
# "== NAME"). See bench/README.md and docs/gpu.md.
set -u -o pipefail

# Each step's limit in seconds on the device, and each call's steps in order.
declare -A CAP=([profile]=90 [versus-trl]=190 [compile-3b]=80 [offload]=60 [ckpt-stall]=60
  [lora-8b]=90 [gpu-tests]=120 [memory]=90 [ddp]=80 [grpo-sampling]=60 [context]=50
  [fp8-1b]=120 [fp8-8b]=170)
declare -A CALL=([main]="profile versus-trl" [rest]="compile-3b offload ckpt-stall lora-8b"
  [tests]="gpu-tests memory ddp" [fp8]="fp8-1b fp8-8b" [long]="context"
  [grpo]="grpo-sampling")
usage="usage: bash bench/gpu_kit/run.sh [main|rest|tests|fp8|long|grpo|STEP ...] [rehearse] [--dry-run]"
names=() steps=() dry= rehearse=
for arg in "$@"; do
  if [[ -n ${CALL[$arg]:-} ]]; then
    names+=("$arg") && read -ra more <<<"${CALL[$arg]}" && steps+=("${more[@]}")
  elif [[ -n ${CAP[$arg]:-} ]]; then
    names+=("$arg") && steps+=("$arg")
  elif [[ $arg == rehearse ]]; then
    rehearse=1
  elif [[ $arg == --dry-run ]]; then
    dry=1
  else
    echo "$usage" >&2 && exit 2
  fi
done
((${#names[@]})) || { names=(main) && read -ra steps <<<"${CALL[main]}"; }
out=${OUT:-$PWD/gpu-out}
py=${PYTHON:-python3}
# KIT_CAP_SCALE multiplies each step's cap and the budget: a rehearsal on a CPU machine that
# other work shares is given the test suite's margin (tests/hangs.py's SLOWER), where the
# device's own caps would call an honest but slowed step hung. The plan stays the same.
scale=${KIT_CAP_SCALE:-1}
budget=$((${KIT_BUDGET_S:-360} * scale))
wheels=${KIT_WHEELS:-.whl}
sizes=gpu
# tmpfs where there is one: the 1B model and its exports are written and read at memory speed.
work=${KIT_WORKDIR:-$( [[ -d /dev/shm && -w /dev/shm ]] && echo /dev/shm/ftjob-kit || echo /tmp/ftjob-kit)}
if [[ -n $rehearse ]]; then
  sizes=tiny
  export CUDA_VISIBLE_DEVICES=""  # as if the GPU were absent: the CPU paths, the same steps
  # torch.compile traces and differentiates the layers as there, without inductor's C++ build
  # (minutes on 2 CPU cores; the GPU runs Triton instead): torch's own backend override.
  export TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager"
fi
mkdir -p "$out" "$work"
summary=$out/summary.txt log=$out/steps.log
: >"$summary"
: >"$log"
start=$SECONDS
spent=0  # a dry run counts each step as taking its whole limit

# Nothing waits on a network: there is none on the device.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
  DO_NOT_TRACK=1 WANDB_MODE=disabled DISABLE_MLFLOW_INTEGRATION=TRUE PIP_NO_INDEX=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 FTJOB_PROGRESS_PORT=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# step NAME CAP_SECONDS COMMAND...: at most CAP seconds and never past the budget; output
# appended to $out/steps.log as it comes, after a line "== NAME"; the outcome appended to
# summary.txt; leftovers reaped. One log for every step: a device call returns at most 8
# files, and a call of several calls' steps once lost its results.jsonl to that count.
step() {
  local name=$1 cap=$(($2 * scale))
  shift 2
  # A dry run counts each step as its whole limit (spent) and not the clock: its plan is the
  # same however busy the machine that prints it.
  local elapsed=$((SECONDS - start))
  [[ -z $dry ]] || elapsed=0
  local left=$((budget - elapsed - spent - 10 * scale))
  local limit=$((cap < left ? cap : left))
  if ((limit < 20)); then
    # The step by itself is the call that runs it later.
    echo "$name: not run, $((left + 10 * scale))s of the ${budget}s budget left; it runs again in:" \
      "bash bench/gpu_kit/run.sh $name" | tee -a "$summary"
    return
  fi
  echo "== $name (at most ${limit}s): $*"
  if [[ -n $dry ]]; then
    echo "$name: dry run, limit ${limit}s, log $log" | tee -a "$summary"
    spent=$((spent + limit))
    return
  fi
  local t0=$SECONDS rc tag="$name-$$-$RANDOM"
  # timeout signals the step's process group; reap.py ends what escaped it (own sessions).
  echo "== $name" >>"$log"
  KIT_STEP=$tag timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  "$py" -m bench.gpu_kit.reap "$tag" | tee -a "$log"
  local verdict="ok"
  if ((rc == 124 || rc == 137)); then
    verdict="TIMED OUT after ${limit}s"
  elif ((rc != 0)); then
    verdict="failed (exit $rc)"
  fi
  echo "$name: $verdict in $((SECONDS - t0))s" | tee -a "$summary"
}

# Offline install of the carried wheels into a fresh folder on the path, the checkout before
# it (ftjob, bench). --no-deps: the image (or PYTHON's venv) has the rest.
site=${KIT_SITE:-$work/site}
if [[ -n $dry ]]; then
  echo "install: dry run, $wheels/*.whl into $site" | tee -a "$summary"
elif ! compgen -G "$wheels/*.whl" >/dev/null; then
  echo "install: no wheels in $wheels (python -m bench.gpu_kit.gather, then carry .whl):" \
    "the image's packages only" | tee -a "$summary"
else
  rm -rf "$site"
  t0=$SECONDS
  if timeout -k 10 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$wheels"/*.whl >"$work/install.log" 2>&1; then
    export PYTHONPATH=$PWD:$site${PYTHONPATH#"$PWD"}
    echo "install: $(ls "$wheels"/*.whl | wc -l) wheels into $site in $((SECONDS - t0))s" \
      | tee -a "$summary"
  else
    # A partial install would mix versions: run on the image's packages and say so.
    tail -5 "$work/install.log" | tee -a "$summary"
    echo "install: FAILED (above): the image's packages only" | tee -a "$summary"
  fi
fi

# nvidia-smi, versions and where each package comes from, the attention kernels that run.
step env 60 bash -c 'nvidia-smi || echo "nvidia-smi: not found"; "$0" -m bench.gpu_kit.env \
  --out "$1"; echo "pip check (the image with the carried wheels):"; "$0" -m pip check' \
  "$py" "$out"
# A call's caps sum to its budget less the 10 s kept back: every step gets its whole cap, and
# what does not fit goes to the next call, not to the end of this one.
for name in "${steps[@]}"; do
  if [[ $name == gpu-tests ]]; then  # no -x: every test runs, each at most 60 s, as it ends
    step gpu-tests "${CAP[$name]}" "$py" -m pytest tests/gpu -v -rA -p no:cacheprovider --timeout 60
  else
    step "$name" "${CAP[$name]}" "$py" -m bench.gpu_kit.steps "$name" --out "$out" \
      --work "$work" --sizes "$sizes"
  fi
done
echo "run.sh ${names[*]}: $((SECONDS - start))s; output in $out" | tee -a "$summary"
