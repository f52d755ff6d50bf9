r"""``torch.compile``: compiled backward graphs call our kernel at run time.

``aot_eager`` and Inductor's default Python wrapper call ``aten.convolution_backward`` through the
dispatcher (Inductor lowers it to a fallback kernel), so the override serves them; Inductor then
trusts the meta function's stride prediction for that fallback's outputs, so our outputs must have
exactly those strides (pytorch#171622: a channels_last mismatch tripped Inductor's stride asserts).

``cpp_wrapper``, AOTInductor, dynamic shapes, max-autotune and compiled autograd are served through
``aten_override::convolution_backward`` (:mod:`aten_override.compiled_graphs`):
``test_compile_modes.py``. What still bypasses the override is in :mod:`aten_override.compile_bypass`.

Inductor compiles C++ with the host compiler (tens of seconds on 2 cores): one small Inductor test
runs in the CI profile, the rest are slow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aten_override
from aten_override import _registration
from aten_override.compile_bypass import bypass_reasons

from ..backend_params import BACKENDS, parametrize_backend, served


def _model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
    ).double()
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m


def _input(channels_last: bool) -> torch.Tensor:
    x = torch.randn(2, 3, 10, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def _grads(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    x.grad = None
    m(x).square().sum().backward()
    return [x.grad, *(p.grad for p in m.parameters())]


class _StrideCheck:
    """Observer on our kernel: for every call it serves, the meta function's prediction of the
    outputs' sizes and strides (what Inductor asserts) must equal what the backend returned."""

    def __init__(self) -> None:
        self.checked = 0
        self.mismatches: list[str] = []

    def __call__(self, keyset, aten_args, impl, route):
        result, decision = route(keyset, aten_args, impl)
        meta_args = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
            for a in aten_args
        ]
        predicted = torch.ops.aten.convolution_backward.default(*meta_args)
        for name, got, want in zip(("grad_input", "grad_weight", "grad_bias"), result, predicted):
            if got is None:
                continue
            if (got.shape, got.stride()) != (want.shape, want.stride()):
                self.mismatches.append(
                    f"{name}: {decision.backend} gave {list(got.shape)} strides {got.stride()}, "
                    f"meta predicts {list(want.shape)} strides {want.stride()}"
                )
        self.checked += 1
        return result, decision


@pytest.fixture
def stride_check():
    check = _StrideCheck()
    previous = _registration.set_observer(check)
    try:
        yield check
    finally:
        _registration.set_observer(previous)


def _check_compiled(backend: str, compile_backend: str, channels_last: bool, stride_check: _StrideCheck) -> None:
    m, x = _model(channels_last), _input(channels_last)
    expected = _grads(m, x)  # native eager reference
    # The observer sees every call while it is set (an observer keeps the Python kernel registered),
    # the reference's too: count from here.
    stride_check.checked, stride_check.mismatches = 0, []
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=compile_backend)
    with served(backend) as stats:
        got = _grads(compiled, x)
    # Three convolutions, one backward call each (x requires grad, so every call needs grad_input).
    assert stats[backend] == 3, stats
    assert stride_check.checked == 3 and not stride_check.mismatches, stride_check.mismatches
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
        assert g.stride() == e.stride()


@pytest.mark.slow
@parametrize_backend
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_aot_eager(backend, channels_last, stride_check):
    _check_compiled(backend, "aot_eager", channels_last, stride_check)


@parametrize_backend
def test_aot_eager_channels_last_ci(backend, stride_check):
    """The CI-profile aot_eager case (cheap: no C++ compile)."""
    _check_compiled(backend, "aot_eager", True, stride_check)


@parametrize_backend
def test_inductor_channels_last(backend, stride_check):
    """The one Inductor compile in the CI profile: channels_last, so the stride contract matters."""
    _check_compiled(backend, "inductor", True, stride_check)


@pytest.mark.slow
@parametrize_backend
def test_inductor_contiguous(backend, stride_check):
    _check_compiled(backend, "inductor", False, stride_check)


@pytest.mark.slow
@parametrize_backend
def test_inductor_dynamic_shapes(backend, stride_check):
    """``dynamic=True``: one graph for two batch sizes, our kernel serves both runs."""
    m = _model(False)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="inductor", dynamic=True)
    for n in (2, 3):
        x = torch.randn(n, 3, 10, 10, dtype=torch.float64).requires_grad_()
        expected = _grads(m, x)
        with served(backend) as stats:
            got = _grads(compiled, x)
        assert stats[backend] == 3
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert not stride_check.mismatches, stride_check.mismatches


def test_bypass_reasons_default_config_is_empty():
    import torch._inductor.config as inductor_config

    assert bypass_reasons() == []
    with inductor_config.patch(cpp_wrapper=True):
        assert bypass_reasons() == [
            "torch._inductor.config.cpp_wrapper is on: compiled code calls ATen's convolution_backward "
            "statically and bypasses the override, unless compiled under "
            "aten_override.enable(compiled_graphs=True) (the default)"
        ]


def test_backends_param_is_not_empty():
    """Guards the parametrization: with no backend available every test above would vanish."""
    assert "python" in BACKENDS


def test_stride_check_catches_a_wrong_layout(stride_check):
    """The observer above can fail: a backend returning contiguous grads for a channels_last call
    (what pytorch#171622 was about) is reported."""
    original = aten_override.original_kernel("cpu")

    def contiguous_grads(*aten_args):
        return tuple(None if t is None else t.contiguous() for t in original(*aten_args))

    m, x = _model(True), _input(True)
    with aten_override.enable(contiguous_grads):
        _grads(m, x)
    assert stride_check.checked == 3
    assert any("grad_input" in s for s in stride_check.mismatches), stride_check.mismatches
