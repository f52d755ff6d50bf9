"""Calls on which torch 2.13's original CPU kernel is wrong, and our backends are not.

bfloat16 / float16 layers where native picks oneDNN and a kernel tap only ever meets padding (a
"dead tap": e.g. padding >= the dilated kernel on a short dim). The exact gradient of such a tap is
zero, but upstream's oneDNN path
- leaves that tap of ``grad_weight`` uninitialised (bfloat16): its values are whatever the allocator
  held, and change from run to run (found by the fuzzer: a flaky CI run);
- segfaults computing ``grad_input`` of such transposed layers (float16 1-D and 2-D, bfloat16 3-D).

And bfloat16 transposed layers whose input has width 1 (the last spatial dim) under a kernel wider
than that, with more than one spatial position (``args.width_one_transposed``; no dead tap): on x86
with AMX the oneDNN path leaves most of ``grad_input`` unwritten (scripts/sweep_native_defects.py).

Found by sweeping 1-D/2-D/3-D, regular/transposed, float32/bfloat16/float16 over small sizes,
kernels, strides, paddings and dilations (each call in a forked child): every wrong or crashing
call had a dead tap, float32 none. The compiled backend serves these calls in its ``dead-taps``
class (native in float32, rounded once); the python backend never calls the original kernel.

And bfloat16 3-D layers on a CPU with AMX-BF16 (``args.amx_3d_weight``): oneDNN's weight gradient
is off by 12-52% of its scale on larger planes, regular and transposed, the same on every run,
R(2+1)D's spatial 1x3x3 layers among them (found by a helper's sweep of R(2+1)D-like layers on
Sapphire Rapids, then random sweeps).

And 3-D layers, float32 too, with padding > stride in depth and no row there that meets the whole
kernel (``args.depth_without_full_row``): oneDNN's gradients are wrong, and on some it segfaults,
aborts on a corrupted heap, or hangs. Transposed ones were found by the sweep; regular ones (e.g.
depth 3 under a kernel of 9, stride 4, padding 7) by a sweep of long depth kernels. Computed in
float64, where native has no oneDNN path.

And, where oneDNN runs its AVX2 kernels (CPUs without AVX-512, e.g. Zen 3), float32 strided 1x1
layers on channels-last tensors whose oneDNN source has under 8 channels (``args.strided_1x1_avx2``):
a wrong ``grad_weight`` or a hang at two threads, a corrupted heap at one. Computed in float64 too.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import aten_override
from aten_override.ops.convolution_backward import python_impl
from aten_override.ops.convolution_backward.args import (
    ConvolutionBackwardArgs,
    amx_3d_weight,
    cpu_has_amx_bf16,
    depth_without_full_row,
    depthwise_dilated,
    native_defect_reason,
    onednn_avx2,
    strided_1x1_avx2,
)
from aten_override.testing.skips import dead_taps, width_one_transposed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BACKENDS = [b for b in ("python", "compiled") if aten_override.availability()[b] is None]

# (dims, transposed, input size per dim, kernel, stride, padding, dilation), all bfloat16 on oneDNN
GARBAGE = {
    "1d-k3-s2-p1": (1, False, 1, 3, 2, 1, 1),
    "1d-t-k3-s2-p1": (1, True, 1, 3, 2, 1, 1),
    "2d-k2-s3-p1": (2, False, 1, 2, 3, 1, 1),
    "2d-t-k3-s3-p1": (2, True, 1, 3, 3, 1, 1),
    "3d-k3-s3-p2": (3, False, 2, 3, 3, 2, 1),
    "3d-t-k3-s2-p1": (3, True, 1, 3, 2, 1, 1),
}
# (dtype, dims, transposed, input size, kernel, stride, padding, dilation): the original kernel segfaults
CRASH = {
    "f16-1d-t-k1-s2-p1-d2": ("float16", 1, True, 2, 1, 2, 1, 2),
    "f16-1d-t-k2-s2-p3-d2": ("float16", 1, True, 3, 2, 2, 3, 2),
    "bf16-3d-t-k3-s2-p3-d2": ("bfloat16", 3, True, 2, 3, 2, 3, 2),
    # regular float32, depth 5 under a kernel of 9, stride 2, padding 5: no output row reads only the
    # input (args.depth_without_full_row); SIGSEGV 3 times in 3 (similar layers: SIGABRT or a hang)
    "f32-3d-k9x1x1-s2-p5x0x0": ("float32", 3, False, (5, 2, 1), (9, 1, 1), (2, 1, 1), (5, 0, 0), 1),
}


def make_call(dtype, dims, transposed, size, kernel, stride, padding, dilation, channels=16):
    """``(grad_output, input, weight, bias_sizes, stride, ...)`` with every output requested.
    ``size`` ... ``dilation``: one int for every spatial dim, or a tuple of ``dims``."""
    size, kernel, stride, padding, dilation = (
        [v] * dims if isinstance(v, int) else list(v) for v in (size, kernel, stride, padding, dilation))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, channels, *size, generator=g).to(dtype)
    w = torch.randn(channels, channels, *kernel, generator=g).to(dtype)
    conv = (stride, padding, dilation, transposed, [0] * dims, 1)
    out = torch.ops.aten.convolution(x.double(), w.double(), None, *conv)
    go = torch.randn(out.shape, generator=g).to(dtype)
    return (go, x, w, [channels], *conv, [True, True, True])


def native_picks_onednn(args) -> bool:
    go, x, w, _, *conv, _ = args
    return int(torch._C._select_conv_backend(x, w, None, *conv, None)) in python_impl._ONEDNN


def reference(args):
    return torch.ops.aten.convolution_backward.default(
        *[a.double() if isinstance(a, torch.Tensor) else a for a in args])


def scribble_allocator(dtype):
    # Freed blocks full of large values: an uninitialised read returns them.
    junk = [torch.full((4096,), 1e4, dtype=dtype) for _ in range(32)]
    del junk


def test_dead_taps_predicate():
    # regular: output o reads input o*s - p + j*d. L=1, k=3, s=2, p=1: one output, reading -1, 0, 1
    assert dead_taps(transposed=False, input_size=[1], grad_output_size=[1], kernel=[3], stride=[2], padding=[1],
                     dilation=[1]) == [[0, 2]]
    assert dead_taps(transposed=False, input_size=[5, 1], grad_output_size=[5, 1], kernel=[3, 1], stride=[1, 1],
                     padding=[1, 0], dilation=[1, 1]) == [[], []]
    # transposed: input i writes output i*s - p + j*d. L=2, k=1, s=2, p=1: writes -1 and 1; output size 1
    assert dead_taps(transposed=True, input_size=[2], grad_output_size=[1], kernel=[1], stride=[2], padding=[1],
                     dilation=[2]) == [[0]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(GARBAGE))
def test_bfloat16_grad_weight_of_dead_taps_is_zero_and_repeatable(name, backend):
    args = make_call(torch.bfloat16, *GARBAGE[name])
    go, x, w, _, stride, padding, dilation, transposed, *_ = args
    dead = dead_taps(transposed=transposed, input_size=list(x.shape[2:]), grad_output_size=list(go.shape[2:]),
                     kernel=list(w.shape[2:]), stride=stride, padding=padding, dilation=dilation)
    assert any(dead), "the case must have a dead tap"
    flat_dead = torch.tensor(_dead_flat(dead, w.shape[2:]))
    results = _check_repeatable_and_right(args, backend)
    for ours in results:
        grad_weight = ours[1]
        # the gradient of a tap that only meets padding is exactly zero
        taps = grad_weight.reshape(*grad_weight.shape[:2], -1)[..., flat_dead]
        assert taps.numel() > 0 and taps.eq(0).all()


def _check_repeatable_and_right(args, backend, native_layout=True, layer_class="dead-taps"):
    """Three runs of ``backend`` on ``args`` (allocator scribbled before each): native's dtypes,
    shapes and strides (``native_layout=False``: those of the float64 reference, for calls where
    native corrupts the heap), close to float64, equal bit for bit, and served in ``layer_class``
    where native picks oneDNN. Returns the three results."""
    expected = reference(args)
    native = aten_override.original_kernel("cpu")(*args) if native_layout else expected
    results = []
    aten_override.reset_stats()
    for _ in range(3):
        scribble_allocator(args[0].dtype)
        with aten_override.enable(backend):
            results.append(torch.ops.aten.convolution_backward.default(*args))
    assert aten_override.stats()[backend] == 3
    if backend == "compiled" and native_picks_onednn(args):  # elsewhere native is right and serves them
        assert aten_override.stats()["compiled_layer_classes"] == {layer_class: 3}
    for ours in results:
        for i, (a, n, e) in enumerate(zip(ours, native, expected)):
            assert a.dtype == args[0].dtype and a.shape == n.shape and a.stride() == n.stride(), i
            torch.testing.assert_close(a.double(), e, atol=0.05 * e.abs().max().item() + 1e-6, rtol=0.02)
            assert torch.equal(a, results[0][i])  # repeatable, bit for bit
    return results


# (dims, input size, kernel, stride, padding), bfloat16 transposed on oneDNN, no dead tap
WIDTH_ONE = {
    "2d-t-8x1-k3-s2": (2, (8, 1), 3, 2, 0),
    "2d-t-32x1-k1x3-s1x2": (2, (32, 1), (1, 3), (1, 2), 0),
    "3d-t-8x8x1-k3-s2-p1x1x0": (3, (8, 8, 1), 3, 2, (1, 1, 0)),
}


def test_width_one_transposed_predicate():
    assert width_one_transposed(transposed=True, input_size=[8, 1], kernel=[3, 3])
    assert width_one_transposed(transposed=True, input_size=[5, 5, 1], kernel=[1, 1, 3])
    assert not width_one_transposed(transposed=False, input_size=[8, 1], kernel=[3, 3])
    assert not width_one_transposed(transposed=True, input_size=[8, 1], kernel=[3, 1])  # one tap wide
    assert not width_one_transposed(transposed=True, input_size=[1, 8], kernel=[3, 3])  # height 1 is right
    assert not width_one_transposed(transposed=True, input_size=[1, 1], kernel=[4, 4])  # DCGAN's first layer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(WIDTH_ONE))
def test_bfloat16_grad_input_of_transposed_width_one_is_repeatable(name, backend):
    dims, size, kernel, stride, padding = WIDTH_ONE[name]
    args = make_call(torch.bfloat16, dims, True, size, kernel, stride, padding, 1)
    go, x, w, _, stride, padding, dilation, *_ = args
    assert not any(dead_taps(transposed=True, input_size=list(x.shape[2:]), grad_output_size=list(go.shape[2:]),
                             kernel=list(w.shape[2:]), stride=stride, padding=padding, dilation=dilation))
    assert width_one_transposed(transposed=True, input_size=list(x.shape[2:]), kernel=list(w.shape[2:]))
    _check_repeatable_and_right(args, backend)


# (transposed, input size, kernel, padding), bfloat16 3-D, 64 channels, batch 2, no dead tap, no
# short dim: native's grad_weight was 0.32, 0.12 and 0.18 of its scale off (float64), run after run
AMX_3D = {
    "x1x56x56-k1x1x1": (False, (1, 56, 56), (1, 1, 1), (0, 0, 0)),
    "x4x56x56-k1x3x3-p0x1x1": (False, (4, 56, 56), (1, 3, 3), (0, 1, 1)),  # R(2+1)D-18's layer1 spatial layers
    "t-x2x56x56-k1x3x3-p0x1x1": (True, (2, 56, 56), (1, 3, 3), (0, 1, 1)),
}


def test_amx_3d_weight_predicate():
    """The Python predicate and the compiled backend agree: a bfloat16 3-D call that asks for
    grad_weight, regular or transposed, and that the layer-class table would leave to native never
    reaches the original kernel (dead-taps, or a class of our own kernels) exactly where the CPU has
    AMX-BF16; float16, 2-D and grad_input-only calls stay where they were. The 1x1x1 call is the
    pointwise class's (our GEMMs) on every CPU where native picks oneDNN, AMX or not (a Zen 4 VM's
    table gives it gemm-im2col): only its predicate follows AMX."""
    from aten_override.ops.convolution_backward import compiled

    amx = cpu_has_amx_bf16()
    assert amx == bool(torch._C._cpu._get_cpu_capability().get("amx_bf16", False))
    cases = [  # (call, expected predicate, whether the table serves it with a kernel of ours)
        (make_call(torch.bfloat16, 3, False, (4, 8, 8), 3, 1, 1, 1), amx, amx),
        (make_call(torch.bfloat16, 3, False, (4, 8, 8), (1, 3, 3), 1, (0, 1, 1), 1), amx, amx),
        (make_call(torch.bfloat16, 3, False, (4, 8, 8), (1, 1, 1), 1, 0, 1), amx, True),  # pointwise: our GEMMs
        (make_call(torch.float16, 3, False, (4, 8, 8), 3, 1, 1, 1), False, False),
        (make_call(torch.bfloat16, 2, False, (8, 8), 3, 1, 1, 1), False, False),
        (make_call(torch.bfloat16, 3, True, (4, 8, 8), 3, 1, 1, 1), amx, amx),
        (make_call(torch.bfloat16, 3, False, (4, 8, 8), 3, 1, 1, 1)[:-1] + ([True, False, True],), False, False),
    ]
    for call, expected, ours in cases:
        args = ConvolutionBackwardArgs(*call)
        assert amx_3d_weight(args) == expected, call[1].shape
        if compiled.unavailable_reason() is None and native_picks_onednn(call):
            assert (compiled.planned_kernel(args) != "native") == ours, call[1].shape
            stand_in = compiled.planned_kernel(args) in ("upcast", "fold-2d")
            assert (compiled.layer_class(args) == "dead-taps") == (expected and stand_in)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(AMX_3D))
def test_bfloat16_3d_grad_weight_is_right_on_amx(name, backend):
    if not cpu_has_amx_bf16():
        pytest.skip("no AMX-BF16 on this CPU: oneDNN's AMX weight gradient (args.amx_3d_weight) does not run here")
    transposed, size, kernel, padding = AMX_3D[name]
    args = make_call(torch.bfloat16, 3, transposed, size, kernel, 1, padding, 1, channels=64)
    assert amx_3d_weight(ConvolutionBackwardArgs(*args))
    expected = reference(args)[1]
    for ours in _check_repeatable_and_right(args, backend):
        assert (ours[1].double() - expected).abs().max().item() <= 2 ** -6 * expected.abs().max().item(), name
    if backend == "compiled" and kernel == (1, 3, 3):  # R(2+1)D's spatial layers fold: bfloat16 2-D calls
        assert aten_override.stats()["compiled_kernels"] == {"fold-2d": 3}
    native = aten_override.original_kernel("cpu")(*args)[1]
    if (native.double() - expected).abs().max().item() < 2 ** -6 * expected.abs().max().item():
        pytest.skip(f"the original kernel was right on {name} here (torch {torch.__version__}): revisit "
                    "args.amx_3d_weight")


# (input size, kernel, stride, padding, dilation, groups, transposed, output_padding): 3-D layers that
# fold into a 2-D call (fold-2d): a 1x1 spatial kernel, plane into one row; or kernel depth 1, depth
# into the batch
FOLD = {
    "row-k3x1x1-p1": ((4, 6, 5), (3, 1, 1), (1, 1, 1), (1, 0, 0), (1, 1, 1), 1, False, (0, 0, 0)),
    "row-k3x1x1-s2-p2-d1x2x3": ((7, 3, 4), (3, 1, 1), (2, 1, 1), (2, 0, 0), (1, 2, 3), 1, False, (0, 0, 0)),
    "batch-k1x3x3-s1x2x2-p0x1x1": ((3, 7, 6), (1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1), 1, False, (0, 0, 0)),
    "batch-k1x3x3-s2x1x1-g2": ((5, 6, 6), (1, 3, 3), (2, 1, 1), (0, 1, 1), (1, 1, 1), 2, False, (0, 0, 0)),
    "batch-k1x5x3-d3x1x1": ((2, 9, 5), (1, 5, 3), (1, 1, 1), (0, 2, 1), (3, 1, 1), 1, False, (0, 0, 0)),
    # dilations on one-tap dims, which the 2-D call drops
    "t-batch-k1x1x1-s1x2x2-d2x2x1-op0x1x1": ((5, 3, 8), (1, 1, 1), (1, 2, 2), (0, 0, 0), (2, 2, 1), 1, True,
                                              (0, 1, 1)),
    "t-row-k4x1x1-s2-p1-op1": ((4, 3, 5), (4, 1, 1), (2, 1, 1), (1, 0, 0), (1, 1, 1), 1, True, (1, 0, 0)),
    "t-batch-k1x4x4-s1x2x2-p0x1x1-g2": ((3, 5, 4), (1, 4, 4), (1, 2, 2), (0, 1, 1), (1, 1, 1), 2, True, (0, 1, 0)),
}
MASKS = {"all": ((True, True, True), True), "weight": ((False, True, False), False),
         "input-bias": ((True, False, True), True)}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(FOLD))
def test_fold_2d_is_the_3d_call(name, dtype, layout, mask):
    """fold-2d (the stand-in where only args.amx_3d_weight makes native wrong) computes the 3-D call:
    close to float64, exact zeros where the depth stride skips input slices, native's dtypes, shapes
    and strides. Run by name, so it is checked on CPUs without AMX too; where oneDNN runs its AVX2
    kernels, its 2-D call of a strided 1x1 layer takes args.strided_1x1_avx2's stand-in (native's
    channels-last path was wrong there)."""
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    size, kernel, stride, padding, dilation, groups, transposed, output_padding = FOLD[name]
    output_mask, bias = MASKS[mask]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, *size, generator=g).to(dtype)
    w_shape = (4, 6 // groups) if transposed else (6, 4 // groups)
    w = torch.randn(*w_shape, *kernel, generator=g).to(dtype)
    conv = (list(stride), list(padding), list(dilation), transposed, list(output_padding), groups)
    go = torch.randn(torch.ops.aten.convolution(x.double(), w.double(), None, *conv).shape, generator=g).to(dtype)
    if layout == "channels_last_3d":
        x, go = (t.contiguous(memory_format=torch.channels_last_3d) for t in (x, go))
    args = (go, x, w, [6] if bias else None, *conv, list(output_mask))
    x_before, go_before = x.clone(), go.clone()
    ours = compiled.extension().run_kernel("fold-2d", *args)
    native = aten_override.original_kernel("cpu")(*args)
    expected = reference(args)
    assert torch.equal(x, x_before) and torch.equal(go, go_before)
    for i, (o, n, e) in enumerate(zip(ours, native, expected)):
        if not output_mask[i]:
            assert o is None, i
            continue
        assert o.dtype == dtype and o.shape == n.shape and o.stride() == n.stride(), (i, o.stride(), n.stride())
        tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
        assert (o.double() - e).abs().max().item() <= tol * e.abs().max().item(), i
        if i == 0 and stride[0] > 1 and kernel[0] == 1 and not transposed:  # slices the depth stride skips: zero
            skipped = [d for d in range(size[0]) if d % stride[0] or d // stride[0] >= go.shape[2]]
            assert skipped and o[:, :, skipped].eq(0).all() and e[:, :, skipped].eq(0).all()


def test_fold_2d_declines_calls_that_do_not_fold():
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    for args in (
        make_call(torch.float32, 3, False, (4, 6, 6), 3, 1, 1, 1),  # 3x3x3: neither fold
        make_call(torch.float32, 3, True, (4, 6, 6), (1, 3, 3), 2, 0, 1),  # transposed, depth stride 2
        make_call(torch.float32, 3, False, (5, 6, 6), (3, 1, 1), 1, 0, (2, 1, 1)),  # dilated on its taps
        # transposed, a one-tap dim dilated with output_padding >= stride: the 2-D call could not drop it
        (torch.randn(2, 4, 4, 7, 6), torch.randn(2, 3, 4, 6, 6), torch.randn(3, 4, 1, 1, 1), [4], [1, 1, 1],
         [0, 0, 0], [1, 2, 1], True, [0, 1, 0], 1, [True, True, True]),
    ):
        with pytest.raises(ValueError, match="fold-2d"):
            compiled.extension().run_kernel("fold-2d", *args)


# Calls on which fold-2d once passed native's 2-D bfloat16 path a dilation with a channels-last input
# (found by a helper's fuzz; native's 3-D path is right on each): a one-tap dim dilated (heap corruption,
# the first through live-taps from a Conv3d under autocast), and a transposed depthwise call dilated in
# its tapped dim (NaN in grad_weight). (grad_output, input, weight shapes, weight channels-last?, stride,
# padding, dilation, transposed, output_padding, groups, output_mask)
FOLD_DILATED = {
    "live-taps-k3x1x1-d2x1x2": ((3, 3, 1, 3, 8), (3, 2, 2, 3, 8), (3, 2, 3, 1, 1), False, [2, 1, 1], [2, 0, 0],
                                [2, 1, 2], False, [0, 0, 0], 1, [True, True, False]),
    "t-k1x1x1-d2x2x1-op0x1x1": ((1, 4, 5, 6, 16), (1, 16, 5, 3, 8), (16, 4, 1, 1, 1), True, [1, 2, 2], [0, 0, 0],
                                [2, 2, 1], True, [0, 1, 1], 1, [False, True, False]),
    "t-depthwise-k3x1x1-d2": ((2, 2, 7, 8, 13), (2, 2, 3, 8, 13), (2, 1, 3, 1, 1), False, [1, 1, 1], [0, 0, 0],
                              [2, 1, 1], True, [0, 0, 0], 2, [True, True, True]),
}

_FOLD_DILATED_SCRIPT = textwrap.dedent(
    """
    import json, torch, aten_override
    from tests.ops.convolution_backward.test_native_defects import FOLD_DILATED
    go_shape, x_shape, w_shape, w_cl, *conv, mask = FOLD_DILATED[{name!r}]
    g = torch.Generator().manual_seed(0)
    cl = torch.channels_last_3d
    go = torch.randn(go_shape, generator=g).bfloat16()
    x = torch.randn(x_shape, generator=g).bfloat16().contiguous(memory_format=cl)
    w = torch.randn(w_shape, generator=g).bfloat16()
    w = w.contiguous(memory_format=cl) if w_cl else w
    args = (go, x, w, [go_shape[1]], *conv, mask)
    ref = torch.ops.aten.convolution_backward.default(*(t.double() if isinstance(t, torch.Tensor) else t for t in args))
    worst = 0.0
    for _ in range(20):
        with aten_override.enable("compiled", autotune=False):
            ours = torch.ops.aten.convolution_backward.default(*args)
        for o, r in zip(ours, ref):
            if o is not None:
                worst = max(worst, (o.double() - r).abs().max().item() / r.abs().max().item())
    del ours
    import gc; gc.collect()
    print(json.dumps({{"error": worst, "kernels": aten_override.stats()["compiled_kernels"]}}))
    """
)


@pytest.mark.parametrize("name", list(FOLD_DILATED))
def test_fold_2d_never_passes_a_dilation_to_the_2d_call(name):
    """20 calls in a child interpreter (a corrupted heap aborts it, at the latest at exit): exit 0,
    within 2^-6 of float64 (NaN fails)."""
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    child = _run(_FOLD_DILATED_SCRIPT.format(name=name))
    assert child.returncode == 0, child.stderr[-2000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["error"] <= 2 ** -6, result


# bfloat16 2-D depthwise layers, dilated, channels-last input (args.depthwise_dilated): native's
# grad_weight NaN, unwritten or off by more than its scale. (transposed, channels, input size, kernel,
# padding, dilation)
DEPTHWISE_DILATED = {
    "t-c4-3x64-k3x1-d2x1": (True, 4, (3, 64), (3, 1), (0, 0), (2, 1)),
    "t-c4-3x64-k3x1-p1x0-d2x1": (True, 4, (3, 64), (3, 1), (1, 0), (2, 1)),
    "t-c32-14x56-k3x3-d2x1": (True, 32, (14, 56), (3, 3), (0, 0), (2, 1)),
    "c2-3x40-k2x1-d2x1": (False, 2, (3, 40), (2, 1), (0, 0), (2, 1)),
    "c16-40x40-k2x2-p1-d3": (False, 16, (40, 40), (2, 2), (1, 1), (3, 3)),
}


def depthwise_dilated_call(name, dtype=torch.bfloat16, channels_last=True, groups=None):
    transposed, channels, size, kernel, padding, dilation = DEPTHWISE_DILATED[name]
    groups = groups or channels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, channels, *size, generator=g).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    w = torch.randn(channels, channels // groups, *kernel, generator=g).to(dtype)
    conv = ([1, 1], list(padding), list(dilation), transposed, [0, 0], groups)
    go = torch.randn(torch.ops.aten.convolution(x.double(), w.double(), None, *conv).shape, generator=g).to(dtype)
    return (go, x, w, [channels], *conv, [True, True, True])


def test_depthwise_dilated_predicate():
    """Python and C++ agree: the compiled backend never hands such a call to native; float16, a
    contiguous input, groups 1 or no dilation stay where they were."""
    from aten_override.ops.convolution_backward import compiled

    name = "t-c4-3x64-k3x1-d2x1"
    cases = [
        (depthwise_dilated_call("c2-3x40-k2x1-d2x1"), True),
        (depthwise_dilated_call(name), True),
        (depthwise_dilated_call(name, dtype=torch.float16), False),
        (depthwise_dilated_call(name, channels_last=False), False),
        (depthwise_dilated_call(name, groups=1), False),
        (depthwise_dilated_call(name)[:-1] + ([True, False, True],), False),  # no grad_weight: right
    ]
    for call, expected in cases:
        args = ConvolutionBackwardArgs(*call)
        assert depthwise_dilated(args) == expected
        if compiled.unavailable_reason() is None and native_picks_onednn(call):
            assert (compiled.planned_kernel(args) != "native") == expected, call[1].shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(DEPTHWISE_DILATED))
def test_bfloat16_depthwise_dilated_grad_weight_is_right(name, backend):
    """Ours within 2^-6 of float64 in native's layouts, repeatable; transposed calls in the
    dead-taps class (float32 copies), regular ones in the compiled backend's depthwise class, whose
    autotuner may not take native as the reference there (nor run it by name)."""
    from aten_override.ops.convolution_backward import compiled

    args = depthwise_dilated_call(name)
    assert depthwise_dilated(ConvolutionBackwardArgs(*args))
    expected = reference(args)[1]
    scale = expected.abs().max().item()
    transposed = args[7]
    results = _check_repeatable_and_right(args, backend, layer_class="dead-taps" if transposed else "depthwise")
    if backend == "compiled" and not transposed and native_picks_onednn(args):
        # (only on oneDNN's path: native's own bfloat16 path, on a CPU without bfloat16 instructions (a
        # Zen 3 VM), is right here and serves as the reference)
        with pytest.raises(ValueError, match="native cannot compute this call"):
            compiled.extension().run_kernel("native", *args)
    for ours in results:
        assert (ours[1].double() - expected).abs().max().item() <= 2 ** -6 * scale, name
    native = aten_override.original_kernel("cpu")(*args)[1]
    if (native.double() - expected).abs().max().item() < 2 ** -6 * scale:  # NaN compares False: wrong
        pytest.skip(f"the original kernel was right on {name} here (torch {torch.__version__}): revisit "
                    "args.depthwise_dilated")


# (transposed, input size, kernel, stride, padding), float32 3-D on oneDNN, no dead tap: native's
# gradients are wrong (regular: garbage, 1e30 where the heap held it), and on similar layers (input
# (2, 16, 3, 1, 1), kernel (4, 1, 1) transposed or (9, 1, 1) regular) it corrupts the heap or hangs
# (SIGSEGV, SIGABRT, a minute and more: a varying failure, so these cases never run native)
DEPTH = {
    "f32-3d-t-4x1x1-k4x1x1-s2-p3x0x0": (True, (4, 1, 1), (4, 1, 1), (2, 1, 1), (3, 0, 0)),
    "f32-3d-t-4x2x2-k5x1x1-s2-p3x0x0": (True, (4, 2, 2), (5, 1, 1), (2, 1, 1), (3, 0, 0)),
    "f32-3d-4x1x1-k4x1x1-s2-p3x0x0": (False, (4, 1, 1), (4, 1, 1), (2, 1, 1), (3, 0, 0)),
    "f32-3d-5x1x1-k6x1x1-s4-p5x0x0": (False, (5, 1, 1), (6, 1, 1), (4, 1, 1), (5, 0, 0)),
    "f32-3d-6x3x3-k9x3x3-s2-p7x1x1": (False, (6, 3, 3), (9, 3, 3), (2, 1, 1), (7, 1, 1)),
}


def test_depth_without_full_row_predicate():
    # input i writes output 2i - 3 + j, output size 4: i=0 -> -3..0, i=1 -> -1..2, i=2 -> 1..4, i=3 -> 3..6
    assert depth_without_full_row(transposed=True, input_size=[4, 1, 1], grad_output_size=[4, 1, 1],
                                  kernel=[4, 1, 1], stride=[2, 1, 1], padding=[3, 0, 0], dilation=[1, 1, 1])
    # output size 5 (output_padding 1): i=2 writes 1..4, all inside
    assert not depth_without_full_row(transposed=True, input_size=[4, 1, 1], grad_output_size=[5, 1, 1],
                                      kernel=[4, 1, 1], stride=[2, 1, 1], padding=[3, 0, 0], dilation=[1, 1, 1])
    assert not depth_without_full_row(transposed=True, input_size=[4, 4], grad_output_size=[4, 4], kernel=[4, 4],
                                      stride=[2, 2], padding=[3, 3], dilation=[1, 1])  # 2-D: right
    # padding <= stride: right (a 3-D decoder's kernel 4, stride 2, padding 1 on depth 2: i=1 writes 1..4)
    assert not depth_without_full_row(transposed=True, input_size=[2, 8, 8], grad_output_size=[4, 16, 16],
                                      kernel=[4, 4, 4], stride=[2, 2, 2], padding=[1, 1, 1], dilation=[1, 1, 1])
    # regular: output o reads input 2o - 3 + j, input size 4, kernel 4: o=0 -> -3..0, o=1 -> -1..2,
    # o=2 -> 1..4, o=3 -> 3..6; none inside
    regular = dict(transposed=False, grad_output_size=[4, 1, 1], kernel=[4, 1, 1], stride=[2, 1, 1],
                   padding=[3, 0, 0], dilation=[1, 1, 1])
    assert depth_without_full_row(input_size=[4, 1, 1], **regular)
    assert not depth_without_full_row(input_size=[5, 1, 1], **regular)  # o=2 reads 1..4, all inside
    # a long kernel in height (right: only depth is affected) and an unpadded one (right)
    assert not depth_without_full_row(transposed=False, input_size=[1, 4, 1], grad_output_size=[1, 4, 1],
                                      kernel=[1, 4, 1], stride=[1, 2, 1], padding=[0, 3, 0], dilation=[1, 1, 1])
    assert not depth_without_full_row(transposed=False, input_size=[3, 1, 1], grad_output_size=[1, 1, 1],
                                      kernel=[3, 1, 1], stride=[4, 1, 1], padding=[0, 0, 0], dilation=[1, 1, 1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(DEPTH))
def test_float32_gradients_of_depth_without_full_row_are_right(name, backend):
    transposed, *geometry = DEPTH[name]
    args = make_call(torch.float32, 3, transposed, *geometry, 1)
    go, x, w, _, stride, padding, dilation, *_ = args
    sizes = dict(transposed=transposed, input_size=list(x.shape[2:]), grad_output_size=list(go.shape[2:]),
                 kernel=list(w.shape[2:]), stride=stride, padding=padding, dilation=dilation)
    assert not any(dead_taps(**sizes)) and depth_without_full_row(**sizes)
    _check_repeatable_and_right(args, backend, native_layout=False)  # contiguous: native's layout too


# Float32 3-D layers of the depth_without_full_row kind that a layer class of our own kernels serves
# (input size, C_in, C_out, groups; kernel (9, 1, 1), stride (2, 1, 1), padding (5, 0, 0)). They keep
# their class, but native must never run on them: as the autotuner's reference and baseline, and as
# the fallback of a kernel that declines a call (an inf in input: a non-finite grad_weight), native's
# oneDNN path crashed the process (SIGSEGV / SIGABRT, found by a fresh review). reference_kernel()
# stands in for it there: the dead-taps class's float64 upcast.
OWN_CLASS = {
    "one-channel": ((5, 32, 32), 1, 16, 1),
    # 80 channels per group: over grouped-lanes' 64 on every machine (with 32, its tiles fit a 2 MiB L2 and
    # the call was grouped-lanes' class, Dense at this size, so dead-taps: the test failed on such CPUs)
    "grouped-gemm": ((5, 16, 16), 160, 160, 2),
    "depthwise": ((5, 8, 8), 16, 16, 16),
}

_OWN_CLASS_SCRIPT = textwrap.dedent(
    """
    import json, torch, aten_override
    from aten_override.ops.convolution_backward import compiled
    from tests.ops.convolution_backward.test_native_defects import own_class_call, reference
    args = own_class_call({name!r}, nonfinite={nonfinite!r})
    with aten_override.enable("compiled", autotune={autotune!r}):
        ours = torch.ops.aten.convolution_backward.default(*args)
    last = compiled.extension().last_call()
    expected = reference(args)
    for o, e in zip(ours, expected):
        assert o.dtype == torch.float32 and o.shape == e.shape and o.stride() == e.stride(), (o.dtype, o.shape)
        scale = e.nan_to_num(0, 0, 0).abs().max().item()
        torch.testing.assert_close(o.double(), e, rtol=1e-5, atol=1e-5 * scale, equal_nan=True)
        assert o.isnan().equal(e.isnan())
    stats = aten_override.stats()
    print(json.dumps([stats["compiled_layer_classes"], stats["compiled_kernels"], last["tuned"],
                      sorted(last["times_us"])]))
    """
)


def own_class_call(name: str, nonfinite: bool = False) -> tuple:
    """A call of ``OWN_CLASS[name]``; ``nonfinite``: an inf in input (NaN in some taps of grad_weight)."""
    size, c_in, c_out, groups = OWN_CLASS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c_in, *size, generator=g)
    if nonfinite:
        x[0, 0, 2, 0, 0] = float("inf")
    w = torch.randn(c_out, c_in // groups, 9, 1, 1, generator=g)
    conv = ([2, 1, 1], [5, 0, 0], [1, 1, 1], False, [0, 0, 0], groups)
    go = torch.randn(torch.ops.aten.convolution(x.double(), w.double(), None, *conv).shape, generator=g)
    return (go, x, w, [c_out], *conv, [True, True, True])


@pytest.mark.parametrize("nonfinite,autotune", [(False, True), (True, False)], ids=["autotuned", "declined"])
@pytest.mark.parametrize("name", list(OWN_CLASS))
def test_depth_without_full_row_never_reaches_native_from_our_own_classes(name, nonfinite, autotune):
    from aten_override.ops.convolution_backward import compiled
    from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    args = own_class_call(name)
    go, x, w, _, stride, padding, dilation, *_ = args
    assert depth_without_full_row(transposed=False, input_size=list(x.shape[2:]), grad_output_size=list(go.shape[2:]),
                                  kernel=list(w.shape[2:]), stride=stride, padding=padding, dilation=dilation)
    if not native_picks_onednn(args):
        pytest.skip(f"native does not take oneDNN for {name} here: its path is not the defective one")
    assert compiled.layer_class(ConvolutionBackwardArgs(*args)) == name  # the class stays
    child = _run(_OWN_CLASS_SCRIPT.format(name=name, nonfinite=nonfinite, autotune=autotune))
    assert child.returncode == 0, child.stderr[-2000:]  # was -11 / -6: native's oneDNN path ran
    classes, kernels, tuned, candidates = json.loads(child.stdout.strip().splitlines()[-1])
    assert classes == {name: 1}
    if autotune:
        # the tuning timed the upcast where it times native elsewhere, and never native
        assert tuned and "upcast" in candidates and "native" not in candidates, candidates
    else:
        assert kernels == {"upcast": 1}  # the table's kernel declined the inf; the upcast, not native, served it


_VERIFY_SCRIPT = textwrap.dedent(
    """
    import json, torch, aten_override
    from tests.ops.convolution_backward.test_native_defects import own_class_call
    args = own_class_call({name!r})
    with aten_override.enable("compiled"), aten_override.trace(verify=True, log=False) as t:
        torch.ops.aten.convolution_backward.default(*args)
    (call,) = t.calls
    print(json.dumps([call.verify.ok, call.verify.strides_match, call.verify.reference]))
    """
)


@pytest.mark.parametrize("name", ["one-channel", "grouped-gemm"])
def test_verify_and_run_kernel_never_run_the_original_kernel_where_it_crashes(name):
    """``trace(verify=True)`` compares each call with the original kernel: on these calls that kernel
    crashed the process (SIGSEGV, SIGABRT) or blamed our right result with its NaN. It is compared
    with the original kernel in float64 instead, in the call's layout and dtype. ``_C.run_kernel``
    refuses ``native`` there and runs its stand-in ``upcast``."""
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    args = own_class_call(name)
    if not native_picks_onednn(args):
        pytest.skip(f"native does not take oneDNN for {name} here: its path is not the defective one")
    child = _run(_VERIFY_SCRIPT.format(name=name))
    assert child.returncode == 0, child.stderr[-2000:]
    ok, strides_match, against = json.loads(child.stdout.strip().splitlines()[-1])
    assert ok and strides_match and against.startswith("the original kernel in float64: "), against
    ext = compiled.extension()
    with pytest.raises(ValueError, match="native cannot compute this call.*'upcast' stands in"):
        ext.run_kernel("native", *args)
    for ours, expected in zip(ext.run_kernel("upcast", *args), reference(args)):
        assert ours.dtype == torch.float32 and ours.stride() == expected.stride()
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _dead_flat(dead, kernel):
    """Flat indices (over the kernel's spatial dims) of the taps dead in at least one dim."""
    return [i for i, taps in enumerate(itertools.product(*map(range, kernel)))
            if any(j in dead_in_dim for j, dead_in_dim in zip(taps, dead))]


def _run(script: str, timeout: int = 300, **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **environ)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)


