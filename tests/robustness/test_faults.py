r"""Faults: a raising backend, ``KeyboardInterrupt`` during backward, interpreter exit while enabled.

- An exception raised inside a backend reaches the caller (direct op call and ``backward()``) with
  the note ``_registration`` adds (``aten_override: raised by backend … serving
  aten::convolution_backward``), and the next call, under any backend, works.
- ``KeyboardInterrupt`` during backward (raised by a backend, or a real SIGINT to a process training
  under ``enable``) propagates, and leaving ``enable`` restores the dispatcher.
- Exiting the interpreter while enabled (``enable`` entered and never left, ``install()`` held, a
  daemon thread still running backward) exits with status 0 and no abort or "Exception ignored"
  message; the ``atexit`` hook deregisters.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import aten_override

from ..backend_params import assert_dispatcher_native, parametrize_backend, run_python, served, subprocess_env

NOTE = "aten_override: raised by backend {name!r} serving aten::convolution_backward; the dispatcher is unchanged"


def _problem():
    # float64: these tests are about the lifecycle, and compare with native's gradients exactly
    # enough that any backend's summation order passes (float32 would need per-backend tolerances).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    return x, w


def _loss(x, w):
    return torch.nn.functional.conv2d(x, w, padding=1).square().sum()


class Boom(Exception):
    pass


def boom(*aten_args):
    raise Boom("backend failed on purpose")


def interrupt(*aten_args):
    raise KeyboardInterrupt


@parametrize_backend
def test_exception_in_backend_surfaces_with_note_then_next_call_works(backend):
    x, w = _problem()
    expected = torch.autograd.grad(_loss(x, w), (x, w))
    with aten_override.enable(boom):
        # Through autograd: the engine rethrows the backend's exception, note included.
        with pytest.raises(Boom, match="backend failed on purpose") as info:
            _loss(x, w).backward()
        assert NOTE.format(name="boom") in getattr(info.value, "__notes__", [])
        # Directly: same.
        args = (torch.ones(2, 4, 8, 8, dtype=torch.float64), x.detach(), w.detach(), None, [1], [1], [1], False, [0], 1, [True, True, False])
        with pytest.raises(Boom) as info:
            torch.ops.aten.convolution_backward.default(*args)
        assert NOTE.format(name="boom") in info.value.__notes__
        assert aten_override.is_registered()  # still enabled: the failure changed nothing
    assert_dispatcher_native()
    x.grad = w.grad = None
    with served(backend, min_calls=1):
        got = torch.autograd.grad(_loss(x, w), (x, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@parametrize_backend
def test_exception_in_nested_backend_restores_outer(backend):
    """A backend raising inside an inner ``enable`` leaves the outer backend active and working."""
    x, w = _problem()
    with served(backend, min_calls=1):
        with pytest.raises(Boom):
            with aten_override.enable(boom):
                _loss(x, w).backward()
        assert aten_override.active_backend() == backend
        _loss(x, w).backward()
    assert_dispatcher_native()


def test_keyboard_interrupt_in_backend_during_backward_restores_dispatcher():
    x, w = _problem()
    with pytest.raises(KeyboardInterrupt):
        with aten_override.enable(interrupt):
            _loss(x, w).backward()
    assert_dispatcher_native()
    _loss(x, w).backward()  # native again, and working
    assert w.grad is not None


_SIGINT_SCRIPT = textwrap.dedent("""
    import sys, torch, aten_override
    torch.set_num_threads(1)
    backend = sys.argv[1]
    x = torch.randn(8, 8, 32, 32, requires_grad=True)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    aten_override.reset_stats()
    try:
        with aten_override.enable(backend):
            conv(x).sum().backward()  # one served call before "ready": served>0 however loaded the machine
            print("ready", flush=True)
            while True:
                conv(x).sum().backward()
    except KeyboardInterrupt:
        restored = not aten_override.is_registered() and aten_override.active_backend() is None
        clean = aten_override._registration.__file__ not in torch._C._dispatch_dump("aten::convolution_backward")
        served = aten_override.stats().get(backend, 0)
        conv(x).sum().backward()  # native still works
        print(f"interrupted restored={restored} clean={clean} served={served > 0}", flush=True)
""")


@parametrize_backend
@pytest.mark.usefixtures("sigint_delivered")
def test_sigint_during_training_restores_dispatcher(backend):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGINT_SCRIPT, backend],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(0.5)  # interrupt in the middle of later backward passes
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == "interrupted restored=True clean=True served=True", (out, err)


_EXIT_SCRIPTS = {
    "enable entered, never left": """
        ctx = aten_override.enable(backend); ctx.__enter__()
        train()
    """,
    "install held": """
        aten_override.install()
        with aten_override.enable(backend):
            train()
    """,
    "sys.exit inside enable": """
        with aten_override.enable(backend):
            train()
            sys.exit(0)
    """,
}


_PRELUDE = textwrap.dedent("""
    import sys, torch, aten_override
    backend = sys.argv[1]
    def train():
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        torch.nn.Conv2d(3, 4, 3)(x).sum().backward()
    aten_override.reset_stats()
""")


@parametrize_backend
@pytest.mark.parametrize("case", list(_EXIT_SCRIPTS))
def test_interpreter_exit_while_enabled_is_clean(backend, case):
    script = _PRELUDE + textwrap.dedent(_EXIT_SCRIPTS[case]) + textwrap.dedent("""
        assert aten_override.stats().get(backend, 0) >= 1, aten_override.stats()
        print("exiting", flush=True)
    """)
    proc = run_python(["-c", script, backend], timeout=60)
    assert proc.returncode == 0, proc.stderr
    if case != "sys.exit inside enable":
        assert proc.stdout.strip() == "exiting"
    for bad in ("Exception ignored", "terminate called", "Aborted", "Segmentation fault", "Traceback"):
        assert bad not in proc.stderr, proc.stderr


_DAEMON_SCRIPT = _PRELUDE + textwrap.dedent("""
    import threading, time
    if backend != "native":
        aten_override.enable(backend).__enter__()
    train()
    threading.Thread(target=lambda: [train() for _ in iter(int, 1)], daemon=True).start()
    time.sleep(0.2)
    print("exiting", flush=True)
""")


@pytest.mark.slow
@parametrize_backend
def test_exit_with_daemon_thread_in_backward_matches_upstream(backend):
    """Exiting while a daemon thread runs backward: upstream itself aborts on torch 2.13 (``terminate
    called without an active exception``, SIGABRT: the autograd engine's thread is torn down
    mid-call), with or without the override. The override must not make it different."""
    native = run_python(["-c", _DAEMON_SCRIPT, "native"], timeout=60)
    ours = run_python(["-c", _DAEMON_SCRIPT, backend], timeout=60)
    assert (ours.returncode, ours.stdout, ours.stderr.strip()) == (native.returncode, native.stdout, native.stderr.strip())
