r"""``torch.func`` per-sample gradients (Opacus' functorch mode): ``vmap(grad(loss))`` over a conv model.

Under ``vmap`` functorch's batch rule (BatchRulesConvolution.cpp) computes ``grad_weight``
with the vmapped batch ``B`` folded into the channel dim: ``aten::convolution_backward`` with
``groups = B * groups`` and ``N = 1`` (the hot path of per-sample training), and ``grad_input`` in a
second call with ``B`` as the batch; both calls are ours. Results are compared with a per-sample loop on the original
kernel, and the ``groups`` the backend saw are recorded to prove the grouped path was taken.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import aten_override
from aten_override import _registration

from ..backend_params import parametrize_backend, served

BATCH = 6


def _model(dim: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
    convt = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dim]
    return nn.Sequential(
        conv(2, 4, 3, padding=1),
        nn.Tanh(),
        conv(4, 4, 3, stride=2, groups=2, bias=False),
        nn.Tanh(),
        convt(4, 2, 2, stride=2),
        nn.Flatten(),
        nn.LazyLinear(3),
    ).to(dtype)


def _per_sample_loop(model, params, x, y):
    """The reference: one ordinary backward per sample, original kernel."""
    out = []
    for xi, yi in zip(x, y):
        grads = torch.autograd.grad(_loss(model, params, xi, yi), list(params.values()))
        out.append(grads)
    return [torch.stack(g) for g in zip(*out)]


def _loss(model, params, xi, yi):
    logits = functional_call(model, params, (xi.unsqueeze(0),))
    return nn.functional.cross_entropy(logits, yi.unsqueeze(0))


class _CallsSeen:
    """Observer: ``(groups, output_mask, input.shape)`` of every call our kernel serves."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, keyset, aten_args, impl, route):
        self.calls.append((int(aten_args[9]), tuple(aten_args[10]), tuple(aten_args[1].shape)))
        return route(keyset, aten_args, impl)


@parametrize_backend
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("dim", [1, 2, 3], ids=lambda d: f"dim={d}")
def test_per_sample_grads(backend, dim, dtype):
    model = _model(dim, dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 2, *([6] * dim), dtype=dtype, generator=g)
    y = torch.randint(0, 3, (BATCH,), generator=g)
    model(x)  # materialise the lazy layer
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    expected = _per_sample_loop(model, params, x, y)

    per_sample = vmap(grad(lambda p, xi, yi: _loss(model, p, xi, yi)), in_dims=(None, 0, 0))
    seen = _CallsSeen()
    previous = _registration.set_observer(seen)
    try:
        with served(backend) as stats:
            got = per_sample({k: v.detach() for k, v in params.items()}, x, y)
    finally:
        _registration.set_observer(previous)
    # The batch rule splits each layer's call: grad_weight with the batch folded into groups
    # (N = 1, groups = B * groups: 1, 2 and 1 per layer) and grad_input with the batch as N; the
    # first layer needs no grad_input, grad_bias is a plain sum outside the op.
    weight_calls = [(g, shape[0]) for g, mask, shape in seen.calls if mask == (False, True, False)]
    input_calls = [(g, shape[0]) for g, mask, shape in seen.calls if mask == (True, False, False)]
    assert sorted(weight_calls) == [(BATCH, 1), (BATCH, 1), (2 * BATCH, 1)], seen.calls
    assert sorted(input_calls) == [(1, BATCH), (2, BATCH)], seen.calls
    assert stats[backend] == len(seen.calls) == 5, stats
    for (name, gv), e in zip(got.items(), expected):
        assert gv.shape == (BATCH, *params[name].shape)
        torch.testing.assert_close(gv, e, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_bench_vmap_script_runs():
    """scripts/bench_vmap.py end to end on a tiny problem: every backend served its calls."""
    from ..backend_params import BACKENDS, run_python

    proc = run_python(
        ["scripts/bench_vmap.py", "--batch", "4", "--rounds", "1", "--min-run-time", "0.01", "--channels", "4", "--size", "8"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("cpu: "), lines  # the machine header (aten_override._machine) comes first
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("batch")):]
    assert lines[0].split() == ["batch", "backend", "aten_us", "backend_us", "ratio", "calls_served", "max_abs_err"]
    rows = [line.split() for line in lines[1:] if line.split() and line.split()[0].isdigit()]
    assert [r[1] for r in rows] == BACKENDS
    assert all(int(r[5]) > 0 and float(r[6]) < 1e-4 for r in rows), lines


@parametrize_backend
def test_expanded_weights_do_not_call_convolution_backward(backend):
    """Not every per-sample mode is ours: ``call_for_per_sample_grads`` (ExpandedWeights, Opacus'
    hooks mode works alike) computes per-sample conv grads with its own autograd function (unfold +
    einsum, or a grouped forward conv) and never calls ``aten::convolution_backward``; results are
    upstream's, with or without ``enable``."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, groups=2)).double()
    x = torch.randn(BATCH, 3, 8, 8, dtype=torch.float64)

    def per_sample():
        for p in model.parameters():
            p.grad_sample = p.grad = None
        call_for_per_sample_grads(model)(x).sum().backward()
        return [p.grad_sample.clone() for p in model.parameters()]

    expected = per_sample()
    aten_override.reset_stats()
    with aten_override.enable(backend):
        got = per_sample()
    assert set(aten_override.stats()) == {"fallback_reasons"}, aten_override.stats()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
