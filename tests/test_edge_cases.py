"""Empty inputs, invalid arguments and the places where we deliberately differ from upstream."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import aten_override
from tests.helpers import assert_matches_original, run_backend

cb = torch.ops.aten.convolution_backward.default
ALL = [True, True, True]


@pytest.mark.parametrize(
    "go_shape,x_shape,w_shape,transposed,groups,bias_sizes",
    [
        ((0, 6, 6, 6), (0, 4, 8, 8), (6, 4, 3, 3), False, 1, [6]),
        ((0, 6, 6, 6), (0, 4, 8, 8), (6, 4, 3, 3), False, 1, [3]),  # grad_bias follows bias_sizes here
        ((2, 6, 6, 6), (2, 0, 8, 8), (6, 0, 3, 3), False, 2, [6]),
        ((0, 6, 10, 10), (0, 4, 8, 8), (4, 6, 3, 3), True, 1, [6]),
        ((0, 6, 6), (0, 4, 8), (6, 4, 3), False, 1, [6]),
        ((0, 6, 3, 3, 3), (0, 4, 5, 5, 5), (6, 2, 3, 3, 3), False, 2, [6]),
    ],
    ids=["batch0", "batch0-bias_sizes3", "channels0-groups2", "batch0-transposed", "batch0-1d", "batch0-3d-groups2"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_empty_inputs_give_zeros(backend, go_shape, x_shape, w_shape, transposed, groups, bias_sizes, dtype):
    x = torch.randn(x_shape, dtype=dtype)
    w = torch.randn(w_shape, dtype=dtype)
    go = torch.randn(go_shape, dtype=dtype)
    d = x.dim() - 2
    args = (go, x, w, bias_sizes, [1] * d, [0] * d, [1] * d, transposed, [0] * d, groups, ALL)
    ours = run_backend(backend, *args)
    native = assert_matches_original(ours, args)
    assert all(t.abs().sum() == 0 for t in native)


def test_empty_batch_with_bias_sizes_none_upstream_crash_fixed(backend):
    """Upstream aborts the process (it dereferences the empty bias_sizes optional); we return zeros(C_out)."""
    code = (
        "import torch; torch.ops.aten.convolution_backward.default(torch.randn(0,6,6,6), torch.randn(0,4,8,8),"
        " torch.randn(6,4,3,3), None, [1], [0], [1], False, [0], 1, [True, True, True])"
    )
    native = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert native.returncode != 0, "upstream no longer crashes: drop the special case and this test"
    args = (torch.randn(0, 6, 6, 6), torch.randn(0, 4, 8, 8), torch.randn(6, 4, 3, 3), None, [1], [0], [1], False, [0], 1, ALL)
    gi, gw, gb = run_backend(backend, *args)
    assert gi.shape == (0, 4, 8, 8) and gw.shape == (6, 4, 3, 3) and gb.shape == (6,)
    assert gw.abs().sum() == 0 and gb.abs().sum() == 0


def test_masked_grad_weight_is_none_upstream_returns_a_tensor(backend):
    """Upstream's oneDNN path returns grad_weight (4-D for a 1-D conv) for output_mask [T, F, T]; the schema
    says the masked output is undefined, and we return None."""
    x, w, go = torch.randn(2, 4, 9), torch.randn(6, 4, 3), torch.randn(2, 6, 7)
    args = (go, x, w, [6], [1], [0], [1], False, [0], 1, [True, False, True])
    native = cb(*args)
    assert native[1] is not None and native[1].shape == (6, 4, 1, 3), "upstream quirk changed"
    ours = run_backend(backend, *args)
    assert ours[1] is None
    assert_matches_original(ours, args)


def test_bias_sizes_does_not_shape_grad_bias(backend):
    """As upstream (pytorch#119407): grad_bias comes from grad_output's channels, not bias_sizes."""
    x, w, go = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(2, 6, 6, 6)
    for bias_sizes in (None, [0], [3]):
        args = (go, x, w, bias_sizes, [1], [0], [1], False, [0], 1, ALL)
        ours = run_backend(backend, *args)
        assert ours[2].shape == (6,)
        assert_matches_original(ours, args)


def _valid():
    return dict(go=torch.randn(2, 6, 6, 6), x=torch.randn(2, 4, 8, 8), w=torch.randn(6, 4, 3, 3),
                bias_sizes=[6], stride=[1], padding=[0], dilation=[1], transposed=False, output_padding=[0],
                groups=1, mask=ALL)


def _with(**changes):
    kw = _valid()
    kw.update(changes)
    return (kw["go"], kw["x"], kw["w"], kw["bias_sizes"], kw["stride"], kw["padding"], kw["dilation"],
            kw["transposed"], kw["output_padding"], kw["groups"], kw["mask"])


INVALID = [
    ("groups=0", _with(groups=0), r"expected groups to be greater than 0, but got groups=0"),
    ("groups=-2", _with(groups=-2), r"groups=-2"),
    ("groups does not divide C_out", _with(groups=4, w=torch.randn(6, 1, 3, 3)), r"groups \(4\) must divide C_out \(6\)"),
    ("groups does not divide C_in", _with(groups=3, w=torch.randn(6, 1, 3, 3)), r"C_in \(4\).*groups \(3\) must divide C_in \(4\)"),
    ("C_in mismatch", _with(x=torch.randn(2, 5, 8, 8)), r"input has C_in \(5\) channels"),
    ("grad_output channels", _with(go=torch.randn(2, 5, 6, 6)), r"grad_output has 5 channels, expected C_out = 6"),
    ("grad_output spatial", _with(go=torch.randn(2, 6, 5, 6)), r"grad_output spatial size \[5, 6\] does not match .* \[6, 6\]"),
    ("grad_output batch", _with(go=torch.randn(3, 6, 6, 6)), r"grad_output batch size \(3\) does not match input batch size \(2\)"),
    ("output_padding non-transposed", _with(output_padding=[1]), r"output_padding is not supported for non-transposed"),
    ("stride=0", _with(stride=[0]), r"non-positive stride"),
    ("negative padding", _with(padding=[-1]), r"negative padding"),
    ("stride length", _with(stride=[1, 1, 1]), r"expected stride to be a single integer value or a list of 2 values"),
    ("mixed dtypes", _with(go=torch.randn(2, 6, 6, 6, dtype=torch.float64)), r"same dtype, got torch.float64, torch.float32"),
    ("input rank", _with(x=torch.randn(2, 4, 8)), r"expected input and grad_output to be 4-dimensional"),
    ("kernel larger than input", _with(x=torch.randn(2, 4, 2, 2), go=torch.randn(2, 6, 1, 1)), r"kernel size can't be greater"),
    ("zero spatial size", _with(x=torch.randn(2, 4, 0, 8), go=torch.randn(2, 6, 2, 8), padding=[2, 1]), r"zero spatial size"),
    ("output_padding too big", _with(transposed=True, w=torch.randn(4, 6, 3, 3), go=torch.randn(2, 6, 17, 17), stride=[2], output_padding=[2]),
     r"output padding must be smaller than either stride or dilation"),
]


@pytest.mark.parametrize("args,message", [pytest.param(a, m, id=i) for i, a, m in INVALID])
def test_invalid_arguments_raise_named_errors(backend, args, message):
    with aten_override.enable(backend):
        with pytest.raises(RuntimeError, match=rf"convolution_backward\[{backend}\]: .*{message}"):
            cb(*args)
    # native raises too (of the same family), so we never accept what upstream rejects
    with pytest.raises((RuntimeError, ValueError, IndexError)):
        cb(*args)


def test_dilation_zero_raises_where_upstream_returns_garbage(backend):
    """Upstream's float32 (oneDNN) path accepts dilation=0 and returns a result (float64 raises); we raise."""
    args = _with(dilation=[0])
    assert cb(*args)[1].shape == (6, 4, 3, 3), "upstream now rejects dilation=0: fold this into INVALID"
    with aten_override.enable(backend):
        with pytest.raises(RuntimeError, match=rf"convolution_backward\[{backend}\]: dilation should be greater than zero"):
            cb(*args)


def test_unsupported_dtype_falls_back_with_reason(backend):
    x, w, go = torch.randn(2, 4, 8, 8).long(), torch.randn(6, 4, 3, 3).long(), torch.randn(2, 6, 6, 6).long()
    args = (go, x, w, [6], [1], [0], [1], False, [0], 1, ALL)
    with aten_override.enable(backend):
        with pytest.raises(NotImplementedError):  # the original kernel's own error
            cb(*args)
    stats = aten_override.stats()
    assert stats["fallback"] == 1
    assert any("torch.int64" in reason for reason in stats["fallback_reasons"])
