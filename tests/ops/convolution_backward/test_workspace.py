r"""The compiled kernels' temporaries kept between calls (``csrc/cpu/workspace.h``, ``_C.workspace()``).

Temporaries of 1 MiB or more (kn2row-lanes' channels-last copies and grad_input sums, winograd's
planes, transformed weight and partial sums) come from blocks kept between calls instead of fresh
pages. A kept block still holds the previous call's data, so every call here runs on blocks another
call has written: the results must be the same bits as on fresh memory (``set_workspace_limit(0)``)
and the original kernel's within its error; outputs must never share a kept block; the blocks are
bounded by the limit and freed when our kernel leaves the dispatcher for the first time, or on
``aten_override.release()`` once a later block has kept them.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import aten_override
from aten_override.ops.convolution_backward import compiled
from aten_override.testing.comparison import call_native, check_against_native, float64_reference
from tests.backend_params import REPO

pytestmark = pytest.mark.skipif(compiled.unavailable_reason() is not None, reason=str(compiled.unavailable_reason()))

_C = compiled.extension()
DEFAULT_LIMIT = 256 << 20


def _call(c_in, c_out, kernel, spatial, *, stride=1, padding=0, batch=2, seed=0, scale=1.0,
          mask=(True, True, False), dtype=torch.float32):
    dims = len(spatial)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, *spatial, generator=g) * scale
    w = torch.randn(c_out, c_in, *kernel, generator=g)
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[dims - 1]
    y = conv(x, w, stride=stride, padding=padding)
    go = torch.randn(y.shape, generator=g) * scale
    pad = list(padding) if isinstance(padding, tuple) else [padding] * dims
    return (go.to(dtype), x.to(dtype), w.to(dtype), None, [stride] * dims, pad, [1] * dims, False, [0] * dims, 1,
            list(mask))


# Each call's temporaries reach the workspace (over 1 MiB); two calls of one kernel with different
# sizes, so that the second runs on blocks the first wrote.
CALLS = {
    "kn2row-lanes": (
        _call(64, 96, (3,), (2400,), stride=2, batch=4),  # wav2vec2-like: phases, channels padded
        _call(96, 64, (5,), (3000,), padding=2, batch=3, seed=1, scale=3.0),
    ),
    "winograd": (
        _call(40, 48, (3, 3), (60, 60), padding=1),  # channels padded to whole vectors
        _call(48, 32, (1, 3, 3), (3, 40, 44), padding=(0, 1, 1), seed=1, scale=3.0),  # 1x3x3: depth folded
    ),
}


@pytest.fixture(autouse=True)
def _default_limit():
    _C.set_workspace_limit(DEFAULT_LIMIT)
    _C.release_workspace()
    yield
    _C.set_workspace_limit(DEFAULT_LIMIT)
    _C.release_workspace()


def _run(kernel, call):
    return [None if t is None else t.clone() for t in _C.run_kernel(kernel, *call)]


def _assert_same_bits(actual, expected, where):
    for name, a, e in zip(("grad_input", "grad_weight", "grad_bias"), actual, expected):
        assert (a is None) == (e is None), f"{where}: {name}"
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride(), f"{where}: {name}"
            assert torch.equal(a, e), f"{where}: {name} differs from the run on fresh memory"


@pytest.mark.parametrize("mask", [(True, True, False), (True, False, False), (False, True, False)], ids=str)
@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_kept_blocks_give_the_bits_of_fresh_memory(kernel, mask):
    calls = [list(c) for c in CALLS[kernel]]
    for c in calls:
        c[-1] = list(mask)
    _C.set_workspace_limit(0)  # every temporary fresh
    fresh = [_run(kernel, c) for c in calls]
    assert _C.workspace()["kept_bytes"] == 0
    _C.set_workspace_limit(DEFAULT_LIMIT)
    hits = _C.workspace()["hits"]
    # each call after the first runs on blocks a call wrote: the other call's, then its own (where
    # grad_input's sums start from zeros, leftovers would be added in)
    for i in (0, 1, 1, 0, 0):
        _assert_same_bits(_run(kernel, calls[i]), fresh[i], f"{kernel} call {i}")
    assert _C.workspace()["hits"] > hits, "no call ran on a kept block: the test proves nothing"
    for c, got in zip(calls, fresh):
        check_against_native(got, call_native(c), float64_reference(c), output_mask=mask, where=kernel)


def test_outputs_never_share_a_kept_block():
    first, second = CALLS["kn2row-lanes"]
    held = _C.run_kernel("kn2row-lanes", *first)
    snapshot = [t.clone() for t in held if t is not None]
    for _ in range(2):
        _C.run_kernel("kn2row-lanes", *second)
        _C.run_kernel("kn2row-lanes", *first)
        _C.run_kernel("winograd", *CALLS["winograd"][0])
    assert _C.workspace()["kept_bytes"] > 0
    for t, s in zip([t for t in held if t is not None], snapshot):
        assert torch.equal(t, s), "a later call wrote into a returned gradient"


def test_the_limit_bounds_the_kept_bytes_and_release_frees_them():
    call = CALLS["winograd"][1]
    _C.run_kernel("winograd", *call)
    kept = _C.workspace()["kept_bytes"]
    assert 0 < kept <= DEFAULT_LIMIT
    small = kept // 2
    _C.set_workspace_limit(small)
    assert _C.workspace()["kept_bytes"] <= small and _C.workspace()["limit_bytes"] == small
    _C.run_kernel("winograd", *call)
    assert _C.workspace()["kept_bytes"] <= small
    _C.set_workspace_limit(0)
    assert _C.workspace()["kept_bytes"] == 0
    _C.run_kernel("winograd", *call)
    assert _C.workspace()["kept_bytes"] == 0
    _C.set_workspace_limit(DEFAULT_LIMIT)
    _C.run_kernel("winograd", *call)
    kept = _C.workspace()["kept_bytes"]
    assert kept > 0
    assert _C.release_workspace() == kept
    assert _C.workspace()["kept_bytes"] == 0
    with pytest.raises(RuntimeError, match="workspace limit must be >= 0"):
        _C.set_workspace_limit(-1)


def _block_with_a_kept_temporary(inner=None):
    """One enable("compiled") block whose call leaves a kept block (with ``inner()`` entered inside
    it, if given); the bytes kept after it."""
    first = CALLS["kn2row-lanes"][0]
    with aten_override.enable("compiled"):
        _C.run_kernel("kn2row-lanes", *first)
        assert _C.workspace()["kept_bytes"] > 0
        if inner is not None:
            with inner():
                _C.run_kernel("kn2row-lanes", *first)
    assert not aten_override.is_registered()
    return _C.workspace()["kept_bytes"]


def test_leaving_the_dispatcher_frees_the_kept_blocks_until_a_block_is_entered_again():
    """The first block's exit frees the kept blocks; from the second enable("compiled") block on (a
    per-step enable(): bench_training.py's R(2+1)D-18 bfloat16 gemm-kn2row layer took 2-3x as long
    with its temporaries faulted in every step), exits keep them until release(), which also starts
    over."""
    aten_override.release()
    assert _block_with_a_kept_temporary() == 0
    kept = _block_with_a_kept_temporary()
    assert kept > 0
    before = _C.workspace()
    assert _block_with_a_kept_temporary() == kept
    after = _C.workspace()
    assert after["hits"] > before["hits"] and after["misses"] == before["misses"]  # the kept blocks served it
    assert aten_override.release() is False  # nothing registered, but the blocks are freed
    assert _C.workspace()["kept_bytes"] == 0
    assert _block_with_a_kept_temporary() == 0
    # release() frees them with nothing registered, however they were kept
    _C.run_kernel("kn2row-lanes", *CALLS["kn2row-lanes"][0])
    assert _C.workspace()["kept_bytes"] > 0
    aten_override.release()
    assert _C.workspace()["kept_bytes"] == 0


@pytest.mark.parametrize("inner", ["trace", "nested aten", "python block before"])
def test_one_compiled_block_frees_the_kept_blocks_whatever_it_contains(inner):
    """Only a second enable("compiled") block that registers our kernel afresh keeps them: not the
    switch to the Python registration a trace() makes, not a nested block, not another backend's
    block before it (a reviewer found each of these counted as a second registration)."""
    aten_override.release()
    if inner == "python block before":
        with aten_override.enable("python"):
            pass
        assert _block_with_a_kept_temporary() == 0
        return
    contexts = {"trace": lambda: aten_override.trace(log=False), "nested aten": lambda: aten_override.enable("aten")}
    assert _block_with_a_kept_temporary(contexts[inner]) == 0


def test_the_same_bits_at_any_thread_count_on_kept_blocks():
    call = CALLS["kn2row-lanes"][0]
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run("kn2row-lanes", call))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        _assert_same_bits(r, results[0], "kn2row-lanes at 1 / 2 / 3 threads")


def _bench_peak_bytes(monkeypatch):
    """``peak_bytes`` of scripts/bench_convolution_backward.py: the layer bench's peak memory, from
    torch.profiler's memory events."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # its `from interleave import ...`
    spec = importlib.util.spec_from_file_location("bench_convolution_backward", REPO / "scripts" / "bench_convolution_backward.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.peak_bytes


@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_the_profiler_sees_kept_blocks_as_the_calls_memory(kernel, monkeypatch):
    """The layer bench's peak memory counts kept blocks as the call's, as it counts fresh ones."""
    _profiled_peak = _bench_peak_bytes(monkeypatch)
    call = CALLS[kernel][0]
    _C.set_workspace_limit(0)
    fresh = _profiled_peak(lambda: _C.run_kernel(kernel, *call))
    _C.set_workspace_limit(DEFAULT_LIMIT)
    _C.run_kernel(kernel, *call)  # its blocks now kept
    assert _C.workspace()["kept_bytes"] > 0
    kept = _profiled_peak(lambda: _C.run_kernel(kernel, *call))
    assert kept == fresh
    # the temporaries (each over 1 MiB) are counted, not only the returned gradients
    outputs = sum(t.nbytes for t in _C.run_kernel(kernel, *call) if t is not None)
    assert fresh >= outputs + (1 << 20)
