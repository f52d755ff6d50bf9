#!/usr/bin/env bash
# One prepared check of the compiled backend on a GPU machine (a few minutes, no network needed):
# builds aten_override._C in place against the machine's torch (which must have CUDA), then runs the
# CUDA tests and a quick CUDA benchmark. Logs go to $OUT (default: ./gpu-check-out).
#
#   PYTHON=python3 OUT=/tmp/out scripts/gpu_check.sh
#
# This build has no CUDA kernels: CUDA calls of the compiled backend run the original kernel with the
# recorded reason "no CUDA kernels in this build"; the check proves that routing (device guard,
# values, strides, stats) and measures its per-call cost.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
status=0

step() {  # step NAME CMD...: runs CMD, logs to $out/NAME.log, remembers a failure
  local name="$1"; shift
  echo "== $name: $*" | tee -a "$out/summary.log"
  if "$@" >"$out/$name.log" 2>&1; then
    echo "   ok" | tee -a "$out/summary.log"
  else
    echo "   FAILED (rc $?), see $name.log" | tee -a "$out/summary.log"; status=1
  fi
  tail -n 25 "$out/$name.log"
}

step env "$py" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
step build env MAX_JOBS="${MAX_JOBS:-8}" "$py" setup.py build_ext --inplace
step availability env PYTHONPATH="$root" "$py" -c "import aten_override; print(aten_override.availability()); assert aten_override.availability()['compiled'] is None"
step tests env PYTHONPATH="$root" "$py" -m pytest -q -p no:cacheprovider -m "cuda" tests/ops/convolution_backward/test_compiled.py
step overhead env PYTHONPATH="$root" "$py" scripts/bench_convolution_backward.py --overhead --device cuda --backends compiled
step bench env PYTHONPATH="$root" "$py" scripts/bench_convolution_backward.py --device cuda --quick --backends native,compiled \
  --rounds 2 --min-run-time 0.05 --csv "$out/bench.csv"
exit $status
