r"""pytest plugin: run a whole test session with a backend serving ``aten::convolution_backward``.

::

    pytest --aten-override=python tests/        # your model's tests, our backward, unchanged
    pytest --aten-override=my_pkg.conv:backward tests/   # your own backend (module:function)

Installed with the package (entry point ``pytest11: aten_override``); without the option it
changes nothing and does not import torch. With it, the backend is enabled from configuration to
the end of the session (:func:`aten_override.enable`), the header names it, and the terminal
summary reports how many calls each backend served and why any fell back to the original kernel.

Raises:
    pytest.UsageError: unknown or unavailable backend, or a ``module:function`` that does not
        import.
"""

from __future__ import annotations

import pytest

_ENABLED = pytest.StashKey[object]()
_MARKERS = (
    "slow: long-running; excluded from the CI profile (-m 'not slow')",
    "cuda: needs a CUDA device",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aten_override", "aten_override: replace aten::convolution_backward")
    group.addoption(
        "--aten-override",
        metavar="BACKEND",
        default=None,
        help="serve every aten::convolution_backward call of the session with BACKEND: "
        "auto, python, compiled, aten, or module:function (a function with the aten signature)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for marker in _MARKERS:
        config.addinivalue_line("markers", marker)
    spec = config.getoption("aten_override", default=None)
    if not spec:
        return
    import aten_override
    from aten_override.testing.selection import backend_from_spec

    try:
        impl = backend_from_spec(spec)
    except (ValueError, RuntimeError, ImportError) as e:
        raise pytest.UsageError(f"--aten-override={spec}: {e}") from e
    context = aten_override.enable(impl)
    context.__enter__()
    config.stash[_ENABLED] = context
    aten_override.reset_stats()


def pytest_unconfigure(config: pytest.Config) -> None:
    context = config.stash.get(_ENABLED, None)
    if context is not None:
        del config.stash[_ENABLED]
        context.__exit__(None, None, None)


def pytest_report_header(config: pytest.Config) -> str | None:
    context = config.stash.get(_ENABLED, None)
    if context is None:
        return None
    return f"aten_override: aten::convolution_backward served by backend {context.impl.name!r} (--aten-override)"


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    context = config.stash.get(_ENABLED, None)
    if context is None:
        return
    import aten_override

    stats = aten_override.stats()
    reasons = stats.pop("fallback_reasons", {})
    terminalreporter.section("aten_override")
    served = ", ".join(f"{name}: {n}" for name, n in sorted(stats.items())) or "none"
    terminalreporter.write_line(f"convolution_backward calls under {context.impl.name!r}: {served}")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  fell back to the original kernel {n}x: {reason}")
