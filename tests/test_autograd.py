"""End to end through autograd: modules, functional convs, gradcheck / gradgradcheck, forward-over-reverse,
torch.nn.grad placeholders and vmap per-sample gradients, each compared with native and proving our
backend ran."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import aten_override

MODULES = {
    "Conv1d": lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1),
    "Conv2d": lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2),
    "Conv3d": lambda: nn.Conv3d(4, 6, 3, stride=(1, 2, 1), padding=1, groups=2),
    "Conv2d_depthwise": lambda: nn.Conv2d(4, 8, 3, groups=4, padding=1, bias=False),
    "ConvTranspose1d": lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1),
    "ConvTranspose2d": lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
    "ConvTranspose3d": lambda: nn.ConvTranspose3d(4, 6, 2, stride=2),
    "Conv2d_same": lambda: nn.Conv2d(4, 6, 4, padding="same"),
    "Conv1d_same_dilated": lambda: nn.Conv1d(4, 6, 3, padding="same", dilation=3),
}
SPATIAL = {"1d": (11,), "2d": (9, 9), "3d": (5, 6, 5)}


def _input_for(module, batch=3, dtype=torch.float32):
    dims = module.weight.dim() - 2
    size = {1: (11,), 2: (9, 9), 3: (5, 6, 5)}[dims]
    return torch.randn(batch, module.in_channels, *size, dtype=dtype)


def _grads(module, x, backend=None):
    module.zero_grad()
    x = x.clone().requires_grad_()
    if backend is None:
        module(x).square().sum().backward()
    else:
        with aten_override.enable(backend):
            module(x).square().sum().backward()
    return [x.grad] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("name", list(MODULES))
def test_module_parameter_grads_match_native(backend, name):
    torch.manual_seed(0)
    module = MODULES[name]()
    x = _input_for(module)
    native = _grads(module, x)
    aten_override.reset_stats()
    ours = _grads(module, x, backend)
    assert aten_override.stats()[backend] == 1
    for a, b in zip(ours, native):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["Conv2d", "ConvTranspose2d", "Conv2d_depthwise"])
def test_channels_last_module(backend, name):
    torch.manual_seed(0)
    module = MODULES[name]().to(memory_format=torch.channels_last)
    x = _input_for(module).to(memory_format=torch.channels_last)
    native = _grads(module, x)
    ours = _grads(module, x, backend)
    for a, b in zip(ours, native):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "fn,shapes",
    [
        (functools.partial(F.conv1d, stride=2, padding=1, groups=2), ((2, 4, 7), (4, 2, 3))),
        (functools.partial(F.conv2d, padding="same", dilation=2), ((2, 2, 5, 5), (3, 2, 3, 3))),
        (functools.partial(F.conv3d, stride=2, padding=1), ((1, 2, 4, 4, 4), (2, 2, 3, 3, 3))),
        (functools.partial(F.conv_transpose1d, stride=3, padding=1, output_padding=2, groups=2), ((2, 4, 4), (4, 1, 3))),
        (functools.partial(F.conv_transpose2d, stride=2, dilation=3, output_padding=2), ((1, 2, 3, 3), (2, 3, 3, 3))),
        (functools.partial(F.conv_transpose3d, stride=2), ((1, 2, 2, 3, 2), (2, 2, 2, 2, 2))),
    ],
    ids=["conv1d-groups", "conv2d-same", "conv3d-stride", "conv_transpose1d-op2", "conv_transpose2d-op>=stride", "conv_transpose3d"],
)
def test_gradcheck_and_gradgradcheck(backend, fn, shapes):
    torch.manual_seed(0)
    x = torch.randn(shapes[0], dtype=torch.float64, requires_grad=True)
    w = torch.randn(shapes[1], dtype=torch.float64, requires_grad=True)
    with aten_override.enable(backend):
        assert torch.autograd.gradcheck(fn, (x, w))
        assert torch.autograd.gradgradcheck(fn, (x, w))
    assert aten_override.stats()[backend] > 0


def test_forward_over_reverse(backend):
    """jvp of a gradient (Hessian-vector products): the jvp formula of convolution_backward calls it again."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    v = torch.randn_like(w)

    def loss_grad(w):
        return torch.func.grad(lambda w: F.conv2d(x, w, stride=2).tanh().sum())(w)

    native = torch.func.jvp(loss_grad, (w,), (v,))
    with aten_override.enable(backend):
        ours = torch.func.jvp(loss_grad, (w,), (v,))
    assert aten_override.stats()[backend] > 0
    for a, b in zip(ours, native):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_nn_grad_placeholders(backend, dim):
    """torch.nn.grad.conv*_input/_weight pass an uninitialised stride-0 tensor for the unused argument."""
    torch.manual_seed(0)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dim]
    grad_input_fn = getattr(torch.nn.grad, f"conv{dim}d_input")
    grad_weight_fn = getattr(torch.nn.grad, f"conv{dim}d_weight")
    x = torch.randn(2, 4, *[6] * dim)
    w = torch.randn(6, 2, *[3] * dim)
    go = torch.randn_like(conv(x, w, stride=2, padding=1, groups=2))
    native = (grad_input_fn(x.shape, w, go, stride=2, padding=1, groups=2),
              grad_weight_fn(x, w.shape, go, stride=2, padding=1, groups=2))
    with aten_override.enable(backend):
        ours = (grad_input_fn(x.shape, w, go, stride=2, padding=1, groups=2),
                grad_weight_fn(x, w.shape, go, stride=2, padding=1, groups=2))
    assert aten_override.stats()[backend] == 2
    for a, b in zip(ours, native):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_vmap_per_sample_gradients(backend, transposed):
    """functorch folds the batch into groups: one call with groups = groups * B, N = 1."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ConvTranspose2d(3, 4, 3, stride=2, groups=1) if transposed else nn.Conv2d(3, 4, 3, stride=2),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, groups=2),
    )
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 3, 8, 8)

    def loss(p, xi):
        return torch.func.functional_call(model, p, (xi[None],)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    native = per_sample(params, x)
    with aten_override.enable(backend):
        ours = per_sample(params, x)
    assert aten_override.stats()[backend] > 0
    for k in native:
        torch.testing.assert_close(ours[k], native[k], rtol=1e-4, atol=1e-5)
    # and the per-sample gradients are the gradients of each sample alone
    for i in range(2):
        single = torch.func.grad(loss)(params, x[i])
        for k in native:
            torch.testing.assert_close(ours[k][i], single[k], rtol=1e-4, atol=1e-5)
