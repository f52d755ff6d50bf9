r"""``torch.use_deterministic_algorithms(True)`` with the override on.

- Our backends are bitwise reproducible run to run, with and without the deterministic mode, and
  its ``fill_uninitialized_memory`` (NaN-filled ``torch.empty``) never leaks into a result.
- As upstream on CPU, convolution backward raises no nondeterminism alert in that mode.
- An alert raised inside a backend (``alertNotDeterministic``, here its Python twin
  ``torch._prims_common.alert_not_deterministic``) is not silenced by the dispatcher hop: an error in
  the strict mode, a ``UserWarning`` with ``warn_only=True``, nothing with the mode off.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch._prims_common import alert_not_deterministic

import aten_override

from ..backend_params import parametrize_backend, served


@contextlib.contextmanager
def deterministic(on: bool = True, warn_only: bool = False):
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _model_and_input(dtype):
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, groups=16, dilation=2), nn.ReLU(),
        nn.ConvTranspose2d(16, 4, 3, stride=2),
    ).to(dtype)
    x = torch.randn(8, 3, 20, 20, dtype=dtype, generator=torch.Generator().manual_seed(3), requires_grad=True)
    return m, x


def _grads(m, x):
    m.zero_grad(set_to_none=True)
    x.grad = None
    m(x).square().sum().backward()
    return [x.grad.clone(), *(p.grad.clone() for p in m.parameters())]


def _assert_bitwise(a, b):
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.stride() == v.stride()
        assert torch.equal(u, v), f"max diff {(u - v).abs().max().item()}"


@parametrize_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_bitwise_reproducible(backend, dtype):
    m, x = _model_and_input(dtype)
    native = _grads(m, x)
    with served(backend, min_calls=9):
        first = _grads(m, x)
        with deterministic():
            assert torch.utils.deterministic.fill_uninitialized_memory
            second = _grads(m, x)  # no alert raised: as upstream's CPU kernels
            third = _grads(m, x)
    _assert_bitwise(first, second)
    _assert_bitwise(first, third)
    for g in first:
        assert not g.isnan().any()
    rtol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    for g, n in zip(first, native):  # values vs native, relative to each gradient's magnitude
        torch.testing.assert_close(g, n, rtol=rtol, atol=rtol * n.abs().max().item())


def test_native_conv_backward_raises_no_alert_on_cpu():
    """The upstream behaviour the test above matches (a strict-mode alert would be an error)."""
    m, x = _model_and_input(torch.float32)
    with deterministic():
        _grads(m, x)


def _alerting_backend(*aten_args):
    """A user backend that, like a kernel accumulating with atomics, is nondeterministic."""
    alert_not_deterministic("convolution_backward[alerting]")
    return aten_override.original_kernel("cpu")(*aten_args)


def test_alert_inside_a_backend_is_an_error_in_strict_mode():
    m, x = _model_and_input(torch.float32)
    with deterministic(), aten_override.enable(_alerting_backend):
        with pytest.raises(RuntimeError, match=r"convolution_backward\[alerting\] does not have a deterministic implementation") as info:
            _grads(m, x)
    assert any("raised by backend '_alerting_backend'" in n for n in getattr(info.value, "__notes__", [])), info.value
    assert not aten_override.is_registered()


def test_alert_inside_a_backend_warns_in_warn_only_mode():
    m, x = _model_and_input(torch.float32)
    expected = _grads(m, x)
    aten_override.reset_stats()
    with deterministic(warn_only=True), aten_override.enable(_alerting_backend):
        with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
            got = _grads(m, x)
    assert aten_override.stats()["_alerting_backend"] == 3
    _assert_bitwise(got, expected)


def test_alert_inside_a_backend_is_silent_with_the_mode_off():
    m, x = _model_and_input(torch.float32)
    with deterministic(False), aten_override.enable(_alerting_backend), warnings.catch_warnings():
        warnings.simplefilter("error")
        _grads(m, x)
