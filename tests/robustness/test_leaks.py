r"""Leaks: 10,000 ``enable()`` enter/exit cycles and 10,000 calls under a backend leave the process's
resident memory (``/proc/self/statm``; psutil is not installed), Python's objects and the
dispatcher's registrations of ``aten::convolution_backward`` (``torch._C._dispatch_dump``) as they
were.

Measured on torch 2.13.0+cpu, upstream itself keeps ~55 bytes of native memory per
``torch.library.Library`` created and destroyed, and per ``torch.library.get_kernel`` call (a loop of
bare ``Library("aten", "IMPL")._destroy()`` grows RSS by ~0.55 MB per 10,000). An unpinned
``enable()`` cycle registers (one Library, two ``get_kernel``) and deregisters, ~210 bytes a cycle
all told; with ``aten_override.install()`` held, cycles write nothing and keep nothing. The budget
below (:data:`NATIVE_BYTES_PER_REGISTRATION`) admits that upstream cost and nothing of ours: a
leaked ``Library`` or kernel closure would also show in the Python object census, which must not
grow at all.
"""

from __future__ import annotations

import collections
import gc
import os
import weakref

import pytest
import torch

import aten_override

from ..backend_params import assert_dispatcher_native, parametrize_backend

CYCLES = CALLS = 10_000
WARMUP = 500
NATIVE_BYTES_PER_REGISTRATION = 512  # upstream's ~210 measured; see the module docstring
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def census() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a loaded 2-core machine OpenMP spinning makes tiny convs 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _snapshot():
    return {
        "dump": torch._C._dispatch_dump("aten::convolution_backward"),
        "finalizers": len(weakref.finalize._registry),
        "census": census(),
    }


def _assert_same(before, after, allowed_growth: int = 0):
    assert after["dump"] == before["dump"]
    assert after["finalizers"] == before["finalizers"]
    grown = {k: after["census"][k] - before["census"][k] for k in after["census"]}
    grown = {k: v for k, v in grown.items() if v > allowed_growth}
    assert not grown, f"Python objects grew: {grown}"


def _cycles(backend, n):
    for _ in range(n):
        with aten_override.enable(backend):
            pass


@parametrize_backend
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
def test_enable_exit_cycles(backend, pinned):
    if pinned:
        aten_override.install()
    try:
        _cycles(backend, WARMUP)
        before, rss0 = _snapshot(), rss_bytes()
        _cycles(backend, CYCLES)
        rss1, after = rss_bytes(), _snapshot()
    finally:
        if pinned:
            aten_override.uninstall()
    # A handful of objects churn (weakrefs, frames of gc itself); a leak per cycle would be 10,000.
    _assert_same(before, after, allowed_growth=CYCLES // 20)  # a per-cycle leak is >= CYCLES; lazy one-off caches are not
    budget = 0 if pinned else NATIVE_BYTES_PER_REGISTRATION * CYCLES
    # Pages are 4 KiB: allow a few pages of allocator noise even when nothing is registered.
    assert rss1 - rss0 <= budget + 64 * PAGE, f"RSS grew {(rss1 - rss0) / 1024:.0f} KiB over {CYCLES} cycles"
    assert_dispatcher_native()


@parametrize_backend
def test_calls_under_backend(backend):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 9, generator=g), torch.randn(4, 3, 3, generator=g)
    go = torch.randn(2, 4, 7, generator=g)
    args = (go, x, w, [4], [1], [0], [1], False, [0], 1, [True, True, True])
    expected = aten_override.original_kernel("cpu")(*args)
    op = torch.ops.aten.convolution_backward.default
    with aten_override.enable(backend):
        for _ in range(WARMUP):
            op(*args)
        before, rss0 = _snapshot(), rss_bytes()
        aten_override.reset_stats()
        for _ in range(CALLS):
            result = op(*args)
        served = aten_override.stats().get(backend, 0)
        rss1, after = rss_bytes(), _snapshot()
    assert served == CALLS
    for r, e in zip(result, expected):
        torch.testing.assert_close(r, e)
    _assert_same(before, after, allowed_growth=CYCLES // 20)  # a per-cycle leak is >= CYCLES; lazy one-off caches are not
    assert rss1 - rss0 <= 256 * PAGE, f"RSS grew {(rss1 - rss0) / 1024:.0f} KiB over {CALLS} calls"
    assert_dispatcher_native()
