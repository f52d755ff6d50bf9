"""The compiled backend on CUDA: the depthwise kernels of ``csrc/cuda/direct.cu`` and their gating.

The kernel tests need a CUDA device and an extension built with CUDA whose kernels are enabled
(``ATEN_OVERRIDE_CUDA_KERNELS=1`` at import); ``scripts/gpu_check.sh`` sets up both. Each proves the
kernel ran (``aten_override.stats()``: served by the compiled backend, layer class ``depthwise``, no
fallback) and compares with the original kernel (None pattern, shapes, dtypes, strides, values; the
half types against the float64 result, at least about as accurate as native) and with the float64
result of the original CPU kernel. The gating tests run everywhere (a CPU build: "not built").
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import aten_override
from aten_override.ops.convolution_backward import compiled
from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs
from tests.helpers import assert_matches_original, run_backend
from tests.ops.convolution_backward.test_compiled import GEOMETRIES, SPATIAL, Geometry

COMPILED_UNAVAILABLE = aten_override.availability()["compiled"]
pytestmark = pytest.mark.skipif(COMPILED_UNAVAILABLE is not None, reason=str(COMPILED_UNAVAILABLE))

CUDA_STATE = compiled.cuda_kernels()
NO_CUDA = "no CUDA device in this process (run scripts/gpu_check.sh on a GPU machine)"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
requires_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or CUDA_STATE != "enabled",
    reason=NO_CUDA if not torch.cuda.is_available() else (
        f"compiled CUDA kernels: {CUDA_STATE} (build with CUDA and set ATEN_OVERRIDE_CUDA_KERNELS=1; scripts/gpu_check.sh)"
    ),
)
REASONS = {
    "not built": "no CUDA kernels in this build",
    "built, disabled": "CUDA kernels built but not enabled (unverified on hardware; set ATEN_OVERRIDE_CUDA_KERNELS=1)",
    "enabled": None,
}
ROOT = Path(__file__).resolve().parents[3]


# --- the problems --------------------------------------------------------------------------------


MEMORY_FORMATS = {2: torch.channels_last, 3: torch.channels_last_3d}


def depthwise_args(
    dims: int, geometry: Geometry, *, channels: int = 4, multiplier: int = 1, groups: int | None = None,
    batch: int = 2, spatial=None, dtype=torch.float32, output_mask=(True, True, True), channels_last=False,
    device="cuda", seed=0,
) -> tuple:
    """The aten arguments of a depthwise layer (groups == C_in, C_out = multiplier * C_in) on ``device``;
    another ``groups`` gives a grouped layer of the same sizes."""
    g = torch.Generator().manual_seed(seed)
    spatial = spatial or SPATIAL[dims]
    groups = groups or channels
    c_out = channels * multiplier
    k, s, p, d = geometry.kernel, geometry.stride, geometry.padding, geometry.dilation
    out = [(i + 2 * p - d * (k - 1) - 1) // s + 1 for i in spatial]

    def make(shape):
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        return t.contiguous(memory_format=MEMORY_FORMATS[dims]) if channels_last else t

    go, x, w = make([batch, c_out, *out]), make([batch, channels, *spatial]), make([c_out, channels // groups, *[k] * dims])
    return (go, x, w, [c_out], [s], [p], [d], False, [0], groups, list(output_mask))


def cpu_float64(aten_args) -> tuple:
    return tuple(a.detach().cpu().double() if isinstance(a, torch.Tensor) else a for a in aten_args)


# Largest error relative to max|float64 result| for each dtype (one rounding of the result for the
# half types, float32 accumulation, small sums).
CPU_FLOAT64_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def assert_close_to_cpu_float64(ours, aten_args) -> None:
    ref = aten_override.original_kernel("cpu")(*cpu_float64(aten_args))
    tol = CPU_FLOAT64_TOLERANCE[aten_args[0].dtype]
    for name, o, r, wanted in zip(("grad_input", "grad_weight", "grad_bias"), ours, ref, aten_args[10]):
        if not wanted:
            continue
        scale = r.abs().max().item() or 1.0
        err = (o.cpu().double() - r).abs().max().item() / scale
        assert err <= tol, f"{name}: error {err:.3g} of max|float64 result| vs CPU float64 (tolerance {tol:g})"


def run_depthwise(aten_args, layer_class="depthwise"):
    """The compiled backend through the dispatcher; asserts the call was served with ``layer_class``."""
    ours = run_backend("compiled", *aten_args)
    assert aten_override.stats().get("compiled_layer_classes") == {layer_class: 1}, aten_override.stats()
    return ours


def _cases():
    cases = []
    for dims, geometry, multiplier in itertools.product((1, 2, 3), GEOMETRIES, (1, 2)):
        cases.append(pytest.param(dims, geometry, multiplier, torch.float32, id=f"dim={dims},{geometry.name},x{multiplier}"))
    for dims, dtype in itertools.product((1, 2, 3), (torch.float64, torch.float16, torch.bfloat16)):
        name = str(dtype).replace("torch.", "")
        cases.append(pytest.param(dims, GEOMETRIES[2], 2, dtype, id=f"dim={dims},{GEOMETRIES[2].name},x2,{name}"))
    return cases


# --- gating (any machine) -------------------------------------------------------------------------


def test_cuda_state_and_reason_of_this_build():
    """The C++ reason for CUDA calls is the documented one for the state, also through
    unsupported_reason() with CUDA tensors (fake ones: no GPU needed)."""
    assert CUDA_STATE in REASONS
    assert compiled.extension().cuda_unsupported_reason() == REASONS[CUDA_STATE]
    with FakeTensorMode():
        go, x, w = (torch.empty(s, device="cuda") for s in ([2, 4, 8, 8], [2, 4, 8, 8], [4, 1, 3, 3]))
    assert go.is_cuda and x.is_cuda and w.is_cuda
    args = ConvolutionBackwardArgs(go, x, w, [4], [1], [1], [1], False, [0], 4, [True, True, True])
    assert compiled.unsupported_reason(args) == REASONS[CUDA_STATE]
    if not torch.version.cuda:
        assert CUDA_STATE == "not built"


def test_environment_variable_read_at_import():
    """ATEN_OVERRIDE_CUDA_KERNELS=1 enables built CUDA kernels; unset, they stay disabled; without
    them in the build, both say "not built"."""
    def state(value):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_OVERRIDE_CUDA_KERNELS"}
        if value is not None:
            env["ATEN_OVERRIDE_CUDA_KERNELS"] = value
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        code = "from aten_override.ops.convolution_backward import compiled; print(compiled.cuda_kernels())"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.strip()

    built = CUDA_STATE != "not built"
    assert state("1") == ("enabled" if built else "not built")
    assert state(None) == ("built, disabled" if built else "not built")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.skipif(CUDA_STATE == "enabled", reason="CUDA kernels enabled: the kernel tests below cover CUDA calls")
def test_cuda_calls_fall_back_with_reason_unless_enabled():
    aten_args = depthwise_args(2, GEOMETRIES[1])
    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        ours = torch.ops.aten.convolution_backward.default(*aten_args)
    stats = aten_override.stats()
    assert stats["fallback_reasons"] == {f"compiled: {REASONS[CUDA_STATE]}": 1}, stats
    assert_matches_original(ours, aten_args)


# --- the kernels (a CUDA device, kernels enabled) --------------------------------------------------


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.parametrize("dims,geometry,multiplier,dtype", _cases())
def test_matches_original(dims, geometry, multiplier, dtype):
    aten_args = depthwise_args(dims, geometry, multiplier=multiplier, dtype=dtype)
    ours = run_depthwise(aten_args)
    assert_matches_original(ours, aten_args)
    assert_close_to_cpu_float64(ours, aten_args)


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.parametrize("mask", list(itertools.product([True, False], repeat=3)), ids=lambda m: "mask=" + "".join("1" if b else "0" for b in m))
def test_output_masks(mask):
    aten_args = depthwise_args(2, GEOMETRIES[1], multiplier=2, output_mask=mask)
    ours = run_depthwise(aten_args)
    assert_matches_original(ours, aten_args)


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [2, 3], ids=["dim=2", "dim=3"])
def test_channels_last_strides(dims, dtype):
    """Upstream's output strides (channels_last inputs): computed contiguous, copied into them."""
    aten_args = depthwise_args(dims, GEOMETRIES[0], dtype=dtype, channels_last=True)
    ours = run_depthwise(aten_args)
    assert_matches_original(ours, aten_args)