_CRASH_SCRIPT = textwrap.dedent(
    """
    import json, torch, aten_override
    from tests.ops.convolution_backward.test_native_defects import CRASH, make_call, reference
    dtype, *geometry = CRASH[{name!r}]
    args = make_call(getattr(torch, dtype), *geometry)
    backend = {backend!r}
    if backend == "aten":
        aten_override.original_kernel("cpu")(*args)
        print(json.dumps({{"error": 0.0}}))
    else:
        with aten_override.enable(backend):
            ours = torch.ops.aten.convolution_backward.default(*args)
        expected = reference(args)
        error = max(((a.double() - e).abs().max() / e.abs().max().clamp_min(1e-12)).item() for a, e in zip(ours, expected))
        print(json.dumps({{"error": error, "dtype": str(ours[0].dtype)}}))
    """
)


@pytest.mark.parametrize("name", list(CRASH))
def test_original_kernel_segfaults_and_our_backends_do_not(name):
    try:
        native = _run(_CRASH_SCRIPT.format(name=name, backend="aten"), timeout=60)
        code = native.returncode
        outcome = "returned" if code == 0 else signal.Signals(-code).name if code < 0 else f"exit {code}"
    except subprocess.TimeoutExpired:  # oneDNN hangs on some of these layers instead of crashing
        native, outcome = None, "hung"
    if outcome == "returned":  # another CPU (no oneDNN float16 path) or a fixed torch
        dtype, *geometry = CRASH[name]
        _, x, w, _, *conv, _ = make_call(getattr(torch, dtype), *geometry)
        backend = int(torch._C._select_conv_backend(x, w, None, *conv, None))
        pytest.skip(f"the original kernel does not crash on {name} here (native backend {backend}, "
                    f"torch {torch.__version__})")
    # Here native died (SIGSEGV in at::native::convolution_backward; SIGABRT on a corrupted heap, which
    # can end the child other ways too: a full-suite run saw one) or hung (float32 3-D layers)
    for backend in BACKENDS:
        ours = _run(_CRASH_SCRIPT.format(name=name, backend=backend))
        assert ours.returncode == 0, (backend, ours.stderr[-2000:])
        result = json.loads(ours.stdout.strip().splitlines()[-1])
        assert result["error"] < 0.02 and result["dtype"] == f"torch.{CRASH[name][0]}", (backend, result)


