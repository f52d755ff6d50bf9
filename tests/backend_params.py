r"""Shared by tests/integration and tests/robustness: the backends under test and proof that one ran.

``BACKENDS`` is every built-in backend available in this process except ``aten`` (the reference)
and ``auto`` (a policy, not an implementation): ``python`` always, ``compiled`` once its extension
is built. Tests parametrize over it and end with :func:`served`'s check that the backend really
served the calls (``aten_override.stats()``), so a test cannot pass on the original kernel alone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aten_override
from aten_override import _registration

REPO = Path(__file__).resolve().parents[1]

BACKENDS = [b for b, reason in aten_override.availability().items() if reason is None and b not in ("aten", "auto")]

parametrize_backend = pytest.mark.parametrize("backend", BACKENDS)


def calls(backend: str) -> int:
    """Calls ``backend`` served since the last ``aten_override.reset_stats()``."""
    return int(aten_override.stats().get(backend, 0))


@contextlib.contextmanager
def served(backend: str, *, min_calls: int = 1, allow_fallback: bool = False):
    """``enable(backend)`` for the block, then assert it served at least ``min_calls`` calls (and,
    unless ``allow_fallback``, that none fell back to the original kernel). Yields the stats dict,
    filled in on exit."""
    result: dict = {}
    aten_override.reset_stats()
    with aten_override.enable(backend):
        yield result
    result.update(aten_override.stats())
    assert result.get(backend, 0) >= min_calls, f"backend {backend!r} served too few calls: {result}"
    if not allow_fallback:
        assert result.get("fallback", 0) == 0, f"unexpected fallbacks to aten: {result}"


def assert_dispatcher_native() -> None:
    """Nothing of ours is registered and the dispatcher table does not mention _registration.py."""
    assert not aten_override.is_registered()
    assert aten_override.active_backend() is None
    assert _registration.__file__ not in torch._C._dispatch_dump("aten::convolution_backward")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child interpreter that imports this checkout's ``aten_override``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_python(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run ``python args…`` in a child interpreter (this interpreter's executable), capturing text."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**env),
        cwd=REPO,
    )
