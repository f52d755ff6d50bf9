r"""``enable(...)``: route ``aten::convolution_backward`` to a backend for a block or a function.

Modelled on ``torch.nn.attention.sdpa_kernel``: saves the previous state, restores it in
``finally``, nests, and is usable as a decorator.
"""

from __future__ import annotations

import contextlib
import os
import warnings

from . import _registration
from . import autotune as _autotune
from . import compiled_graphs as _compiled_graphs
from .backends import BackendLike, implementation
from .compile_bypass import bypass_reasons

__all__ = ["enable", "install", "uninstall"]


class enable(contextlib.ContextDecorator):
    r"""Context manager (and decorator) that routes every ``aten::convolution_backward`` call on CPU
    and CUDA tensors to ``backend``.

    Args:
        backend: ``"auto"`` (default: the fastest available backend that supports the call, ending at
            ``"aten"``), ``"python"``, ``"compiled"``, ``"aten"`` (the original kernel), a
            :class:`~aten_override.Backend`, or a function with the aten signature
            ``fn(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
            output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)``.

    Semantics:
        - Nests: the innermost active ``enable`` wins; leaving it restores the outer one; leaving the
          outermost restores the original kernel: our kernel is deregistered, or, when ``enable``
          is entered and left per training step (8 times within a minute), it stays registered but
          idle, handing every call to the original kernel uncounted, so that per-step use does
          not grow upstream's dispatcher memory (:func:`aten_override.release` deregisters it;
          interpreter exit does).
        - Restores on exceptions (``KeyboardInterrupt`` too) and at interpreter exit.
        - Process-global: autograd runs CUDA backward on worker threads, so the setting is not
          thread-local. Across threads the most recently entered, still active ``enable`` wins.
          Calls never mix implementations. See :func:`install` for toggling while other threads
          run backward.
        - Calls a backend does not support fall back to the original kernel; the reason is
          recorded (:func:`aten_override.stats`, :func:`aten_override.trace`).
        - A function backend's own calls of ``aten::convolution_backward`` run the original kernel
          inside the outer call (``stats()["inner_calls"]``); an output it returns where
          ``output_mask`` is False is dropped with a once-per-process ``UserWarning`` naming it
          (see :class:`aten_override.FunctionBackend`).

        autotune: how the compiled backend picks a kernel per call signature (``"compiled"`` and
            ``"auto"`` only): ``True`` (time the candidate kernels on the first call of each
            signature, keep the fastest that matches native, native unless one beats it by 3%),
            ``False`` (the layer-class table decides), or a results-file path (tune, reading its
            valid entries on entering and writing them on leaving). ``None`` (default): the
            ``ATEN_OVERRIDE_AUTOTUNE`` environment variable (``0``, ``1`` or a path), else ``True``.
            Under ``torch.use_deterministic_algorithms(True)`` the table decides either way. See
            :mod:`aten_override.autotune`.

        compiled_graphs: whether ``torch.compile`` / AOTInductor graphs compiled while this is
            active call ``aten_override::convolution_backward`` (a custom op that reaches the
            dispatcher, hence the override, in every Inductor wrapper, ``cpp_wrapper`` and
            AOTInductor included) instead of aten's op. ``None`` (default): the
            ``ATEN_OVERRIDE_COMPILED_GRAPHS`` environment variable (``0`` turns it off), else
            ``True``. Process-global like the backend: on while any active ``enable`` has it.
            See :mod:`aten_override.compiled_graphs`.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: the backend is unavailable (e.g. compiled kernels not built), with the reason.

    Example::

        >>> with aten_override.enable("python"):
        ...     loss = model(x).sum()
        ...     loss.backward()  # every convolution's backward ran in the python backend
    """

    def __init__(
        self,
        backend: BackendLike = "auto",
        *,
        autotune: bool | str | os.PathLike | None = None,
        compiled_graphs: bool | None = None,
    ):
        self.impl = implementation(backend)
        self.autotune = _autotune.setting(autotune)
        self.compiled_graphs = _compiled_graphs.setting(compiled_graphs)
        self._autotune_previous: list[bool | None] = []
        # Tokens of one enable object are interchangeable (they push the same backend), so a plain
        # list works across threads: entered in one thread, left in another, or used as a decorator
        # concurrently. list.append / list.pop are atomic under the GIL.
        self._tokens: list[int] = []

    def __enter__(self):
        if self.compiled_graphs:
            _compiled_graphs.activate()
        try:
            for reason in bypass_reasons():
                warnings.warn(f"aten_override.enable({self.impl.name!r}): {reason}", stacklevel=2)
            self._autotune_previous.append(_autotune.apply(self.autotune) if self._tunes else None)
            try:
                self._tokens.append(_registration.push(self.impl))
            except BaseException:
                _autotune.restore(self.autotune, self._autotune_previous.pop())
                raise
        except BaseException:
            if self.compiled_graphs:
                _compiled_graphs.deactivate()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            token = self._tokens.pop()
        except IndexError:
            raise RuntimeError(f"{self!r} exited more often than entered") from None
        try:
            _registration.pop(token)
        finally:
            try:
                _autotune.restore(self.autotune, self._autotune_previous.pop())
            finally:
                if self.compiled_graphs:
                    _compiled_graphs.deactivate()

    @property
    def _tunes(self) -> bool:
        """Whether this backend's calls can reach the compiled backend's kernel choice."""
        return self.impl.name in ("compiled", "auto")

    def __repr__(self) -> str:
        return f"aten_override.enable({self.impl.name!r})"


def install() -> None:
    """Keep our kernel registered until :func:`uninstall`, even while no :class:`enable` is active
    (calls then run the original kernel at the cost of one Python call).

    With it installed, entering and leaving :class:`enable` never writes the dispatcher's table, so
    it is safe while other threads run backward. Counted: n ``install()`` need n ``uninstall()``.
    """
    _registration.pin()


def uninstall() -> None:
    """Undo one :func:`install`; with nothing else active the dispatcher is restored.

    Raises:
        RuntimeError: without a matching :func:`install`.
    """
    _registration.unpin()
