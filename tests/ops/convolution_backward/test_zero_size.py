r"""A call the original kernel serves is served by ours with its results; a call it rejects, ours rejects.

Issue #10: with zero input channels (``F.conv2d`` of ``x (2, 0, 5, 5)``, ``w (3, 0, 3, 3)`` and a
bias gives a ``(2, 0, 3, 3)`` output natively, so the backward sees a 0-channel ``grad_output``
with ``bias_sizes=[3]``) both backends raised where native returns zeros. The property, over
:mod:`.zero_size_calls` (zero-size dims on every axis, empty groups, both layouts, every
``output_mask``): native raises ⇔ ours raises (with our ``convolution_backward[<backend>]:``
message), and otherwise the results match native's (values against float64, dtypes, shapes,
strides); calls with a zero batch or zero input channels are served by the compiled backend's
``empty`` class. Native runs every call in a child interpreter first, so none that crashes it can
take this test run down.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import aten_override
from aten_override.ops.convolution_backward import compiled
from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs, is_empty_call
from aten_override.testing.comparison import call_native, check_against_native, float64_reference

from ...backend_params import BACKENDS, parametrize_backend, run_python, served
from . import zero_size_calls

_OP = torch.ops.aten.convolution_backward.default


@pytest.fixture(scope="module")
def native_accepts() -> list[bool]:
    """Whether the original kernel serves each drawn call, found in a child interpreter."""
    proc = run_python([zero_size_calls.__file__], timeout=300)
    assert proc.returncode == 0, f"native crashed on a drawn call: exit status {proc.returncode}\n{proc.stderr[-2000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == zero_size_calls.COUNT
    return [r["ok"] for r in rows]


def test_draws_cover_every_kind(native_accepts):
    """The draws hit each kind the property is about, both ways: served and rejected."""
    drawn = zero_size_calls.calls()
    kinds = {
        "zero batch": lambda a: a[1].size(0) == 0,
        "zero input channels": lambda a: a[1].size(1) == 0,
        "zero output channels": lambda a: (a[2].size(1) * a[9] if a[7] else a[2].size(0)) == 0,
        "zero spatial size": lambda a: 0 in a[1].shape[2:],
        "zero kernel size": lambda a: 0 in a[2].shape[2:],
        "empty groups": lambda a: a[9] > 1 and a[1].size(1) == 0,
        "0-channel grad_output for C_out > 0": lambda a: a[0].size(1) == 0 and a[2].size(0) > 0,
        "channels_last": lambda a: a[1].dim() > 3 and a[1].is_contiguous(memory_format=torch.channels_last if a[1].dim() == 4 else torch.channels_last_3d) and not a[1].is_contiguous(),
    }
    for kind, has in kinds.items():
        outcomes = {ok for (args, _), ok in zip(drawn, native_accepts) if has(args)}
        assert outcomes == {True, False} or kind in ("zero kernel size",) and outcomes, (kind, outcomes)
    assert {tuple(a[-1]) for a, _ in drawn} == {tuple(m) for m in __import__("itertools").product((False, True), repeat=3)}


def bias_only_fix(args: tuple) -> bool:
    """A call asking only for ``grad_bias`` (or nothing) needs only ``grad_output``: ours serves it in
    every dtype. Upstream's oneDNN paths still create a convolution primitive for it and raise on a
    weight with zero output channels or a zero kernel size (its float64 path serves it)."""
    mask = args[-1]
    return not mask[0] and not mask[1]


def _bias_only_reference(args: tuple) -> tuple:
    go = args[0]
    gb = go.double().sum([0, *range(2, go.dim())]) if args[-1][2] else None
    return None, None, gb


@parametrize_backend
def test_native_raises_iff_ours_raises(native_accepts, backend):
    mismatches = []
    served_calls = fixed = 0
    for (args, name), native_ok in zip(zero_size_calls.calls(), native_accepts):
        try:
            with aten_override.enable(backend):
                actual = _OP(*args)
        except Exception as e:  # noqa: BLE001 - any exception is a mismatch unless native raises too
            if native_ok:
                mismatches.append(f"{name}: native serves it, {backend} raises {type(e).__name__}: {str(e)[:200]}")
            elif not isinstance(e, RuntimeError) or not str(e).startswith(f"convolution_backward[{backend}]:"):
                mismatches.append(f"{name}: {backend} raises without naming the op and backend: {type(e).__name__}: {str(e)[:200]}")
            continue
        try:
            if native_ok:
                served_calls += 1
                native = call_native(args)
                reference = None if args[0].dtype == torch.float64 else float64_reference(args)
            elif bias_only_fix(args):
                fixed += 1
                reference = _bias_only_reference(args)
                native = tuple(None if t is None else t.to(args[0].dtype) for t in reference)
            else:
                mismatches.append(f"{name}: native raises, {backend} serves it")
                continue
            check_against_native(actual, native, reference, output_mask=args[-1], where=name)
        except AssertionError as e:
            mismatches.append(str(e)[:400])
    assert not mismatches, f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:20])
    assert served_calls == sum(native_accepts) and served_calls >= 150
    assert fixed >= 1  # the bias-only calls native's oneDNN paths reject are drawn


@pytest.mark.skipif(compiled.unavailable_reason() is not None, reason=str(compiled.unavailable_reason()))
def test_compiled_empty_class(native_accepts):
    """Every served call with a zero batch or zero input channels is the compiled backend's
    ``empty`` class (zeros, no native call), and no other call is."""
    for (args, name), native_ok in zip(zero_size_calls.calls(), native_accepts):
        if native_ok:
            a = ConvolutionBackwardArgs(*args)
            assert (compiled.layer_class(a) == "empty") == is_empty_call(a), name


@parametrize_backend
@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("batch", [2, 0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_zero_input_channels_module(backend, dim, batch, bias, strided, contiguous):
    """PyTorch's own ``test_conv_empty_channel`` kind, through autograd: ``F.conv{1,2,3}d`` with 0 input
    channels gives a 0-channel output (the bias dropped); its backward gives zero gradients of the
    parameters' shapes, as natively."""
    conv = (F.conv1d, F.conv2d, F.conv3d)[dim - 1]
    x = torch.randn(batch, 0, *[6] * dim)
    if not contiguous:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    w = torch.randn(3, 0, *[3] * dim, requires_grad=True)
    b = torch.randn(3, requires_grad=True) if bias else None
    x.requires_grad_()
    params = [p for p in (x, w, b) if p is not None]

    def grads():
        out = conv(x, w, b, stride=2 if strided else 1)
        return torch.autograd.grad(out, params, torch.ones_like(out), allow_unused=True)

    native = grads()
    with served(backend):
        ours = grads()
    for n, o, p in zip(native, ours, params):
        assert (n is None) == (o is None)
        if n is not None:
            assert o.shape == n.shape == p.shape and o.dtype == n.dtype and o.stride() == n.stride()
            assert torch.equal(o, n)


