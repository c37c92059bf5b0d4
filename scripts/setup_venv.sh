#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the pinned requirements and this package installed in editable
# mode. The CUDA library is compiled where a GPU is visible, or with NCCL_EP_BUILD_EXT=1 (CI).
# Idempotent: reinstalls only when requirements.txt, setup.py, csrc/ or NCCL_EP_BUILD_EXT changed
# since the last successful run. First run: ~3 min and ~5.5 GB (torch and its CUDA libraries),
# plus ~1 min for the CUDA compile when it happens.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
step() { echo "setup_venv: [$((SECONDS - start)) s] $*"; }

if [ ! -x .venv/bin/python ]; then
    step "creating .venv (Python ${PYENV_VERSION:-3.12.1})"
    PYENV_VERSION="${PYENV_VERSION:-3.12.1}" python3.12 -m venv .venv
fi

stamp=.venv/.installed-from
wanted="$( (find requirements.txt setup.py csrc -type f -print0 | sort -z | xargs -0 sha256sum
            echo "NCCL_EP_BUILD_EXT=${NCCL_EP_BUILD_EXT:-auto}") | sha256sum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    step "installing requirements.txt (first time ~3 min, ~5.5 GB)"
    .venv/bin/python -m pip install --quiet -r requirements.txt
    step "installing megatron_nccl_ep (NCCL_EP_BUILD_EXT=${NCCL_EP_BUILD_EXT:-auto}: the CUDA library compiles where a GPU is visible or with 1, ~1 min)"
    .venv/bin/python -m pip install --quiet --no-build-isolation -e .
    echo "$wanted" > "$stamp"
    step "done"
else
    step ".venv is up to date"
fi
