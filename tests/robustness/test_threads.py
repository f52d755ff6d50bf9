r"""Threads: backward in worker threads while another thread enters and leaves ``enable()``.

The stress itself is tests/robustness/thread_stress.py, run in a child interpreter so that a
dispatcher crash shows as an exit status. Checked for every call: it was served wholly by one
implementation (its gradients equal bitwise the native result or the backend's, never a mix), and
the calls counted by ``aten_override.stats()`` are exactly those classified as the backend's. At the
end the dispatcher is native again.

Modes (see aten_override/_registration.py, "Threads"):

- ``pinned``: ``aten_override.install()`` held; toggling only flips the active backend. Documented
  safe; tested in the CI profile.
- ``unpinned`` (the default): every outermost enter/exit registers/deregisters a kernel while other
  threads dispatch through the op without a lock (upstream's design, pytorch#8713). Observed on
  torch 2.13.0+cpu: worker threads intermittently die with
  ``RuntimeError: interpreter == pyinterpreter_ INTERNAL ASSERT FAILED at c10/core/SafePyObject.cpp:6``
  or with our ``with_keyset`` kernel called without its keyset (``AttributeError: 'Tensor' object
  has no attribute 'has'``, ``TypeError: ConvolutionBackwardArgs.__init__() missing 1 required
  positional argument: 'output_mask'``): the dispatcher read a kernel entry being destroyed. torch.library alone
  reproduces it (tests/robustness/repro_register_race.py). Those errors are reported as xfail; a
  mixed result, a wrong value or a dead process fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..backend_params import parametrize_backend, run_python

SCRIPT = Path(__file__).with_name("thread_stress.py")
UNPINNED_RACE_SIGNATURES = (
    "SafePyObject.cpp",
    "object has no attribute 'has'",
    "missing 1 required positional argument: 'output_mask'",
)


def _stress(backend: str, mode: str, toggles: int, togglers: int = 1) -> dict:
    proc = run_python(
        [str(SCRIPT), "--backend", backend, "--mode", mode, "--toggles", str(toggles), "--togglers", str(togglers)],
        timeout=300,
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Aborted" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_common(r: dict, backend: str) -> None:
    assert r["counts"]["mixed"] == 0 and r["counts"]["other"] == 0, r
    assert r["counts"]["native"] > 0 and r["counts"]["backend"] > 0, f"the workers did not see both states: {r}"
    assert r["registered"] is False and r["active"] is None and r["dump_mentions_us"] is False, r
    assert r["after"] == "native", r


@parametrize_backend
@pytest.mark.parametrize("togglers", [1, 2], ids=lambda n: f"togglers={n}")
def test_toggle_while_other_threads_run_backward_pinned(backend, togglers):
    """``togglers`` threads share one ``enable`` object and enter/leave it while 3 threads run backward."""
    r = _stress(backend, "pinned", toggles=1500 // togglers, togglers=togglers)
    assert r["errors"] == [], r
    _check_common(r, backend)
    # Pinned, every call goes through our kernel: the counts add up exactly.
    assert r["stats"][backend] == r["counts"]["backend"], r
    assert r["stats"]["aten"] == r["counts"]["native"], r
    _check_togglers(r, togglers)
    _skip_if_mix_undetectable(r, backend)


def _check_togglers(r: dict, togglers: int) -> None:
    inside = sum(r["toggler"]["inside"].values())
    assert r["toggler"]["inside"] == {"backend": inside}, r  # inside any block the backend serves
    if togglers == 1:  # outside the only block nothing is enabled
        assert r["toggler"]["outside"] == {"native": sum(r["toggler"]["outside"].values())}, r


def _skip_if_mix_undetectable(r: dict, backend: str) -> None:
    """A mix is only visible if native and the backend differ bitwise in two or more gradients (the
    python backend differs in grad_weight and grad_bias here); a backend bitwise equal to native
    passed every other check but this one cannot be made."""
    if sum(r["differs"]) < 2:
        pytest.skip(f"{backend} equals native bitwise in {3 - sum(r['differs'])} of 3 gradients: a mix is undetectable")


@pytest.mark.slow
@parametrize_backend
def test_toggle_while_other_threads_run_backward_unpinned(backend):
    r = _stress(backend, "unpinned", toggles=3000)
    _check_common(r, backend)
    known = [e for e in r["errors"] if any(s in e for s in UNPINNED_RACE_SIGNATURES)]
    assert known == r["errors"], f"unexpected worker errors: {r['errors']}"
    if known:
        pytest.xfail(f"unpinned toggling races with concurrent dispatch (see module docstring): {known[0]}")
    # Unpinned, native calls never reach us; every call the backend served was classified as its.
    assert r["stats"][backend] == r["counts"]["backend"], r
    _check_togglers(r, 1)
    _skip_if_mix_undetectable(r, backend)
