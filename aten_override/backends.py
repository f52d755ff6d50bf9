r"""Backends of ``aten::convolution_backward``: the :class:`Backend` enum and the implementations.

A backend says what it supports as data: :meth:`Implementation.unavailable_reason` (the backend as
a whole, e.g. the compiled extension is not built) and :meth:`Implementation.unsupported_reason`
(one call, e.g. an integer dtype). A call a backend does not serve falls back to the original ATen
kernel with that reason recorded. ``AUTO`` walks :data:`AUTO_PRIORITY` and always ends at ``ATEN``.

Nothing here touches the dispatcher; :mod:`aten_override._registration` does.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from typing import Union

import torch

from .ops.convolution_backward import python_impl
from .ops.convolution_backward.args import ConvolutionBackwardArgs, check_args

__all__ = [
    "Backend",
    "Implementation",
    "AUTO_PRIORITY",
    "resolve",
    "implementation",
    "availability",
]


class Backend(str, enum.Enum):
    """Which implementation serves ``aten::convolution_backward``. Plain strings work too."""

    AUTO = "auto"
    """The first available backend of :data:`AUTO_PRIORITY` that supports the call."""
    ATEN = "aten"
    """The original ATen kernel, captured with ``torch.library.get_kernel`` before overriding."""
    PYTHON = "python"
    """:mod:`aten_override.ops.convolution_backward.python_impl`, built from other ATen ops."""
    COMPILED = "compiled"
    """The C++ extension (:mod:`aten_override.ops.convolution_backward.compiled`)."""

    def __str__(self) -> str:
        return self.value


class Implementation:
    """One backend. Subclasses set :attr:`name` and implement :meth:`__call__`.

    ``__call__(args)`` returns ``(grad_input, grad_weight, grad_bias)`` with ``None`` where
    ``args.output_mask`` is False, and raises ``RuntimeError`` for invalid arguments.
    """

    name: str = "?"
    is_aten: bool = False

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot be used at all in this process, or ``None``."""
        return None

    def unsupported_reason(self, args: ConvolutionBackwardArgs) -> str | None:
        """Why this call goes to the original kernel instead, or ``None`` when served."""
        return None

    def select(self, args: ConvolutionBackwardArgs) -> tuple[Implementation, str | None]:
        """The implementation that serves ``args`` and, if it is the original kernel, why."""
        reason = self.unsupported_reason(args)
        return (ATEN_IMPL, reason) if reason is not None else (self, None)

    def __call__(self, args: ConvolutionBackwardArgs):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<aten_override backend {self.name!r}>"


class _Aten(Implementation):
    """Marker for the original kernel; :mod:`._registration` calls it with the dispatch keyset."""

    name = Backend.ATEN.value
    is_aten = True


class _Python(Implementation):
    name = Backend.PYTHON.value

    def unsupported_reason(self, args):
        return python_impl.unsupported_reason(args)

    def __call__(self, args):
        return python_impl.convolution_backward(args)


class _Compiled(Implementation):
    name = Backend.COMPILED.value

    def _module(self):
        from .ops.convolution_backward import compiled

        return compiled

    def unavailable_reason(self):
        return self._module().unavailable_reason()

    def unsupported_reason(self, args):
        return self._module().unsupported_reason(args)

    def __call__(self, args):
        return self._module().convolution_backward(args)


class FunctionBackend(Implementation):
    """A user's own backend: a function with the aten signature

    ``fn(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)``.

    Arguments are validated (:func:`check_args`) before ``fn`` sees them, and its result is checked
    for the right ``None`` pattern, shapes and dtypes.

    An output ``fn`` returns although its ``output_mask`` entry is False is dropped (``None`` goes to
    autograd) with a ``UserWarning`` naming ``fn``, once per process and function: the original
    kernel itself returns such a ``grad_weight`` on its oneDNN path, so a function delegating to
    ``torch.ops.aten.convolution_backward`` does too. With ``strict=True`` (the test bed:
    ``python -m aten_override test --backend module:function``, ``pytest --aten-override``) it is a
    ``RuntimeError`` instead, whose message says why: a backend should not compute what was not asked.

    Args:
        fn: the function.
        name: the backend's name in :func:`aten_override.stats`, traces and errors (default:
            ``fn.__name__``).
        strict: raise instead of dropping masked-out outputs.
    """

    def __init__(self, fn: Callable, name: str | None = None, *, strict: bool = False):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "custom")
        self.strict = strict

    def __call__(self, args):
        check_args(args, self.name)
        result = self.fn(*args.as_aten_args())
        return _check_result(args, result, self.name, strict=self.strict, fn=self.fn)


_warned_masked: set = set()


def _warn_masked(fn, backend: str, name: str, i: int) -> None:
    key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", backend))
    if key in _warned_masked:
        return
    _warned_masked.add(key)
    qualname = ".".join(k for k in key if k)
    warnings.warn(
        f"convolution_backward[{backend}]: {qualname} returned a {name} although output_mask[{i}] is False; "
        "it is dropped (None goes to autograd). Return None for masked-out outputs "
        "(the original kernel's oneDNN path computes one anyway). Warned once per process.",
        UserWarning,
        stacklevel=2,
    )