@requires_cuda_kernels
@pytest.mark.cuda
def test_grad_weight_split_reduction():
    """Enough (sample, output position) pairs for grad_weight to reduce several chunks per element."""
    aten_args = depthwise_args(2, GEOMETRIES[0], channels=8, multiplier=2, batch=4, spatial=[40, 40])
    ours = run_depthwise(aten_args)
    assert_matches_original(ours, aten_args)
    assert_close_to_cpu_float64(ours, aten_args)


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bitwise_deterministic(dtype):
    aten_args = depthwise_args(2, GEOMETRIES[1], channels=8, multiplier=2, batch=4, spatial=[40, 40], dtype=dtype)
    first = run_depthwise(aten_args)
    second = run_depthwise(aten_args)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@requires_cuda_kernels
@pytest.mark.cuda
def test_deterministic_algorithms_mode():
    """No atomics: torch.use_deterministic_algorithms(True) raises no alert and changes nothing."""
    aten_args = depthwise_args(2, GEOMETRIES[0], channels=8, batch=4, spatial=[40, 40])
    expected = run_depthwise(aten_args)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ours = run_depthwise(aten_args)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)


@requires_cuda_kernels
@pytest.mark.cuda
def test_current_stream():
    """The kernels run on the caller's stream: inputs written on a busy side stream are read only
    after those writes (on the default stream they would be read before)."""
    aten_args = depthwise_args(2, GEOMETRIES[0], channels=8, batch=4, spatial=[40, 40])
    expected = aten_override.original_kernel("cuda")(*aten_args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy for tens of milliseconds
        go, x, w = (t * 1 for t in aten_args[:3])
        ours = run_depthwise((go, x, w, *aten_args[3:]))
    side.synchronize()
    for name, a, b in zip(("grad_input", "grad_weight", "grad_bias"), ours, expected):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=NO_CUDA if not torch.cuda.is_available() else "needs 2 CUDA devices")
