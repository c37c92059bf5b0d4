#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the pinned requirements and this package installed in editable
# mode. The CUDA library is compiled wherever nvcc, the CUDA toolkit and the NCCL headers are
# found (no GPU needed to compile); NCCL_EP_BUILD_EXT=1 makes a failed build fail the setup (CI),
# 0 never compiles. The last line says whether the library was built and, if not, why and how to
# build it (megatron_nccl_ep/build_info.py).
# Idempotent: reinstalls only when requirements.txt, setup.py, csrc/, or what decides the build
# (the nvcc found, NCCL_EP_BUILD_EXT, CUDA_HOME, the NCCL and arch knobs) changed since the last
# successful run, or setup's record of the build is gone. First run: ~3 min and ~5.5 GB (torch
# and its CUDA libraries), plus the CUDA compile when it happens (about a minute and a half on 2
# cores).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
step() { echo "setup_venv: [$((SECONDS - start)) s] $*"; }

if [ ! -x .venv/bin/python ]; then
    step "creating .venv (Python ${PYENV_VERSION:-3.12.1})"
    PYENV_VERSION="${PYENV_VERSION:-3.12.1}" python3.12 -m venv .venv
fi

# The nvcc setup.py will use (its _nvcc: CUDA_HOME or CUDA_PATH first, then PATH), resolved.
nvcc=none
for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$home" ] && [ -e "$home/bin/nvcc" ]; then nvcc=$home/bin/nvcc; break; fi
done
if [ "$nvcc" = none ]; then nvcc=$(command -v nvcc || echo none); fi
nvcc_build=none  # its release line: a toolkit upgraded behind the same path rebuilds too
if [ "$nvcc" != none ]; then
    nvcc_build=$("$nvcc" --version 2>/dev/null | tail -n 1 || echo unknown)
    if [ "$(readlink -f "$nvcc")" != "$nvcc" ]; then nvcc="$nvcc -> $(readlink -f "$nvcc")"; fi
fi

stamp=.venv/.installed-from
wanted="$( (find requirements.txt setup.py csrc -type f -print0 | sort -z | xargs -0 sha256sum
            echo "nvcc=$nvcc ($nvcc_build)"
            for knob in NCCL_EP_BUILD_EXT CUDA_HOME CUDA_PATH NCCL_INCLUDE_DIR NCCL_LIB_DIR \
                        NCCL_EP_CUDA_ARCHS NCCL_EP_TRACE NCCL_EP_WERROR; do
                echo "$knob=${!knob:-}"
            done) | sha256sum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] ||
        [ ! -e megatron_nccl_ep/_build_status.json ]; then
    step "installing requirements.txt (first time ~3 min, ~5.5 GB)"
    .venv/bin/python -m pip install --quiet -r requirements.txt
    step "installing megatron_nccl_ep (NCCL_EP_BUILD_EXT=${NCCL_EP_BUILD_EXT:-auto}," \
         "nvcc: ${nvcc}; the CUDA compile, when it happens: ~1.5 min on 2 cores)"
    .venv/bin/python -m pip install --quiet --no-build-isolation -e .
    echo "$wanted" > "$stamp"
    step "done"
else
    step ".venv is up to date"
fi
step "$(.venv/bin/python -m megatron_nccl_ep.build_info)"
