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

Nothing here touches the dispatcher except through :func:`aten_override.enable`.
"""

from __future__ import annotations

import contextlib
import unittest
from collections.abc import Sequence

import torch

from .. import original_kernel, reset_stats, stats as backend_stats
from ..backends import ATEN_IMPL, Implementation
from ..context import enable
from ..ops.convolution_backward.args import ConvolutionBackwardArgs
from .skips import SKIPS

__all__ = [
    "OUTPUT_NAMES",
    "call_backend",
    "call_native",
    "expected_server",
    "check_against_native",
    "float64_reference",
    "served_by",
]

OUTPUT_NAMES = ("grad_input", "grad_weight", "grad_bias")

# rtol of torch.testing.assert_close's defaults, per dtype.
_RTOL = {torch.float64: 1e-7, torch.float32: 1.3e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}

_OP = torch.ops.aten.convolution_backward.default


def call_native(aten_args: Sequence, device_type: str | None = None):
    """The original kernel (``aten_override.original_kernel``) on ``aten_args``."""
    device_type = device_type or aten_args[0].device.type
    return tuple(original_kernel(device_type)(*aten_args))


def float64_reference(aten_args: Sequence):
    """The original kernel on float64 copies of ``grad_output``, ``input`` and ``weight``."""
    go, x, w, *rest = aten_args
    return call_native((go.double(), x.double(), w.double(), *rest))


def call_backend(impl: Implementation, aten_args: Sequence):
    """``torch.ops.aten.convolution_backward.default(*aten_args)`` with ``impl`` enabled: through
    the dispatcher, as a model's backward reaches it."""
    with enable(impl):
        return tuple(_OP(*aten_args))


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


def significant_strides(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``(dim, stride)`` for every dim of size > 1."""
    return tuple((d, s) for d, (n, s) in enumerate(zip(t.shape, t.stride())) if n > 1)


def check_against_native(
    actual: Sequence, native: Sequence, reference: Sequence | None = None, *,
    output_mask: Sequence[bool] = (True, True, True), where: str = "", masked_must_be_none: bool = True,
) -> None:
    """Assert ``actual`` (a backend's 3 outputs) matches ``native`` (the original kernel's) as the
    module docstring describes. ``reference`` is :func:`float64_reference`'s result; ``None`` when
    the call was float64 already. Masked-out outputs must be ``None`` unless
    ``masked_must_be_none`` is False (for the original kernel itself: its oneDNN path returns a
    ``grad_weight`` for ``output_mask=[*, False, True]``).

    Raises:
        AssertionError: naming the output (``grad_weight``), what differs and ``where``.
    """
    reference = native if reference is None else reference
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
        if a.dtype != n.dtype:
            raise AssertionError(f"{prefix}: dtype {a.dtype}, original kernel gives {n.dtype}")
        if a.shape != n.shape:
            raise AssertionError(f"{prefix}: shape {list(a.shape)}, original kernel gives {list(n.shape)}")
        if a.device != n.device:
            raise AssertionError(f"{prefix}: device {a.device}, original kernel gives {n.device}")
        if significant_strides(a) != significant_strides(n):
            raise AssertionError(
                f"{prefix}: strides {a.stride()}, original kernel gives {n.stride()} (shape {list(n.shape)})"
            )
        if a.numel() == 0:
            continue
        r = r.double()
        native_error = (n.double() - r).abs().max().item()
        scale = max(1.0, r.abs().max().item())
        atol = 2 * native_error + _RTOL.get(a.dtype, 1e-7) * scale
        torch.testing.assert_close(
            a.double(),
            r,
            rtol=0,
            atol=atol,
            msg=lambda m: f"{prefix}: {m}\n(bound: 2 x original kernel's error {native_error:.3g} vs float64 "
            f"+ rtol x scale {scale:.3g}; dtype {a.dtype})",
        )


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