def test_device_guard_second_device():
    aten_args = depthwise_args(2, GEOMETRIES[1], multiplier=2, device="cuda:1")
    before = torch.cuda.current_device()
    ours = run_depthwise(aten_args)
    assert torch.cuda.current_device() == before
    assert all(t.device == torch.device("cuda:1") for t in ours)
    assert_matches_original(ours, aten_args)


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.parametrize(
    "groups,channels,layer_class", [(2, 8, "grouped"), (1, 1, "one-channel")], ids=["grouped", "one-channel"]
)
def test_other_classes_use_native_on_cuda(groups, channels, layer_class):
    """Only the depthwise class has a CUDA kernel: the others are served by native (cuDNN) by choice,
    not as a fallback."""
    aten_args = depthwise_args(2, GEOMETRIES[1], channels=channels, groups=groups, multiplier=2)
    ours = run_depthwise(aten_args, layer_class)
    assert_matches_original(ours, aten_args)


@requires_cuda_kernels
@pytest.mark.cuda
@pytest.mark.slow
def test_64bit_indexing():
    """Over 2^30 elements: 64-bit indices. Kernel size 1 makes the results exact to check:
    grad_input = weight * grad_output, grad_weight = sum(grad_output * input)."""
    width = (1 << 29) + 32  # 2 channels: 2^30 + 64 elements per tensor
    go, x = (torch.randn(1, 2, width, device="cuda") for _ in range(2))
    w = torch.randn(2, 1, 1, device="cuda")
    gi, gw, gb = run_depthwise((go, x, w, [2], [1], [0], [1], False, [0], 2, [True, True, False]))
    assert gb is None
    assert torch.equal(gi, go * w.view(1, 2, 1))
    for c in range(2):
        exact = torch.dot(go[0, c].double(), x[0, c].double()).item()
        magnitude = torch.dot(go[0, c].double().abs(), x[0, c].double().abs()).item()
        assert abs(gw[c, 0, 0].item() - exact) <= 1e-4 * magnitude, (gw[c, 0, 0].item(), exact, magnitude)
