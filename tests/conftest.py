"""Shared fixtures: the backends under test, devices, and the comparison against the original kernel."""

from __future__ import annotations

import os
import signal

# The compiled backend's tests check each kernel on the layers its layer class claims: the static
# table decides here (tests/ops/convolution_backward/test_autotune.py turns measuring on explicitly).
# Set before aten_override loads its extension; child interpreters inherit it.
os.environ.setdefault("ATEN_OVERRIDE_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import aten_override  # noqa: E402

from tests.backend_params import BACKENDS as OUR_BACKENDS

NO_CUDA = "no CUDA device in this process (CI has no GPU; run scripts/gpu_check.sh on a GPU machine)"
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)),
]


@pytest.fixture(params=OUR_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def sigint_delivered():
    """SIGINT reaches the child interpreters this test starts. A shell starts a background job (``cmd &``
    without job control, as a CI script may) with SIGINT ignored, exec keeps an ignored signal
    ignored, and Python then installs no KeyboardInterrupt handler: the tests that interrupt a child
    with SIGINT timed out. A handler here becomes the default disposition in the child at exec."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random tensors on every run, whatever ran before it (as upstream's
    TestCase.setUp seeds): a tolerance that holds once holds in CI."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _dispatcher_restored():
    """Every test leaves the dispatcher exactly as it found it.

    A test that enters and leaves ``enable()`` 8 times within a minute leaves the registration lingering
    idle (calls run the original kernel; ``aten_override.release()`` destroys it): released before
    each test, so every test starts from the native table, and after it, before the comparison (a
    leaked ``enable``/``install``/trace still fails it: ``release()`` leaves those alone)."""
    aten_override.release()
    before = torch._C._dispatch_dump("aten::convolution_backward")
    aten_override.reset_stats()
    yield
    assert aten_override.active_backend() is None, "a test left a backend enabled"
    aten_override.release()
    assert torch._C._dispatch_dump("aten::convolution_backward") == before


@pytest.fixture(autouse=True)
def _thread_count_restored():
    """Every test leaves torch's intra-op thread count as it found it: the tests after it measure
    candidates (the autotuner's choices, a candidate rejected as slow) and split work by it (a test
    that set one thread and kept it turned a later autotuner test's gemm-kn2row from measured into
    'slow'). Restored, then failed, where a test changed it."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch.get_num_threads() at {after} (was {before}): restore it")
