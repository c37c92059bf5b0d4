#!/usr/bin/env bash
# Builds the C example against the library that `pip install -e .` / `setup.py build_ext
# --inplace` put into megatron_nccl_ep/ (libnccl_ep.so), NCCL from torch's nvidia-nccl wheel and
# the CUDA toolkit's runtime:  examples/c_api/build.sh [output binary]   (PYTHON, CUDA_HOME: env)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$here/dispatch_combine}
nccl=$("${PYTHON:-python3}" -c '
import glob, os, nvidia
print(next(p for b in nvidia.__path__ for p in glob.glob(os.path.join(b, "nccl"))
           if os.path.exists(os.path.join(p, "include", "nccl.h"))))')
cuda=${CUDA_HOME:-/usr/local/cuda}
cudart=$(dirname "$(find "$cuda/" -name libcudart_static.a -print -quit)")
lib=$root/megatron_nccl_ep
cc -std=c11 -O2 -Wall -Wextra -Werror "$here/dispatch_combine.c" -o "$out" \
    -I"$root/csrc/include" -I"$nccl/include" -I"$cuda/include" \
    -L"$lib" -l:libnccl_ep.so -Wl,-rpath,"$lib" \
    -L"$nccl/lib" -l:libnccl.so.2 -Wl,-rpath,"$nccl/lib" \
    -L"$cudart" -lcudart_static -ldl -lrt -lpthread
echo "built $out"
