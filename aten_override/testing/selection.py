r"""Which backends the shipped test suite runs, and user backends given as ``module:function``.

The suite runs every backend :func:`aten_override.availability` reports available (``aten``, the
original kernel, is the control), or those named in the environment variable
:data:`BACKENDS_ENV` (comma-separated), which ``python -m aten_override test --backend`` sets.
A name may be a built-in backend or ``module:function``: a function with the aten signature that
:class:`aten_override.FunctionBackend` wraps with ``strict=True`` (its arguments are validated before
it runs and its results are checked; an output returned where ``output_mask`` is False is an error
here, not dropped as under ``enable(fn)``).

This module imports only :mod:`aten_override`, so the pytest plugin can use it cheaply.
"""

from __future__ import annotations

import importlib
import os
import re

from ..backends import Backend, FunctionBackend, Implementation, availability, implementation

__all__ = ["BACKENDS_ENV", "FUZZ_ENV", "backend_from_spec", "backends_under_test", "test_name"]

BACKENDS_ENV = "ATEN_OVERRIDE_TEST_BACKENDS"
FUZZ_ENV = "ATEN_OVERRIDE_FUZZ_EXAMPLES"
"""Examples per fuzz test (``python -m aten_override test --fuzz N``); unset: the CI profile."""


def backend_from_spec(spec: str, *, strict: bool = True) -> Implementation:
    """The :class:`~aten_override.Implementation` for ``spec``: a built-in backend name
    (``"python"``, ``"aten"``, …) or ``"package.module:function"``.

    ``strict`` (the test bed, the pytest plugin): a function's output returned where ``output_mask``
    is False fails the call; ``strict=False`` (``python -m aten_override run``) drops it with a
    warning, as ``enable(function)`` does.

    Raises:
        ValueError: ``spec`` is neither a backend name nor ``module:function``, or the module has
            no such function.
        ImportError: the module cannot be imported.
        RuntimeError: the backend is unavailable in this process, with the reason.
    """
    spec = spec.strip()
    if ":" not in spec:
        return implementation(spec)
    module_name, _, function_name = spec.partition(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise ValueError(f"aten_override: {spec!r}: module {module_name!r} has no function {function_name!r}")
    impl = FunctionBackend(fn, name=function_name, strict=strict)
    impl.spec = spec  # lets a fuzz reproduction import it
    return impl


def backends_under_test() -> list[Implementation]:
    """The backends the suite parametrizes over: :data:`BACKENDS_ENV` if set, else every available
    built-in backend but ``auto`` (which only chooses among the others)."""
    specs = os.environ.get(BACKENDS_ENV, "").strip()
    if specs:
        return [backend_from_spec(s) for s in specs.split(",") if s.strip()]
    return [
        implementation(name)
        for name, reason in availability().items()
        if reason is None and name != Backend.AUTO.value
    ]


def test_name(impl: Implementation) -> str:
    """The backend's part of a test name: an identifier (``python``, ``my_conv_backward``)."""
    return re.sub(r"\W", "_", impl.name)


test_name.__test__ = False  # not a pytest test