@parametrize_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_layer_with_an_empty_output(backend, dtype):
    """``F.conv_transpose2d`` of ``x (2, 3, 1, 5)``, ``w (3, 4, 2, 3)``, padding 1 gives a
    ``(2, 4, 0, 5)`` output natively on the oneDNN path (float64's slow path raises "Output size is
    too small"); its backward gives zero gradients, as natively (both backends raised 'computed
    output size ... is too small' before)."""
    x = torch.randn(2, 3, 1, 5, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 4, 2, 3, dtype=dtype, requires_grad=True)
    b = torch.randn(4, dtype=dtype, requires_grad=True)

    def grads():
        y = F.conv_transpose2d(x, w, b, padding=(1, 1))
        assert y.shape == (2, 4, 0, 5)
        return torch.autograd.grad(y.sum(), (x, w, b))

    try:
        native = grads()
    except RuntimeError as e:
        # Native's forward picks oneDNN for bfloat16 only where the CPU has AVX-512 (a Zen 3 has not):
        # its slow path raises for this output, so there is no backward to serve.
        if dtype is not torch.bfloat16 or "Output size is too small" not in str(e):
            raise
        pytest.skip(f"native's bfloat16 forward takes its slow path on this CPU and raises: {e}")
    with served(backend):
        ours = grads()
    for o, n in zip(ours, native):
        assert o.shape == n.shape and o.dtype == n.dtype and o.stride() == n.stride()
        assert torch.equal(o, n)


@parametrize_backend
def test_negative_bias_sizes_on_an_empty_call_is_named(backend):
    args = (torch.randn(0, 3, 3, 3), torch.randn(0, 2, 5, 5), torch.randn(3, 2, 3, 3), [-1], [1, 1], [0, 0],
            [1, 1], False, [0, 0], 1, [False, False, True])
    with pytest.raises(RuntimeError):
        call_native(args)
    with aten_override.enable(backend), pytest.raises(RuntimeError, match=rf"convolution_backward\[{backend}\]: bias_sizes must be non-negative"):
        _OP(*args)
