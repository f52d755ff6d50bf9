r"""Compare a backend's ``aten::convolution_backward`` results with the original kernel's.

The contract checked, output by output (``grad_input``, ``grad_weight``, ``grad_bias``):

- a tensor where ``output_mask`` asks for one; outputs masked out are not compared (the original
  kernel itself returns some of them anyway, e.g. ``grad_weight`` of a float32 3-D call with
  ``output_mask=[True, False, True]``);
- the same dtype and shape;
- the same strides on every dim of size > 1 (the rule Inductor's ``assert_size_stride`` applies
  to fallback kernels; strides of size-1 dims carry no layout);
- values: ``max |actual - ref| <= 2 * max |native - ref| + rtol(dtype) * max(1, max |ref|)``,
  with ``ref`` the original kernel in float64 and ``native`` the original kernel in the tested
  dtype: a reduced-precision backend may be as wrong as ATen's own kernel, twice over, plus a few
  ulps of the result's scale. In float64 ``native`` is ``ref`` and this is a tight ``rtol``.
  (Tolerance relative to PyTorch's own error, as Dao-AILab/flash-attention's tests define it.)
  Module training steps (:mod:`.suite.test_modules`) apply the same rule to input grads, parameter
  grads and updated parameters, ``native`` the step run natively and ``ref`` the step in float64.

Every value comparison of the shipped suite goes through :func:`assert_close_to_reference`
(:func:`check_tensor` adds the exact dtype, shape and stride checks).

Nothing here touches the dispatcher except through :func:`aten_override.enable`.
"""

from __future__ import annotations

import contextlib
import math
import unittest
from collections.abc import Sequence

import torch
import torch.utils.deterministic

from .. import original_kernel, reset_stats, stats as backend_stats
from ..backends import ATEN_IMPL, Implementation
from ..context import enable
from ..ops.convolution_backward.args import ConvolutionBackwardArgs, canonical_call, significant_strides
from .skips import SKIPS

__all__ = [
    "OUTPUT_NAMES",
    "assert_close_to_reference",
    "call_backend",
    "call_native",
    "expected_server",
    "check_against_native",
    "check_tensor",
    "float64_reference",
    "served_by",
    "uninitialized_memory_filled",
]

OUTPUT_NAMES = ("grad_input", "grad_weight", "grad_bias")

# rtol of torch.testing.assert_close's defaults, per dtype.
_RTOL = {torch.float64: 1e-7, torch.float32: 1.3e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}

_OP = torch.ops.aten.convolution_backward.default


def call_native(aten_args: Sequence, device_type: str | None = None):
    """The original kernel (``aten_override.original_kernel``) on ``aten_args``: its dtypes, shapes
    and strides. Where a tensor has a size-1 dim with an odd stride (``args.canonical_call``), whose
    stride torch 2.13's grouped channels-last ``grad_weight`` reads, the values are the original
    kernel's on the canonical views."""
    kernel = original_kernel(device_type or aten_args[0].device.type)
    outputs = tuple(kernel(*aten_args))
    args = ConvolutionBackwardArgs(*aten_args)
    canonical = canonical_call(args)
    if canonical is args:
        return outputs
    right = kernel(*canonical.as_aten_args())
    return tuple(o if o is None or r is None else o.copy_(r) for o, r in zip(outputs, right))


def float64_reference(aten_args: Sequence):
    """The original kernel on float64 copies of ``grad_output``, ``input`` and ``weight`` (of their
    canonical views, ``args.canonical_call``)."""
    go, x, w, *rest = canonical_call(ConvolutionBackwardArgs(*aten_args)).as_aten_args()
    return call_native((go.double(), x.double(), w.double(), *rest))


def call_backend(impl: Implementation, aten_args: Sequence):
    """``torch.ops.aten.convolution_backward.default(*aten_args)`` with ``impl`` enabled: through
    the dispatcher, as a model's backward reaches it, with :func:`uninitialized_memory_filled` (an
    output the backend leaves partly unwritten reads NaN, whatever the allocator had there)."""
    with uninitialized_memory_filled(), enable(impl):
        return tuple(_OP(*aten_args))


