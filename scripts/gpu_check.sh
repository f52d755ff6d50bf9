#!/usr/bin/env bash
# One prepared check of the compiled backend on a GPU machine (a few minutes, no network needed):
# builds aten_override._C in place with its CUDA kernels (csrc/cuda/direct.cu) against the machine's
# torch (which must have CUDA), enables them (ATEN_OVERRIDE_CUDA_KERNELS=1), then runs the CUDA tests,
# the CUDA tests again with the kernels disabled (the fallback reason), and the CUDA benchmark rows
# of the depthwise class. Logs go to $OUT (default: ./gpu-check-out); the last lines are the summary.
#
#   PYTHON=python3 OUT=/tmp/out scripts/gpu_check.sh
#
# MAX_JOBS (default 8) and TORCH_CUDA_ARCH_LIST (default: the visible GPUs) reach the build.
# The benchmark runs with NVIDIA_TF32_OVERRIDE=0: native float32 convolutions in full float32, as
# ours, so that its check against native (1e-4 of the largest value) compares like with like.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
: >"$out/summary.log"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export ATEN_OVERRIDE_CUDA_KERNELS=1
status=0
tests=tests/ops/convolution_backward

step() {  # step NAME CMD...: runs CMD, logs to $out/NAME.log, remembers a failure
  local name="$1"; shift
  echo "== $name: $*" | tee -a "$out/summary.log"
  local start=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)" | tee -a "$out/summary.log"
  else
    echo "   FAILED (rc $?, $((SECONDS - start)) s), see $name.log" | tee -a "$out/summary.log"; status=1
  fi
  tail -n 30 "$out/$name.log"
}

rm -f aten_override/_C*.so  # never test a stale (CPU-only) build
step build env MAX_JOBS="${MAX_JOBS:-8}" "$py" setup.py build_ext --inplace
# The build falls back to CPU-only with a warning when the CUDA part fails: show it, then insist.
grep -n "aten_override:" "$out/build.log" | tee -a "$out/summary.log"
step state "$py" -c "
import torch, aten_override
from aten_override.ops.convolution_backward import compiled
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
print('availability', aten_override.availability())
print('compiled CUDA kernels:', compiled.cuda_kernels())
assert torch.cuda.is_available(), 'no CUDA device'
assert compiled.cuda_kernels() == 'enabled', compiled.cuda_kernels()
"
step tests "$py" -m pytest -q -rs -p no:cacheprovider "$tests/test_compiled_cuda.py" tests/cli/test_info.py
step tests-disabled env ATEN_OVERRIDE_CUDA_KERNELS=0 "$py" -m pytest -q -rs -p no:cacheprovider -m cuda \
  "$tests/test_compiled_cuda.py" "$tests/test_compiled.py"
step bench bash -c "
  '$py' scripts/bench_convolution_backward.py --overhead --device cuda --backends compiled &&
  NVIDIA_TF32_OVERRIDE=0 '$py' scripts/bench_convolution_backward.py --device cuda --only depthwise \
    --backends native,compiled --rounds 3 --min-run-time 0.05 --csv '$out/bench.csv'"
echo "== summary" && cat "$out/summary.log"
if [ $status -eq 0 ]; then echo "GPU CHECK PASSED"; else echo "GPU CHECK FAILED"; fi
exit $status
