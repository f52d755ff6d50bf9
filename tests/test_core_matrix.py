"""The core contract matrix: every backend vs the original ATen kernel.

dims x transposed x stride/padding/dilation/groups/output_padding x every output_mask x dtypes x
memory formats; values, dtypes, shapes and strides are compared (helpers.assert_matches_original).
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import assert_matches_original, run_backend

MASKS = [list(m) for m in itertools.product([True, False], repeat=3)]


@dataclass(frozen=True)
class Problem:
    dim: int
    transposed: bool = False
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    output_padding: int = 0
    c_in: int = 4
    c_out: int = 6
    size: int = 7
    kernel: int = 3
    batch: int = 2

    @property
    def id(self) -> str:
        parts = [f"{self.dim}d", "transposed" if self.transposed else "conv"]
        for name, default in (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1), ("output_padding", 0)):
            value = getattr(self, name)
            if value != default:
                parts.append(f"{name}={value}")
        parts.append(f"C={self.c_in}->{self.c_out},k={self.kernel},in={self.size}")
        return ",".join(parts)

    def tensors(self, dtype, device, memory_format="contiguous"):
        g = torch.Generator().manual_seed(zlib.crc32(self.id.encode()))
        d = self.dim
        if self.transposed:
            wshape = (self.c_in, self.c_out // self.groups, *[self.kernel] * d)
        else:
            wshape = (self.c_out, self.c_in // self.groups, *[self.kernel] * d)
        x = torch.randn(self.batch, self.c_in, *[self.size] * d, generator=g, dtype=torch.float64)
        w = torch.randn(wshape, generator=g, dtype=torch.float64)
        x, w = x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)
        y = torch.ops.aten.convolution.default(
            x.double(), w.double(), None, [self.stride] * d, [self.padding] * d, [self.dilation] * d,
            self.transposed, [self.output_padding] * d, self.groups,
        )
        go = torch.randn(y.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        x, w, go = _layout(x, w, go, memory_format)
        return go, x, w

    def aten_args(self, go, x, w, mask):
        d = self.dim
        return (
            go, x, w, [go.size(1)], [self.stride] * d, [self.padding] * d, [self.dilation] * d,
            self.transposed, [self.output_padding] * d, self.groups, mask,
        )


def _layout(x, w, go, memory_format):
    d = x.dim()
    cl = torch.channels_last if d == 4 else torch.channels_last_3d if d == 5 else None
    if memory_format == "channels_last_input":
        x = x.contiguous(memory_format=cl) if cl else x.transpose(1, 2).contiguous().transpose(1, 2)
    elif memory_format == "channels_last_weight":
        w = w.contiguous(memory_format=cl) if cl else w.transpose(1, 2).contiguous().transpose(1, 2)
    elif memory_format == "noncontiguous_grad_output":
        go = torch.cat([go, go], dim=-1)[..., : go.size(-1)]  # a strided view
    elif memory_format == "expanded_grad_output":
        go = go[:1].expand_as(go)  # stride 0 in the batch dim, as `sum().backward()` produces
    elif memory_format == "channels_last_grad_output":
        go = go.contiguous(memory_format=cl) if cl else go.transpose(1, 2).contiguous().transpose(1, 2)
    return x, w, go


def _problems():
    out = []
    for dim in (1, 2, 3):
        size = {1: 9, 2: 7, 3: 5}[dim]
        base = dict(dim=dim, size=size)
        for transposed in (False, True):
            t = dict(base, transposed=transposed)
            out += [
                Problem(**t),
                Problem(**t, stride=2),
                Problem(**t, padding=1),
                Problem(**t, dilation=2),
                Problem(**t, stride=2, padding=1, dilation=2),
                Problem(**t, groups=2),
                Problem(**t, groups=2, stride=2, padding=1),
                Problem(**t, groups=4, c_in=4, c_out=4),  # depthwise
                Problem(**t, groups=4, c_in=4, c_out=8),  # channel multiplier 2
                Problem(**t, kernel=1, c_in=8, c_out=16),  # pointwise
                Problem(**t, c_in=1, c_out=4),  # one input channel
            ]
            if transposed:
                out += [
                    Problem(**t, stride=2, output_padding=1),
                    Problem(**t, stride=3, padding=1, output_padding=2, groups=2),
                    # output_padding >= stride, allowed because dilation > output_padding
                    Problem(**t, stride=2, dilation=3, output_padding=2),
                ]
            else:
                # kernel larger than the input, made valid by padding
                out.append(Problem(**dict(t, size=2), kernel=3, padding=1))
                out.append(Problem(**t, stride=3, padding=2))  # stride drops trailing rows
    return out


PROBLEMS = _problems()
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
FORMATS = ["contiguous", "channels_last_input", "channels_last_weight"]


def _dtype_format_params():
    """Every dtype x memory format (~15 s per backend on an idle 2-core machine: all in CI)."""
    for dtype in DTYPES:
        for memory_format in FORMATS:
            yield pytest.param(dtype, memory_format, id=f"{str(dtype).removeprefix('torch.')}-{memory_format}")


@pytest.mark.parametrize("dtype,memory_format", list(_dtype_format_params()))
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_matches_original_kernel(backend, device, problem, dtype, memory_format):
    go, x, w = problem.tensors(dtype, device, memory_format)
    for mask in MASKS:
        args = problem.aten_args(go, x, w, mask)
        ours = run_backend(backend, *args)
        assert_matches_original(ours, args)


GRAD_OUTPUT_LAYOUTS = ["noncontiguous_grad_output", "expanded_grad_output", "channels_last_grad_output"]


@pytest.mark.parametrize("layout", GRAD_OUTPUT_LAYOUTS)
@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.groups == 1 and p.stride == 2], ids=lambda p: p.id)
def test_grad_output_layout_does_not_matter(backend, device, problem, layout):
    """Upstream: output strides follow input/weight, never grad_output; any grad_output view works."""
    go, x, w = problem.tensors(torch.float32, device, layout)
    args = problem.aten_args(go, x, w, [True, True, True])
    assert_matches_original(run_backend(backend, *args), args)


def test_inputs_are_not_mutated(backend, device):
    problem = Problem(dim=2, stride=2, padding=1, groups=2)
    go, x, w = problem.tensors(torch.float32, device)
    before = [t.clone() for t in (go, x, w)]
    run_backend(backend, *problem.aten_args(go, x, w, [True, True, True]))
    for t, b in zip((go, x, w), before):
        assert torch.equal(t, b)
