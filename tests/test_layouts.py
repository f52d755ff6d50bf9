"""Output strides on ambiguous layouts (size-1 channel / kernel dims), with oneDNN on and off.

Where a layout is ambiguous, upstream's strides depend on the backend it picks (the THNN Slow2d and
SlowTranspose2d paths keep weight's own strides for grad_weight, oneDNN allocates in the memory
format). Every backend must give exactly the original kernel's strides.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import assert_matches_original, run_backend

CASES = [
    # (c_in, c_out, groups, kernel, transposed)
    (4, 8, 2, 1, False),   # 1x1 grouped: weight (8, 2, 1, 1) is ambiguous
    (4, 4, 4, 3, False),   # depthwise: weight (4, 1, 3, 3)
    (4, 8, 4, 3, False),   # channel multiplier
    (1, 4, 1, 3, False),   # one input channel
    (4, 4, 4, 3, True),    # transposed depthwise: weight (4, 1, 3, 3)
    (4, 8, 1, 1, True),    # transposed 1x1
]


@pytest.mark.parametrize("mkldnn", [True, False], ids=["mkldnn", "no-mkldnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C={c[0]}->{c[1]},groups={c[2]},k={c[3]}" + (",transposed" if c[4] else ""))
def test_strides_on_ambiguous_layouts(backend, case, dtype, mkldnn):
    c_in, c_out, groups, k, transposed = case
    g = torch.Generator().manual_seed(0)
    wshape = (c_in, c_out // groups, k, k) if transposed else (c_out, c_in // groups, k, k)
    with torch.backends.mkldnn.flags(enabled=mkldnn):
        for x_cl, w_cl in itertools.product([False, True], repeat=2):
            x = torch.randn(2, c_in, 10, 10, generator=g, dtype=dtype)
            w = torch.randn(wshape, generator=g, dtype=dtype)
            if x_cl:
                x = x.contiguous(memory_format=torch.channels_last)
            if w_cl:
                w = w.contiguous(memory_format=torch.channels_last)
            y = torch.ops.aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)
            go = torch.randn(y.shape, generator=g, dtype=dtype)
            args = (go, x, w, [go.size(1)], [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups, [True, True, True])
            ours = run_backend(backend, *args)
            assert_matches_original(ours, args)
