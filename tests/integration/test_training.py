r"""Training steps of unmodified models under ``enable(backend)``: autocast (bfloat16), channels_last,
``weight_norm`` parametrizations and gradient checkpointing (``use_reentrant`` True and False).

Each case trains a few SGD steps natively and under the backend from the same initial state and
compares gradients (values, dtypes, strides) and the final parameters. bfloat16 autocast results
are compared with a float64 run: our error may be at most a small multiple of native's own.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.checkpoint import checkpoint

from ..backend_params import parametrize_backend, served

STEPS = 3


class _Net(nn.Module):
    """Conv2d → grouped conv → ConvTranspose2d, optionally checkpointed block by block."""

    def __init__(self, checkpoint_reentrant: bool | None = None, weight_normed: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.GELU()),
            nn.Sequential(nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)),
        ])
        if weight_normed:
            for block in self.blocks:
                weight_norm(block[0])
        self.checkpoint_reentrant = checkpoint_reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.checkpoint_reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpoint_reentrant)
        return x


# id -> (model kwargs, channels_last, autocast dtype, conv backward calls per step)
CASES = {
    "channels_last": ({}, True, None, 3),
    "weight_norm": ({"weight_normed": True}, False, None, 3),
    "checkpoint,use_reentrant=False": ({"checkpoint_reentrant": False}, False, None, 3),
    "checkpoint,use_reentrant=True": ({"checkpoint_reentrant": True}, False, None, 3),
    "checkpoint,use_reentrant=False,channels_last": ({"checkpoint_reentrant": False}, True, None, 3),
    "weight_norm,checkpoint,use_reentrant=True": ({"weight_normed": True, "checkpoint_reentrant": True}, False, None, 3),
    "autocast=bfloat16": ({}, False, torch.bfloat16, 3),
    "autocast=bfloat16,channels_last": ({}, True, torch.bfloat16, 3),
}


def _setup(kwargs, channels_last, dtype):
    torch.manual_seed(0)
    model = _Net(**kwargs).to(dtype)
    x = torch.randn(4, 3, 12, 12, dtype=dtype, generator=torch.Generator().manual_seed(1))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x.requires_grad_()


def _train(model, x, autocast_dtype, ctx=contextlib.nullcontext):
    """STEPS SGD steps; returns (grads of the last step incl. the input's, final parameters)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = (
        functools.partial(torch.autocast, "cpu", dtype=autocast_dtype)
        if autocast_dtype is not None else contextlib.nullcontext
    )
    with ctx():
        for _ in range(STEPS):
            opt.zero_grad()
            x.grad = None
            with amp():
                y = model(x)
            y.float().square().mean().backward()
            grads = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
            opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


@parametrize_backend
@pytest.mark.parametrize("case", list(CASES))
def test_training_steps(backend, case):
    kwargs, channels_last, autocast_dtype, calls_per_step = CASES[case]
    native_grads, native_params = _train(*_setup(kwargs, channels_last, torch.float32), autocast_dtype)
    with served(backend, min_calls=calls_per_step * STEPS) as stats:
        grads, params = _train(*_setup(kwargs, channels_last, torch.float32), autocast_dtype)
    assert stats[backend] == calls_per_step * STEPS, stats
    if autocast_dtype is None:
        for g, n in zip(grads, native_grads):
            torch.testing.assert_close(g, n, rtol=1e-4, atol=1e-5)
            assert g.stride() == n.stride()
        for p, n in zip(params, native_params):
            torch.testing.assert_close(p, n, rtol=1e-4, atol=1e-5)
        return
    # autocast: bfloat16 convolutions; measure both against a float64 run of the same steps.
    ref_grads, ref_params = _train(*_setup(kwargs, channels_last, torch.float64), None)
    for name, got, nat, ref in (("grad", grads, native_grads, ref_grads), ("param", params, native_params, ref_params)):
        for i, (g, n, r) in enumerate(zip(got, nat, ref)):
            assert g.dtype == n.dtype and g.shape == n.shape and g.stride() == n.stride()
            ours = (g.double() - r).abs().max().item()
            theirs = (n.double() - r).abs().max().item()
            scale = r.abs().max().item()
            assert ours <= 2 * theirs + 1e-3 * scale, f"{name} {i}: error {ours:.3g} vs native's {theirs:.3g}"


@parametrize_backend
def test_autocast_calls_reach_backend_in_bfloat16(backend):
    """Under autocast the backward call really is bfloat16 (the backend, not a float32 fallback)."""
    from aten_override import _registration

    dtypes = []

    def observer(keyset, aten_args, impl, route):
        dtypes.append(aten_args[0].dtype)
        return route(keyset, aten_args, impl)

    model, x = _setup({}, False, torch.float32)
    previous = _registration.set_observer(observer)
    try:
        with served(backend):
            _train(model, x, torch.bfloat16)
    finally:
        _registration.set_observer(previous)
    assert dtypes and set(dtypes) == {torch.bfloat16}
