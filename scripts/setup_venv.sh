#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the pinned requirements and this package installed in editable
# mode (setup.py compiles the CUDA extension when nvcc is found). Idempotent: reinstalls only when
# requirements.txt, setup.py or csrc/ changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    PYENV_VERSION="${PYENV_VERSION:-3.12.1}" python3.12 -m venv .venv
fi

stamp=.venv/.installed-from
wanted="$(find requirements.txt setup.py csrc -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/python -m pip install --quiet -r requirements.txt
    .venv/bin/python -m pip install --quiet --no-build-isolation -e .
    echo "$wanted" > "$stamp"
fi