def _check_result(args: ConvolutionBackwardArgs, result, backend: str, *, strict: bool = True, fn=None) -> tuple:
    """The backend's result as a tuple, after checking the schema's contract: three outputs, the
    ``None`` pattern of ``output_mask``, shapes (``grad_bias``: ``(C_out,)``, or ``bias_sizes`` for
    an empty batch), dtype and device.

    A tensor where ``output_mask`` is False raises with ``strict``, else it is dropped (once-per-process
    warning naming ``fn``).

    Raises:
        RuntimeError: naming the backend, the output and the offending value.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        got = f"a {type(result).__name__} of {len(result)} outputs" if isinstance(result, (tuple, list)) else type(result).__name__
        raise RuntimeError(
            f"convolution_backward[{backend}]: expected a tuple of 3 outputs (grad_input, grad_weight, grad_bias), got {got}"
        )
    result = tuple(result)
    # C_out from weight: after check_args it is grad_output.size(1), except on an empty call, where
    # grad_output may have 0 channels (the zero-channel forward drops the bias).
    bias_shapes = [[args.c_out]]
    if args.bias_sizes is not None and [int(s) for s in args.bias_sizes] not in bias_shapes:
        bias_shapes.append([int(s) for s in args.bias_sizes])
    expected = ([list(args.input.shape)], [list(args.weight.shape)], bias_shapes)
    # dtypes as upstream's: an empty call (where the dtypes may differ) gives zeros like input and weight.
    dtypes = (args.input.dtype, args.weight.dtype, args.weight.dtype)
    for i, (name, t, shapes, dtype) in enumerate(zip(("grad_input", "grad_weight", "grad_bias"), result, expected, dtypes)):
        where = f"convolution_backward[{backend}]: {name}"
        if not args.output_mask[i]:
            if t is not None:
                if strict:
                    raise RuntimeError(
                        f"{where} must be None when output_mask[{i}] is False (a backend must not return what was not "
                        "asked for; enable(function) drops it with a warning, the test bed fails it so that a backend "
                        "ignoring output_mask is caught)"
                    )
                _warn_masked(fn, backend, name, i)
                result = result[:i] + (None,) + result[i + 1 :]
            continue
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"{where} is {type(t).__name__}, expected a Tensor")
        if list(t.shape) not in shapes:
            raise RuntimeError(f"{where} has shape {list(t.shape)}, expected {' or '.join(map(str, shapes))}")
        if t.dtype != dtype:
            raise RuntimeError(f"{where} has dtype {t.dtype}, expected {dtype}")
        if t.device != args.grad_output.device:
            raise RuntimeError(f"{where} is on {t.device}, expected {args.grad_output.device}")
    return result


ATEN_IMPL = _Aten()
_IMPLS: dict[Backend, Implementation] = {
    Backend.ATEN: ATEN_IMPL,
    Backend.PYTHON: _Python(),
    Backend.COMPILED: _Compiled(),
}

AUTO_PRIORITY: tuple[Backend, ...] = (Backend.COMPILED, Backend.ATEN)
"""``AUTO`` tries these in order; the compiled backend itself hands layer classes where native ATen
is at the hardware limit back to ATen."""


class _Auto(Implementation):
    name = Backend.AUTO.value

    def select(self, args):
        reasons = []
        for backend in AUTO_PRIORITY:
            impl = _IMPLS[backend]
            if impl.is_aten:
                break
            reason = impl.unavailable_reason() or impl.unsupported_reason(args)
            if reason is None:
                return impl, None
            reasons.append(f"{backend.value}: {reason}")
        return ATEN_IMPL, "; ".join(reasons) or None


_AUTO = _Auto()

BackendLike = Union[Backend, str, Implementation, Callable]


def implementation(backend: BackendLike) -> Implementation:
    """The :class:`Implementation` for ``backend``: a :class:`Backend`, its string, an
    :class:`Implementation`, or a function with the aten signature (wrapped in
    :class:`FunctionBackend`).

    Raises:
        ValueError: for an unknown backend name.
        RuntimeError: if the backend is unavailable in this process, with the reason.
    """
    if isinstance(backend, Implementation):
        impl = backend
    elif isinstance(backend, str):
        try:
            key = Backend(backend.lower())
        except ValueError:
            names = ", ".join(repr(b.value) for b in Backend)
            raise ValueError(f"aten_override: unknown backend {backend!r}; expected one of {names}") from None
        impl = _AUTO if key is Backend.AUTO else _IMPLS[key]
    elif callable(backend):
        impl = FunctionBackend(backend)
    else:
        raise TypeError(f"aten_override: backend must be a Backend, a str or a function, got {type(backend).__name__}")
    reason = impl.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"aten_override: backend {impl.name!r} is unavailable: {reason}")
    return impl


resolve = implementation


def availability() -> dict[str, str | None]:
    """``{backend name: None if available else the reason}`` for every built-in backend."""
    out: dict[str, str | None] = {}
    for backend in Backend:
        impl = _AUTO if backend is Backend.AUTO else _IMPLS[backend]
        try:
            out[backend.value] = impl.unavailable_reason()
        except Exception as e:  # a broken extension must not break `info`
            out[backend.value] = f"{type(e).__name__}: {e}"
    return out