# Regular bfloat16 3-D layers with padding, no dead tap (found in a CI run of test_core_matrix, then
# by sweeping: 51 of 328 small padded layers; no unpadded one): oneDNN leaves parts of grad_weight /
# grad_input unwritten, so the values are the heap's (``args.padded_3d``).
PADDED_3D = {
    "x2x2x2,k3,p1": ((2, 2, 2), 3, 1, 1),
    "x1x3x3,k2,p1": ((1, 3, 3), 2, 1, 1),
    "x5x1x3,k3,p1,s2": ((5, 1, 3), 3, 1, 2),
}


def _dirty_heap() -> None:
    """Free buffers full of 1e30 so that an unwritten output element reads back as garbage."""
    junk = [torch.full((n,), 1e30, dtype=torch.bfloat16) for n in (64, 256, 1000, 5000, 20000)]
    del junk


def padded_3d_call(name: str) -> tuple:
    sizes, k, p, s = PADDED_3D[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, *sizes, generator=g).bfloat16()
    w = torch.randn(6, 16, k, k, k, generator=g).bfloat16()
    go = torch.randn(2, 6, *[(z + 2 * p - k) // s + 1 for z in sizes], generator=g).bfloat16()
    return (go, x, w, [6], [s] * 3, [p] * 3, [1] * 3, False, [0] * 3, 1, [True, True, True])


# The original kernel on a padded 3-D call, three times between dirtied heaps, in a child interpreter:
# its oneDNN path writes outside its outputs too (glibc has aborted the process on a later free), so
# it must not run in the test process. Prints its worst error relative to the float64 result.
_PADDED_3D_NATIVE_SCRIPT = textwrap.dedent(
    """
    import torch, aten_override
    from tests.ops.convolution_backward.test_native_defects import _dirty_heap, padded_3d_call
    args = padded_3d_call({name!r})
    native = aten_override.original_kernel("cpu")
    ref = native(*(t.double() if isinstance(t, torch.Tensor) else t for t in args))
    worst = 0.0
    for _ in range(3):
        _dirty_heap()
        for t, r in zip(native(*args), ref):
            worst = max(worst, (t.double() - r).abs().max().item() / r.abs().max().item())
    print(worst)
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(PADDED_3D))
def test_bfloat16_padded_3d_is_right_whatever_the_heap(name, backend):
    from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs, padded_3d

    args = padded_3d_call(name)
    assert padded_3d(ConvolutionBackwardArgs(*args))
    native = aten_override.original_kernel("cpu")
    ref = native(*(t.double() if isinstance(t, torch.Tensor) else t for t in args))  # float64: no oneDNN
    for _ in range(3):
        _dirty_heap()
        with aten_override.enable(backend):
            ours = torch.ops.aten.convolution_backward.default(*args)
        for o, r in zip(ours, ref):
            scale = r.abs().max().item()
            assert (o.double() - r).abs().max().item() <= 2 ** -6 * scale, name
    child = _run(_PADDED_3D_NATIVE_SCRIPT.format(name=name))
    if child.returncode == 0 and float(child.stdout.split()[-1]) < 2 ** -6:
        pytest.skip(f"the original kernel was right on {name} here (torch {torch.__version__}): revisit args.padded_3d")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dead_taps_float32_copies_take_the_compiled_choice(dtype):
    """A dead-taps call is computed on float32 copies by whatever serves that float32 call, not by
    native's float32 path: R(2+1)D's padded 3x1x1 layers in bfloat16 took native's slow 3-D float32
    path (1.2-1.6 s, 7x native's bfloat16) where the float32 call's own class, kn2row-3d, has
    gemm-kn2row. The table's choice (autotune off) makes the kernel known: ours equals gemm-kn2row's
    float32 result rounded once, and stats count one call of class dead-taps, kernel upcast."""
    from aten_override.ops.convolution_backward import compiled
    from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    g = torch.Generator().manual_seed(0)
    # Depth 2 under a kernel of 3, padded (args.padded_3d); 2^18 grad_output elements: kn2row-3d
    # whichever path native takes in float32 (Slow3d at one thread, oneDNN at more).
    x = torch.randn(2, 16, 2, 64, 64, generator=g)
    w = torch.randn(16, 16, 3, 1, 1, generator=g)
    go = torch.randn(2, 16, 2, 64, 64, generator=g)
    f32 = (go, x, w, [16], [1, 1, 1], [1, 0, 0], [1, 1, 1], False, [0, 0, 0], 1, [True, True, True])
    call = (go.to(dtype), x.to(dtype), w.to(dtype), *f32[3:])
    if compiled.layer_class(ConvolutionBackwardArgs(*call)) != "dead-taps":
        pytest.skip("native does not take oneDNN for this call here: not dead-taps")
    up = tuple(t.to(dtype).float() if isinstance(t, torch.Tensor) else t for t in f32)
    assert compiled.layer_class(ConvolutionBackwardArgs(*up)) == "kn2row-3d"
    expected = compiled.extension().run_kernel("gemm-kn2row", *up)
    aten_override.reset_stats()
    with aten_override.enable("compiled", autotune=False):
        ours = torch.ops.aten.convolution_backward.default(*call)
    stats = aten_override.stats()
    assert stats["compiled_layer_classes"] == {"dead-taps": 1}, stats
    assert stats["compiled_kernels"] == {"upcast": 1}, stats
    for o, e in zip(ours, expected):
        assert o.dtype == dtype
        torch.testing.assert_close(o, e.to(dtype), atol=0, rtol=0)
    # Measured: the float32 call is tuned like any call, gemm-kn2row among its candidates (the
    # bfloat16 call itself is not tunable: the one entry is the float32 call's; native's float32
    # path alone tuned nothing).
    from aten_override import autotune

    autotune.clear()
    try:
        with aten_override.enable("compiled", autotune=True):
            tuned = torch.ops.aten.convolution_backward.default(*call)
        entries = autotune.entries()
        # among the candidates: timed, or cut as slow (a loaded machine can make one run look slow)
        assert len(entries) == 1 and "gemm-kn2row" in {*entries[0]["times_us"], *entries[0]["rejected"]}, entries
        assert not any(why.startswith("wrong") for why in entries[0]["rejected"].values()), entries
        for o, e in zip(tuned, expected):
            torch.testing.assert_close(o.float(), e, atol=0.05 * e.abs().max().item(), rtol=0)
    finally:
        autotune.clear()


# (input size, kernel, stride, padding, dilation) of regular calls whose dead taps are the kernel's ends
# in each dim: the call without them is the same convolution (live taps, lower padding)
LIVE_TAPS = {
    "r2plus1d-temporal-3x1x1-one-frame": ((1, 7, 7), (3, 1, 1), (1, 1, 1), (1, 0, 0), (1, 1, 1)),
    # on AMX the 1x1x1 call without the dead taps is native-defective too (args.amx_3d_weight): fold-2d
    "r2plus1d-temporal-3x1x1-one-frame-28x28": ((1, 28, 28), (3, 1, 1), (1, 1, 1), (1, 0, 0), (1, 1, 1)),
    "1d-k3-s2-p1": ((1,), (3,), (2,), (1,), (1,)),
    "2d-one-row-k3x3-d2x1-p2x1": ((1, 5), (3, 3), (1, 1), (2, 1), (2, 1)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(LIVE_TAPS))
def test_dead_taps_at_the_kernels_ends_are_cut_off_in_the_calls_dtype(name, dtype):
    """A dead-taps call whose dead taps are the ends of the kernel (R(2+1)D-18's temporal 3x1x1
    layers at one frame in bfloat16) is served as the call without them, in its own dtype: grad_input
    and grad_weight's live taps are, bit for bit, what the compiled backend gives on that smaller call
    (not float32 copies rounded once: in the bfloat16 R(2+1)D-18 step those took 101 ms for four such
    layers where native's bfloat16 took 30), the dead taps' gradient is exactly zero whatever the
    heap held, the values are close to float64's, and the layouts are native's."""
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    size, kernel, stride, padding, dilation = LIVE_TAPS[name]
    dims = len(size)
    args = make_call(dtype, dims, False, size, kernel, stride, padding, dilation)
    go, x, w = args[:3]
    if not native_picks_onednn(args):
        pytest.skip("native does not take oneDNN for this call here: not dead-taps")
    dead = dead_taps(transposed=False, input_size=list(x.shape[2:]), grad_output_size=list(go.shape[2:]),
                     kernel=list(w.shape[2:]), stride=list(stride), padding=list(padding), dilation=list(dilation))
    assert any(dead), "the case must have a dead tap"
    live = [[j for j in range(k) if j not in d] for k, d in zip(kernel, dead)]
    assert all(lv == list(range(lv[0], lv[-1] + 1)) for lv in live)
    w_live = w
    for i, lv in enumerate(live):
        w_live = w_live.narrow(2 + i, lv[0], len(lv))
    smaller = (go, x, w_live.contiguous(), args[3], list(stride),
               [p - lv[0] * d for p, lv, d in zip(padding, live, dilation)], list(dilation), False, [0] * dims, 1,
               [True, True, True])
    with aten_override.enable("compiled", autotune=False):
        expected = torch.ops.aten.convolution_backward.default(*smaller)
    ref = reference(args)
    native = aten_override.original_kernel("cpu")(*args)
    aten_override.reset_stats()
    for _ in range(2):
        scribble_allocator(dtype)
        with aten_override.enable("compiled", autotune=False):
            ours = torch.ops.aten.convolution_backward.default(*args)
        torch.testing.assert_close(ours[0], expected[0], atol=0, rtol=0)
        taps = ours[1]
        for i, lv in enumerate(live):
            taps = taps.narrow(2 + i, lv[0], len(lv))
        torch.testing.assert_close(taps, expected[1], atol=0, rtol=0)
        assert ours[1].abs().sum().item() == taps.abs().sum().item()  # every dead tap exactly zero
        torch.testing.assert_close(ours[2], expected[2], atol=0, rtol=0)
        for o, r, n in zip(ours, ref, native):
            assert (o.dtype, o.shape, o.stride()) == (n.dtype, n.shape, n.stride())
            scale = r.abs().max().item()
            assert (o.double() - r).abs().max().item() <= 2 ** -6 * scale, name
    stats = aten_override.stats()
    assert stats["compiled_layer_classes"] == {"dead-taps": 2} and stats["compiled_kernels"] == {"live-taps": 2}, stats


# Float32 2-D strided 1x1 layers on channels-last tensors whose oneDNN source (a regular call's input, a
# transposed call's grad_output) has under 8 channels, where oneDNN runs its AVX2 kernels
# (args.strided_1x1_avx2): torch 2.13's jit_avx2_1x1 weight gradient returns a wrong grad_weight (two
# threads), hangs, or writes past a buffer (one thread: "free(): invalid next size"). Found on a Zen 3
# VM (AVX2 only) by scripts/sweep_native_defects.py --strided-1x1; right on AVX-512 machines.
# (transposed, C_in, C_out, batch, input size, stride, output_padding)
STRIDED_1X1 = {
    "t-4to6-s2-op1": (True, 4, 6, 2, (8, 8), (2, 2), (1, 1)),
    "t-8to4-s2x1-op1x0": (True, 8, 4, 10, (7, 9), (2, 1), (1, 0)),
    "t-32to1-s3-op2": (True, 32, 1, 2, (8, 8), (3, 3), (2, 2)),
    "r-4to6-s2": (False, 4, 6, 2, (8, 8), (2, 2), (0, 0)),
    # regular calls of 512 grad_output elements or more are the pointwise class where native takes oneDNN:
    # our GEMM serves them, and the autotuner's reference is the stand-in
    "r-3to16-s1x2-pointwise": (False, 3, 16, 10, (8, 8), (1, 2), (0, 0)),
    "r-5to32-s2-pointwise": (False, 5, 32, 8, (56, 56), (2, 2), (0, 0)),
}
# What makes a call right: each changes one thing of a STRIDED_1X1 call (`channels`: the oneDNN source's)
STRIDED_1X1_RIGHT = {
    "contiguous": dict(channels_last=False), "8-channels": dict(channels=8), "padding-1": dict(padding=1),
    "stride-1": dict(stride=(1, 1)), "groups-2": dict(groups=2), "grad-input-only": dict(output_mask=(True, False, False)),
    "float64": dict(dtype=torch.float64),
}


def strided_1x1_call(name: str, *, dtype=torch.float32, channels_last=True, padding=0, groups=1, channels=None,
                     stride=None, output_mask=(True, True, True)) -> tuple:
    """The aten arguments of ``STRIDED_1X1[name]``, changed as the keywords say (``channels``: the oneDNN
    source's channels, C_in of a regular call, C_out of a transposed one)."""
    transposed, c_in, c_out, batch, size, default_stride, output_padding = STRIDED_1X1[name]
    if channels is not None:
        c_in, c_out = (c_in, channels) if transposed else (channels, c_out)
    stride = default_stride if stride is None else stride
    output_padding = [min(op, s - 1) for op, s in zip(output_padding, stride)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c_in, *size, generator=g)
    w = torch.randn(*((c_in, c_out // groups) if transposed else (c_out, c_in // groups)), 1, 1, generator=g)
    conv = (list(stride), [padding] * 2, [1, 1], transposed, output_padding, groups)
    go = torch.randn(torch.ops.aten.convolution(x.double(), w.double(), None, *conv).shape, generator=g)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, go = (t.to(dtype).contiguous(memory_format=fmt) for t in (x, go))
    return (go, x, w.to(dtype), [c_out], *conv, list(output_mask))


def test_strided_1x1_avx2_predicate():
    """Holds on every STRIDED_1X1 call exactly where oneDNN runs its AVX2 kernels, and on none of the
    calls one change away that were right; native_defect_reason (the fuzzer's and verify's) agrees."""
    avx2 = onednn_avx2()
    for name, (transposed, c_in, c_out, _, size, stride, _) in STRIDED_1X1.items():
        args = ConvolutionBackwardArgs(*strided_1x1_call(name))
        assert strided_1x1_avx2(args) == avx2, name
        reason = native_defect_reason(
            device_type="cpu", dtype=torch.float32, transposed=transposed, input_size=list(size),
            grad_output_size=list(args.grad_output.shape[2:]), kernel=[1, 1], stride=list(stride), padding=[0, 0],
            dilation=[1, 1], groups=1, c_in=c_in, c_out=c_out)
        assert (reason is not None) == avx2 and (reason is None or "strided_1x1_avx2" in reason), (name, reason)
    for name in ("t-4to6-s2-op1", "r-4to6-s2"):
        for change, keywords in STRIDED_1X1_RIGHT.items():
            assert not strided_1x1_avx2(ConvolutionBackwardArgs(*strided_1x1_call(name, **keywords))), (name, change)


def test_compiled_backend_agrees_on_strided_1x1_avx2():
    """The compiled backend's predicate (csrc) is args.strided_1x1_avx2: where it holds and native takes
    oneDNN, ``run_kernel("native")`` refuses the call (never running it) and names the upcast; one
    change away, the call is not the dead-taps class."""
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    ext = compiled.extension()
    calls = [(name, "", strided_1x1_call(name)) for name in STRIDED_1X1]
    calls += [(name, change, strided_1x1_call(name, **keywords))
              for name in ("t-4to6-s2-op1", "r-4to6-s2") for change, keywords in STRIDED_1X1_RIGHT.items()]
    for name, change, args in calls:
        defective = strided_1x1_avx2(ConvolutionBackwardArgs(*args)) and native_picks_onednn(args)
        layer_class = ext.layer_class(*args)
        if defective:
            assert layer_class == ("pointwise" if "pointwise" in name else "dead-taps"), (name, layer_class)
            with pytest.raises(ValueError, match="native cannot compute this call.*'upcast' stands in"):
                ext.run_kernel("native", *args)
        else:
            assert layer_class != "dead-taps", (name, change)


_ISA_CAP_SCRIPT = textwrap.dedent(
    """
    import json
    from aten_override.ops.convolution_backward import compiled
    from aten_override.ops.convolution_backward.args import onednn_avx2
    from tests.ops.convolution_backward.test_native_defects import native_picks_onednn, strided_1x1_call
    args = strided_1x1_call("t-4to6-s2-op1")
    layer_class = compiled.extension().layer_class(*args) if compiled.unavailable_reason() is None else None
    print(json.dumps([onednn_avx2(), layer_class, native_picks_onednn(args)]))
    """
)


def test_onednn_avx2_follows_an_isa_cap():
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN run its AVX2 kernels on an AVX-512 CPU too: both predicates
    (args.onednn_avx2 and csrc's) read it in a fresh process; a cap at AVX-512 leaves the CPU's answer
    (on a CPU without AVX-512, its AVX2 kernels)."""
    caps = torch._C._cpu._get_cpu_capability()
    if not caps.get("avx2", False):
        pytest.skip("no AVX2 here: oneDNN has no AVX2 kernels to run")
    avx512_core = all(caps.get(f"avx512_{x}", False) for x in ("f", "bw", "vl", "dq"))
    for cap, expected in (("avx2", True), ("AVX2_VNNI", True), ("AVX512_CORE", not avx512_core)):
        child = _run(_ISA_CAP_SCRIPT, ONEDNN_MAX_CPU_ISA=cap)
        assert child.returncode == 0, child.stderr[-2000:]
        python, layer_class, onednn = json.loads(child.stdout.strip().splitlines()[-1])
        assert python == expected, cap
        if layer_class is not None and onednn:
            assert (layer_class == "dead-taps") == expected, (cap, layer_class)


# Every STRIDED_1X1 call with all three gradients, and three of them asking for grad_bias without
# grad_weight: upstream's mkldnn backward runs oneDNN's weight-gradient primitive for grad_bias too (the
# grad_input part of the autotuner's tune_split asks for [True, False, True]). (key, name, output_mask)
STRIDED_1X1_CASES = [(name, name, (True, True, True)) for name in STRIDED_1X1] + [
    (f"{name}/{mask}", name, mask) for name in ("t-4to6-s2-op1", "r-4to6-s2", "r-5to32-s2-pointwise")
    for mask in ((True, False, True), (False, False, True))]

_STRIDED_1X1_SCRIPT = textwrap.dedent(
    """
    import json, torch, aten_override
    from aten_override.ops.convolution_backward import compiled
    from aten_override.ops.convolution_backward.args import (
        ConvolutionBackwardArgs, empty_like_native, native_backend, output_memory_format, strided_1x1_avx2)
    from tests.ops.convolution_backward.test_native_defects import (
        STRIDED_1X1_CASES, native_picks_onednn, reference, strided_1x1_call)
    torch.set_num_threads(2)  # where native's grad_weight was wrong or hung; at one thread it corrupted the heap
    backend = {backend!r}
    results = {{}}
    for key, name, mask in STRIDED_1X1_CASES:
        args = strided_1x1_call(name, output_mask=mask)
        a = ConvolutionBackwardArgs(*args)
        native = native_backend(a)
        fmt = output_memory_format(a, native)
        strides = [empty_like_native(a.input, fmt, native, is_input=True).stride(),
                   empty_like_native(a.weight, fmt, native).stride(), (1,)]
        expected = reference(args)
        aten_override.reset_stats()
        runs, candidates = [], None
        for _ in range(4):
            with aten_override.enable(backend, autotune=True):
                runs.append(torch.ops.aten.convolution_backward.default(*args))
            if candidates is None and backend == "compiled":
                candidates = sorted(compiled.extension().last_call()["times_us"])
        nones = all([o is None for o in ours] == [not m for m in mask] for ours in runs)
        pairs = [(o, e, s) for ours in runs for o, e, s in zip(ours, expected, strides) if o is not None]
        error = max(((o.double() - e).abs().max() / e.abs().max()).item() for o, e, _ in pairs)
        layout = nones and all(o.dtype == torch.float32 and o.shape == e.shape and o.stride() == tuple(s)
                               for o, e, s in pairs)
        same = all(o is None or torch.equal(o, p) for ours in runs for o, p in zip(ours, runs[0]))
        stats = aten_override.stats()
        results[key] = dict(error=error, layout=layout, same=same, calls=stats[backend],
                             defective=strided_1x1_avx2(a) and native_picks_onednn(args),
                             classes=stats.get("compiled_layer_classes"), kernels=stats.get("compiled_kernels"),
                             candidates=candidates)
    with aten_override.enable(backend), aten_override.trace(verify=True, log=False) as t:
        torch.ops.aten.convolution_backward.default(*strided_1x1_call("t-4to6-s2-op1"))
    (call,) = t.calls
    results["verify"] = [call.verify.ok, call.verify.strides_match, call.verify.reference]
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_strided_1x1_gradients_are_right(backend):
    """Every STRIDED_1X1 call, four times each at two threads in a child process (where native's
    grad_weight was wrong or hung; a hang fails as a timeout): close to float64, bit for bit the same
    each time, native's dtypes, shapes and strides. Where args.strided_1x1_avx2 holds and native takes
    oneDNN, the compiled backend serves the call in the dead-taps class (its float64 upcast) or, for a
    pointwise call, its GEMM, tuned against the upcast and never native; trace(verify=True) compares
    with the original kernel in float64 there."""
    child = _run(_STRIDED_1X1_SCRIPT.format(backend=backend), timeout=240)
    assert child.returncode == 0, child.stderr[-2000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    ok, strides_match, against = results.pop("verify")
    assert ok and strides_match, against
    assert list(results) == [key for key, _, _ in STRIDED_1X1_CASES]
    assert against.startswith("the original kernel in float64: ") or not onednn_avx2(), against
    for key, name, mask in STRIDED_1X1_CASES:
        r = results[key]
        assert r["calls"] == 4 and r["error"] < 1e-5 and r["layout"] and r["same"], (key, r)
        if backend != "compiled" or not r["defective"]:
            continue
        if not mask[0]:  # grad_bias alone: a sum over grad_output, no convolution primitive
            assert r["classes"] == {"bias-only": 4} and "native" not in r["kernels"], (key, r)
        elif "pointwise" in name:
            assert r["classes"] == {"pointwise": 4} and "native" not in r["kernels"], (key, r)
            assert "upcast" in r["candidates"] and "native" not in r["candidates"], (key, r)
        else:
            assert r["classes"] == {"dead-taps": 4} and r["kernels"] == {"upcast": 4}, (key, r)


_NATIVE_1X1_SCRIPT = textwrap.dedent(
    """
    import json, torch, aten_override
    from tests.ops.convolution_backward.test_native_defects import reference, strided_1x1_call
    torch.set_num_threads({threads})
    args = strided_1x1_call({name!r})
    expected = reference(args)[1]
    native = aten_override.original_kernel("cpu")
    print(json.dumps(sum(bool((native(*args)[1].double() - expected).abs().max() > 1e-4 * expected.abs().max())
                         for _ in range(8))))
    """
)


@pytest.mark.parametrize("threads", [1, 2])
def test_original_kernel_fails_on_strided_1x1_where_onednn_runs_avx2(threads):
    """Upstream's defect that args.strided_1x1_avx2 stands in for, in a child process: native's
    grad_weight of a transposed 1x1 layer (4 -> 6 channels, stride 2, output_padding 1, channels-last) is
    wrong, or native hangs or aborts on a corrupted heap. If a torch release fixes it, this fails: the
    predicate (and its float64 stand-in's cost) can then go."""
    args = strided_1x1_call("t-4to6-s2-op1")
    if not (onednn_avx2() and native_picks_onednn(args)):
        pytest.skip("oneDNN runs its AVX-512 kernels here (or native does not take oneDNN): native is right")
    try:
        child = _run(_NATIVE_1X1_SCRIPT.format(name="t-4to6-s2-op1", threads=threads), timeout=60)
    except subprocess.TimeoutExpired:
        return  # hung in jit_avx2_1x1_convolution_bwd_weights_t
    if child.returncode != 0:
        assert child.returncode < 0 or "free()" in child.stderr or "corrupted" in child.stderr, child.stderr[-2000:]
        return
    assert json.loads(child.stdout.strip().splitlines()[-1]) > 0, "native's grad_weight was right in 8 of 8 calls"
