#!/usr/bin/env bash
# Builds the C example against the library that `pip install -e .` / `setup.py build_ext
# --inplace` put into megatron_nccl_ep/ (libmegatron_nccl_ep.so), NCCL from torch's nvidia-nccl
# wheel and the CUDA toolkit's static runtime:
#   examples/c_api/build.sh [output binary]   (env: PYTHON, default .venv/bin/python; CUDA_HOME)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$here/dispatch_combine}
lib=$root/megatron_nccl_ep
if [ ! -e "$lib/libmegatron_nccl_ep.so" ]; then
    echo "build.sh: $lib/libmegatron_nccl_ep.so is missing; build it with scripts/setup_venv.sh" \
         "(its last line says why it was not built)" >&2
    exit 1
fi
python=${PYTHON:-$root/.venv/bin/python}  # the python whose site-packages has the NCCL wheel
nccl=$("$python" -c '
import glob, os, nvidia
print(next(p for b in nvidia.__path__ for p in glob.glob(os.path.join(b, "nccl"))
           if os.path.exists(os.path.join(p, "include", "nccl.h"))))')
# The toolkit root, found as setup.py finds it: CUDA_HOME / CUDA_PATH, the root of the nvcc on
# PATH (which may be a wrapper script), /usr/local/cuda.
cuda=
for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}" \
         "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" \
         /usr/local/cuda; do
    if [ -n "$c" ] && [ -e "$c/include/cuda_runtime.h" ]; then cuda=$c; break; fi
done
if [ -z "$cuda" ]; then
    echo "build.sh: no CUDA toolkit found (include/cuda_runtime.h): set CUDA_HOME" >&2
    exit 1
fi
cudart=$(dirname "$(find "$cuda/" -name libcudart_static.a -print -quit)")
cc -std=c11 -O2 -Wall -Wextra -Werror "$here/dispatch_combine.c" -o "$out" \
    -I"$root/csrc/include" -I"$nccl/include" -I"$cuda/include" \
    -L"$lib" -l:libmegatron_nccl_ep.so -Wl,-rpath,"$lib" \
    -L"$nccl/lib" -l:libnccl.so.2 -Wl,-rpath,"$nccl/lib" \
    -L"$cudart" -lcudart_static -ldl -lrt -lpthread
echo "built $out"
