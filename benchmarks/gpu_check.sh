#!/usr/bin/env bash
# The GPU session's one script (about 3 minutes on an H200; every step has its own time limit and a
# failing step does not stop the next): build with the image's nvcc, run the CUDA tests, the real
# NCCL from C with one rank, then the step benchmark on the GPU. Prints everything and, where the
# device tool sets $OUT, keeps the whole log there; copy the output into docs/gpu.md with the date.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# the in-place build is not installed: the scripts under benchmarks/ find the package through this
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="${OUT:-/tmp}/gpu_check.log"
step() { echo; echo "== $1 ($(date -u +%T))"; }
main() {
step "machine $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
nvcc --version | tail -2
step "build (nvcc, sm_90 only)"
# build in place: the tests import the package from the repository root
ACCELERATE_C_CUDA_ARCHS="90" timeout 150 python setup.py -q build_ext --inplace 2>&1 | grep -v '^\s*$' | tail -15
# a failed build must not leave an older CPU-only module to be tested
python -c "from accelerate_c import _C; print('has_cuda', _C.has_cuda, 'devices', _C.cuda_device_count()); \
import sys; sys.exit(0 if _C.has_cuda else 1)" || { echo "FAILED: no CUDA build of accelerate_c._C"; return 1; }
# pytest-timeout (in the image) ends one hung test, not the whole file; -rs prints why a test skipped
PYT="python -m pytest -q -rs -p no:cacheprovider"
python -c "import pytest_timeout" 2>/dev/null && PYT="$PYT --timeout=90"
step "CUDA tests (kernels, loop vs GradScaler, clip, GPU checkpoint staging; issue 11 item 12)"
timeout 240 $PYT tests/test_cuda.py 2>&1 | tail -40
step "checkpoint files with GPU tensors (save_file/load_file/load_into on cuda)"
timeout 90 $PYT tests/test_safetensors_cuda.py 2>&1 | tail -15
step "NCCL from C (one rank)"
timeout 90 python benchmarks/nccl_check.py 2>&1 | tail -15
step "bench_step on the GPU"
# one table (glibc defaults): the host malloc settings concern CPU-side tensors
timeout 150 python benchmarks/bench_step.py --device cuda --settings defaults --repeats 3 --steps 10 2>&1 | tail -40
step "done"
}
# a pipe, not exec > >(tee): the script ends only once tee has written the whole log
main 2>&1 | tee "$LOG"
