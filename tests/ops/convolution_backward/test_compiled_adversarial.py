"""Adversarial cases for the compiled backend's channels-in-lanes depthwise kernel and the kn2row-3d
routing of large 3x1x1 layers: each against the original kernel (and float64), with a one-line
reason. Found by fuzzing ~6,000 random lanes calls and ~350 taps-in-one-dim 3-D calls."""

from __future__ import annotations

import pytest
import torch

import aten_override
from aten_override.ops.convolution_backward import compiled
from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs
from tests.helpers import assert_within_twice_native_error
from tests.ops.convolution_backward.test_compiled import (
    COMPILED_UNAVAILABLE, assert_compiled_served, assert_matches_original, native_backend, run_compiled,
    run_compiled_on_one_thread, to_float64,
)

pytestmark = pytest.mark.skipif(COMPILED_UNAVAILABLE is not None, reason=str(COMPILED_UNAVAILABLE))


def depthwise(c, mult, size, kernel, stride, padding, dilation=None, dtype=torch.float32, batch=2, mask=(True,) * 3,
              seed=0, shift=0.0):
    """Random depthwise arguments (C_in = groups = c, C_out = c * mult); values randn + shift."""
    g = torch.Generator().manual_seed(seed)
    d = len(size)
    dilation = dilation or [1] * d
    out = [(size[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(d)]
    x = torch.randn([batch, c, *size], generator=g, dtype=torch.float64) + shift
    w = torch.randn([c * mult, 1, *kernel], generator=g, dtype=torch.float64)
    go = torch.randn([batch, c * mult, *out], generator=g, dtype=torch.float64) + shift
    return ConvolutionBackwardArgs(
        go.to(dtype), x.to(dtype), w.to(dtype), [c * mult], stride, padding, dilation, False, [0] * d, c, list(mask)
    )


def check_lanes(args):
    assert compiled.depthwise_kernel(args) == "channels-in-lanes"
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served("depthwise")
    return ours


LANES_CASES = {
    # 9, 17, 31, 33 channels: one lane short of a block, one over, and partial blocks with multipliers 3 and 5.
    "c9,x3,2d,s2": depthwise(9, 3, [9, 11], [3, 3], [2, 2], [1, 1]),
    "c17,x5,2d,k5,s3": depthwise(17, 5, [13, 10], [5, 5], [3, 3], [2, 2]),
    "c33,x1,3d,anisotropic": depthwise(33, 1, [3, 5, 6], [3, 2, 3], [2, 1, 3], [1, 0, 2], [1, 2, 1]),
    "c4,x5,float64,pad>kernel": depthwise(4, 5, [5, 5], [3, 3], [2, 2], [4, 4], dtype=torch.float64),
    "c31,x2,1d,k31,s4,d3": depthwise(31, 2, [1000], [31], [4], [40], [3]),  # the 31-tap limit in 1-D, strided
    "c16,1d,pad 1000": depthwise(16, 1, [1], [3], [1], [1000]),  # one input, 1,999-position padded plane
    "c16,x2,1d,dilation 500": depthwise(16, 2, [3], [3], [1], [600], [500]),  # taps far outside the input
    "c16,2d,stride 1000": depthwise(16, 1, [100, 9], [3, 3], [1000, 4], [0, 1]),  # one output row, stride > plane
    "c19,x2,3d,plane 1,k3,p1": depthwise(19, 2, [1, 1, 1], [3, 3, 3], [1, 1, 1], [1, 1, 1]),  # 26 taps on padding
    "c16,3d,stride>kernel": depthwise(16, 1, [9, 9, 9], [1, 2, 1], [3, 3, 4], [0, 1, 0]),  # inputs no tap meets
    "c4096,plane 1": depthwise(4096, 1, [1, 1], [1, 1], [1, 1], [0, 0], batch=3),  # 256 blocks of 16 lanes
    "c25,x4,3d,bfloat16": depthwise(25, 4, [8, 9, 10], [3, 3, 3], [2, 2, 2], [1, 1, 1], dtype=torch.bfloat16),
    "c9,x2,2d,float16": depthwise(9, 2, [6, 5], [3, 3], [1, 2], [4, 1], dtype=torch.float16),
    "c20,gi only": depthwise(20, 2, [7, 7], [3, 3], [1, 1], [1, 1], mask=(True, False, False)),
    "c20,gw+gb": depthwise(20, 2, [30, 34], [3, 3], [2, 2], [1, 1], mask=(False, True, True)),
}


@pytest.mark.parametrize("args", LANES_CASES.values(), ids=LANES_CASES.keys())
def test_lanes_kernel_extremes(args):
    """Partial lane blocks, multipliers, extreme padding / dilation / stride, one-element planes."""
    assert_matches_original(args, check_lanes(args))


def _views(go, x, w):
    """Expanded (stride-0) grad_output and weight, input a view with large strides."""
    big = torch.zeros([s * 3 for s in x.shape], dtype=x.dtype)[::3, ::3, ::3, ::3]
    return go[:1].expand_as(go), big.copy_(x), w[:1].expand_as(w)


def test_lanes_kernel_expanded_and_strided_views():
    """Stride-0 and large-stride tensors are made contiguous before the lane transposes."""
    args = depthwise(20, 2, [9, 9], [3, 3], [2, 2], [1, 1], batch=3)
    go, x, w = _views(args.grad_output, args.input, args.weight)
    args = ConvolutionBackwardArgs(go, x, w, *args.as_aten_args()[3:])
    assert_matches_original(args, check_lanes(args))


@pytest.mark.parametrize("case", ["1d,s4", "3d,s2"])
def test_lanes_kernel_long_sums_as_accurate_as_native(case):
    """grad_weight / grad_bias over up to 1,024 positions of mean-1 data: one running float32 sum per
    lane measured 7-11 eps against native's 1.2 (1-D); chunked sums stay within 2x native + 2 eps."""
    if case == "1d,s4":
        args = depthwise(20, 2, [4096], [3], [4], [1], batch=1, shift=1.0, mask=(False, True, True))
    else:
        args = depthwise(20, 1, [14, 16, 18], [3, 3, 3], [2, 2, 2], [1, 1, 1], batch=1, shift=1.0)
    ours = check_lanes(args)
    native = aten_override.original_kernel("cpu")(*args.as_aten_args())
    exact = aten_override.original_kernel("cpu")(*to_float64(args).as_aten_args())
    assert_within_twice_native_error(ours, native, exact, outputs=(1, 2))


@pytest.mark.parametrize("where", ["nan in grad_output", "inf in grad_output, grad_bias", "bfloat16 overflow"])
def test_lanes_kernel_non_finite_patterns(where):
    """NaN / inf positions as native's: zero lanes and stride gaps must not turn them into NaN."""
    mask = (True, False, True) if where != "bfloat16 overflow" else (True,) * 3
    dtype = torch.bfloat16 if where == "bfloat16 overflow" else torch.float32
    args = depthwise(16, 1, [8, 8], [3, 3], [2, 2], [1, 1], dtype=dtype, mask=mask)
    if where == "bfloat16 overflow":
        args.grad_output.mul_(1e19), args.input.mul_(1e19), args.weight.mul_(1e19)
    else:
        args.grad_output.select(2 + (where != "nan in grad_output"), 1).fill_(float("nan" if "nan" in where else "inf"))
    ours = check_lanes(args)
    native = aten_override.original_kernel("cpu")(*args.as_aten_args())
    assert any(b is not None and not b.isfinite().all() for b in native)  # the case is one that matters
    for a, b in zip(ours, native):
        if a is not None:
            torch.testing.assert_close(a, b, equal_nan=True, rtol=2e-2, atol=0)


def test_lanes_kernel_bitwise_deterministic_across_threads():
    """Every output element is one task's, in a fixed order: 1, 2 and 3 threads give the same bits."""
    args = depthwise(33, 3, [11, 9], [5, 3], [2, 3], [2, 1], batch=5)
    first = check_lanes(args)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert all(torch.equal(a, b) for a, b in zip(first, run_compiled(args)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(first, run_compiled_on_one_thread(args)))


def test_lanes_kernel_under_vmap_per_sample_grads():
    """torch.func per-sample gradients fold the batch into groups (groups = B * C): lanes kernel, loop's values."""
    conv = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=8)
    params = {k: v.detach() for k, v in conv.named_parameters()}
    x = torch.randn(6, 8, 7, 7, generator=torch.Generator().manual_seed(0))

    def loss(p, xi):
        return torch.func.functional_call(conv, p, (xi.unsqueeze(0),)).square().sum()

    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        ours = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    assert_compiled_served("depthwise")
    for i in range(6):
        for k, v in torch.func.grad(loss)(params, x[i]).items():
            torch.testing.assert_close(ours[k][i], v)


def test_kn2row_3d_taps_in_last_dim_where_native_picks_onednn():
    """1x1x3 with T = H = 1 (the taps-in-one-dim rule's other shape), dilation 2, channels_last_3d, no
    grad_input: kn2row-3d from 2^18 grad_output elements, native's values and strides."""
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last_3d
    x = torch.randn(8, 24, 1, 1, 1040, generator=g).contiguous(memory_format=fmt)
    w = torch.randn(32, 24, 1, 1, 3, generator=g)
    go = torch.randn(8, 32, 1, 1, 1038, generator=g).contiguous(memory_format=fmt)
    args = ConvolutionBackwardArgs(go, x, w, [32], [1, 1, 1], [0, 0, 1], [1, 1, 2], False, [0, 0, 0], 1,
                                   [False, True, True])
    assert go.numel() >= 1 << 18 and native_backend(args) == "Mkldnn"
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served("kn2row-3d")
    assert_matches_original(args, ours)
