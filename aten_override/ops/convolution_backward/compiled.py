"""The compiled (C++) backend: loads the extension and describes it. Not built yet."""

from __future__ import annotations

_REASON = "compiled kernels not built"


def unavailable_reason() -> str | None:
    return _REASON


def unsupported_reason(args) -> str | None:
    return _REASON


def convolution_backward(args):
    raise RuntimeError(f"convolution_backward[compiled]: {_REASON}")