@contextlib.contextmanager
def uninitialized_memory_filled():
    """Within the block ``torch.empty`` and every ATen allocation of uninitialised memory are filled
    with NaN (integers: their largest value): ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` with ``torch.utils.deterministic.fill_uninitialized_memory``. Upstream's
    own switch for catching reads of uninitialised memory; the previous settings are restored."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = previous[2]


def expected_server(impl: Implementation, aten_args: Sequence) -> tuple[str, str | None]:
    """The backend name that should serve ``aten_args`` under ``impl`` and, for a fallback to the
    original kernel, the reason ``impl`` gives."""
    chosen, reason = impl.select(ConvolutionBackwardArgs(*aten_args))
    return chosen.name, reason


@contextlib.contextmanager
def served_by(impl: Implementation, expected: dict[str, int] | None = None):
    """Assert, from :func:`aten_override.stats`, how the block's ``convolution_backward`` calls
    were served: exactly ``expected`` (``{backend name: calls}``, see :func:`expected_server`) when
    given, else ``impl`` served at least one. Without ``expected``, a block whose every call
    ``impl`` handed to the original kernel is skipped (``unittest.SkipTest``) with ``impl``'s
    reasons.

    Raises:
        AssertionError: naming the expected and the actual counts.
    """
    reset_stats()
    yield
    stats = backend_stats()
    if expected is not None:
        actual = {name: stats.get(name, 0) for name in expected}
        if actual != expected:
            raise AssertionError(
                f"convolution_backward calls under backend {impl.name!r}: expected {expected}, got {actual} "
                f"(all stats: {stats})"
            )
    elif stats.get(impl.name, 0) == 0:
        reasons = stats.get("fallback_reasons") or {}
        if reasons:
            raise unittest.SkipTest(
                SKIPS["all_fallback"].format(backend=impl.name, reasons="; ".join(sorted(reasons)))
            )
        raise AssertionError(f"backend {impl.name!r} served no convolution_backward call (stats: {stats})")


def check_tensor(
    actual, native: torch.Tensor, reference: torch.Tensor | None = None, *, where: str = "",
) -> None:
    """Assert one tensor ``actual`` matches ``native`` (the original kernel's, or a native step's, in
    the tested dtype) as the module docstring describes: exactly the same dtype, shape, device and
    strides of every dim of size > 1; values within the rule of :func:`assert_close_to_reference`.

    Raises:
        AssertionError: naming ``where`` and what differs.
    """
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{where}: expected a tensor, got {actual!r:.80}")
    if actual.dtype != native.dtype:
        raise AssertionError(f"{where}: dtype {actual.dtype}, original kernel gives {native.dtype}")
    if actual.shape != native.shape:
        raise AssertionError(f"{where}: shape {list(actual.shape)}, original kernel gives {list(native.shape)}")
    if actual.device != native.device:
        raise AssertionError(f"{where}: device {actual.device}, original kernel gives {native.device}")
    if significant_strides(actual) != significant_strides(native):
        raise AssertionError(
            f"{where}: strides {actual.stride()}, original kernel gives {native.stride()} (shape {list(native.shape)})"
        )
    assert_close_to_reference(actual, native, reference, where=where)


def assert_close_to_reference(
    actual: torch.Tensor, native: torch.Tensor, reference: torch.Tensor | None = None, *, where: str = "",
) -> None:
    """Assert ``max |actual - ref| <= 2 * max |native - ref| + rtol(dtype) * max(1, max |ref|)``.

    ``reference`` (``ref``) is the float64 result (:func:`float64_reference`, or a step run in
    float64); ``None`` when the call was float64 already, and then ``native`` is ``ref``. ``native``
    is the original kernel's result in ``actual``'s dtype: a backend may be as far from float64 as
    ATen itself, twice over, plus a few ulps of the result's scale (``rtol`` of
    ``torch.testing.assert_close``'s defaults for the dtype). Shapes must agree; dtypes and strides
    are not looked at (:func:`check_tensor` does).

    Raises:
        AssertionError: ``torch.testing.assert_close``'s report, the bound and ``where``.
    """
    if actual.numel() == 0:
        return
    r = (native if reference is None else reference).double()
    native_error = (native.double() - r).abs().max().item()
    if not math.isfinite(native_error):
        # the original kernel's result is garbage (NaN / inf where float64 is finite: torch 2.13's
        # oneDNN bfloat16 paths that leave outputs unwritten): judge against float64 alone
        native_error = 0.0
    scale = max(1.0, r.abs().max().item())
    atol = 2 * native_error + _RTOL.get(actual.dtype, 1e-7) * scale
    torch.testing.assert_close(
        actual.double(),
        r,
        rtol=0,
        atol=atol,
        msg=lambda m: f"{where}: {m}\n(bound: 2 x original kernel's error {native_error:.3g} vs float64 "
        f"+ rtol x scale {scale:.3g}; dtype {actual.dtype})",
    )


def check_against_native(
    actual: Sequence, native: Sequence, reference: Sequence | None = None, *,
    output_mask: Sequence[bool] = (True, True, True), where: str = "", masked_must_be_none: bool = True,
) -> None:
    """Assert ``actual`` (a backend's 3 outputs) matches ``native`` (the original kernel's) as the
    module docstring describes (:func:`check_tensor` per output). ``reference`` is
    :func:`float64_reference`'s result; ``None`` when the call was float64 already. Masked-out
    outputs must be ``None`` unless ``masked_must_be_none`` is False (for the original kernel
    itself: its oneDNN path returns a ``grad_weight`` for ``output_mask=[*, False, True]``).

    Raises:
        AssertionError: naming the output (``grad_weight``), what differs and ``where``.
    """
    reference = (None, None, None) if reference is None else reference
    if len(actual) != 3:
        raise AssertionError(f"{where}: expected 3 outputs, got {len(actual)}")
    for name, wanted, a, n, r in zip(OUTPUT_NAMES, output_mask, actual, native, reference):
        prefix = f"{where}{': ' if where else ''}{name}"
        if not wanted:
            if masked_must_be_none and a is not None:
                raise AssertionError(f"{prefix}: output_mask leaves it out, so it must be None, got a tensor")
            continue
        if not isinstance(a, torch.Tensor):
            raise AssertionError(f"{prefix}: output_mask asks for it, got {a!r:.80}")
        check_tensor(a, n, r, where=prefix)


def compare_with_native(impl: Implementation, aten_args: Sequence, *, where: str = "") -> None:
    """Run ``aten_args`` through ``impl`` and through the original kernel and assert they agree
    (:func:`check_against_native`, float64 reference for reduced precision)."""
    server, _ = expected_server(impl, aten_args)
    actual = call_backend(impl, aten_args)
    native = call_native(aten_args)
    reference = None if aten_args[0].dtype == torch.float64 else float64_reference(aten_args)
    check_against_native(
        actual, native, reference, output_mask=aten_args[-1], where=where,
        masked_must_be_none=server != ATEN_IMPL.name,
    )
