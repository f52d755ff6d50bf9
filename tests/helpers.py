"""Comparison helpers: results of a backend vs the original ATen kernel (values, dtypes, shapes, strides);
running ``python -m aten_override test`` from the checkout."""

from __future__ import annotations

import math

import os
import subprocess
import sys

import torch

import aten_override

REDUCED = (torch.float16, torch.bfloat16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_test_cli(*argv, cwd, timeout=600) -> subprocess.CompletedProcess:
    """``python -m aten_override test *argv`` in a fresh interpreter that imports this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "aten_override", "test", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def run_original(*aten_args):
    """The original kernel (captured with torch.library.get_kernel), whatever is registered now."""
    device = aten_args[0].device.type
    return aten_override.original_kernel(device)(*aten_args)


def run_backend(backend, *aten_args):
    """``aten::convolution_backward`` through the dispatcher with ``backend`` enabled; asserts it served."""
    aten_override.reset_stats()
    with aten_override.enable(backend):
        out = torch.ops.aten.convolution_backward.default(*aten_args)
    stats = aten_override.stats()
    assert stats.get(backend if isinstance(backend, str) else backend.name, 0) == 1, stats
    assert stats.get("fallback", 0) == 0, stats
    return out


def _float64_args(aten_args):
    return tuple(a.double() if isinstance(a, torch.Tensor) else a for a in aten_args)


def assert_matches_original(ours, aten_args, *, reference=None):
    """``ours`` equals the original kernel's result on ``aten_args``: None pattern, shapes, dtypes,
    strides exactly; values with assert_close for f32/f64. For f16/bf16 both are compared with the
    float64 result and ours must be at least about as accurate as native."""
    native = run_original(*aten_args)
    dtype = aten_args[0].dtype
    ref64 = reference if reference is not None else (run_original(*_float64_args(aten_args)) if dtype in REDUCED else None)
    mask = aten_args[10]
    for i, (name, o, n, r) in enumerate(zip(("grad_input", "grad_weight", "grad_bias"), ours, native, ref64 or (None,) * 3)):
        if not mask[i]:
            # Upstream's oneDNN path returns a (for 1-D: unsqueezed 4-D) grad_weight for mask
            # [*, False, True]; the schema's contract is None, which we return (test_upstream_quirks).
            assert o is None, f"{name}: expected None (output_mask[{i}] is False), got a tensor"
            continue
        assert n is not None
        assert o is not None, f"{name}: expected a tensor, got None"
        assert o.shape == n.shape, f"{name}: shape {tuple(o.shape)} != native {tuple(n.shape)}"
        assert o.dtype == n.dtype, f"{name}: dtype {o.dtype} != native {n.dtype}"
        assert o.device == n.device
        if o.numel() > 1:
            assert o.stride() == n.stride(), f"{name}: strides {o.stride()} != native {n.stride()}"
        if o.numel() == 0:
            continue
        if dtype is torch.float64:
            torch.testing.assert_close(o, n, msg=lambda m: f"{name}: {m}")
        else:
            # Summation order differs between implementations: judge both against float64.
            r = r if r is not None else run_original(*_float64_args(aten_args))[i]
            scale = r.abs().max().item() + 1e-12
            err_ours = (o.double() - r).abs().max().item() / scale
            err_native = (n.double() - r).abs().max().item() / scale
            eps = torch.finfo(dtype).eps
            floor = (4 if dtype in REDUCED else 64) * eps
            # native's own result may be garbage (NaN / inf: torch 2.13's oneDNN bfloat16 paths that leave
            # outputs unwritten, see test_native_defects.py): then ours is judged against float64 alone
            bound = max(2 * err_native, floor) if math.isfinite(err_native) else floor
            assert err_ours <= bound, (
                f"{name}: error relative to max|float64 result| {err_ours:.3g} vs native's {err_native:.3g} (eps {eps:.3g})"
            )
    return native


def assert_within_twice_native_error(ours, native, exact, outputs=(1, 2)) -> None:
    """Each of ``outputs`` (indices into the 3 results) of ``ours`` is as accurate as native's float32
    result against ``exact`` (float64): max error within 2x native's + 2 eps of the result's scale. The
    message gives both errors in eps of that scale."""
    eps = torch.finfo(torch.float32).eps
    for i in outputs:
        scale = exact[i].abs().max().item()
        ours_err, native_err = ((t[i].double() - exact[i]).abs().max().item() for t in (ours, native))
        assert ours_err <= 2 * native_err + 2 * eps * scale, (i, ours_err / eps / scale, native_err / eps / scale)
