"""The python backend's formulations, each against the original ATen kernel.

The core matrix (tests/test_core_matrix.py) reaches every formulation only for its own small
problems: ``_depthwise_weight_grad`` for the 2-D/3-D ``groups=4, C=4->4`` cases,
``_im2col_weight_grad`` for the ``C=1->4`` cases, the per-sample pointwise GEMMs for the
``C=8->16,k=1`` float32/float64 cases, ``_shifted_window_weight_grad`` for the rest (in bfloat16 for
the ``groups=1`` bfloat16 cases), and never grad_input's forward-convolution path (the THNN
transposed convolution it replaces is only picked with one thread). Here each one is swept over
stride / padding / dilation / kernel / groups.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import aten_override
from aten_override.ops.convolution_backward import python_impl
from tests.helpers import assert_matches_original, run_backend

pytestmark = pytest.mark.skipif(
    aten_override.availability()["python"] is not None, reason=str(aten_override.availability()["python"])
)

WEIGHT_GRAD_CASES = [
    dict(dims=dims, stride=s, padding=p, dilation=d, kernel=k)
    for dims, s, p, d, k in itertools.product((1, 2, 3), (1, 2, 3), (0, 2), (1, 2), (1, 3))
]


def _case_id(case: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in case.items())


def _original_grad_weight(x, go, kernel, case, groups):
    dims = case["dims"]
    weight = torch.empty(go.size(1), x.size(1) // groups, *kernel, dtype=x.dtype)
    return aten_override.original_kernel("cpu")(
        go, x, weight, None, [case["stride"]] * dims, [case["padding"]] * dims, [case["dilation"]] * dims,
        False, [0] * dims, groups, [False, True, False],
    )[1]


def _problem(case: dict, c_in: int, c_out: int, groups: int, size: int = 7):
    dims, k = case["dims"], case["kernel"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c_in, *[size] * dims, generator=g, dtype=torch.float64)
    out = (size + 2 * case["padding"] - case["dilation"] * (k - 1) - 1) // case["stride"] + 1
    go = torch.randn(2, c_out, *[out] * dims, generator=g, dtype=torch.float64)
    return x, go, [k] * dims


@pytest.mark.parametrize("case", WEIGHT_GRAD_CASES, ids=_case_id)
@pytest.mark.parametrize("formulation", ["im2col", "shifted_window"])
def test_weight_grad_formulation_matches_original(case, formulation):
    x, go, kernel = _problem(case, c_in=4, c_out=6, groups=2)
    args = (x, go, kernel, [case["stride"]] * case["dims"], [case["padding"]] * case["dims"],
            [case["dilation"]] * case["dims"], 2)
    if formulation == "im2col":
        ours = python_impl._im2col_weight_grad(*args)
    else:
        ours = python_impl._shifted_window_weight_grad(*args, torch.float64)
    torch.testing.assert_close(ours, _original_grad_weight(x, go, kernel, case, groups=2))


@pytest.mark.parametrize("case", WEIGHT_GRAD_CASES, ids=_case_id)
def test_depthwise_weight_grad_matches_original(case):
    x, go, kernel = _problem(case, c_in=3, c_out=3, groups=3)
    dims = case["dims"]
    ours = python_impl._depthwise_weight_grad(
        x, go, kernel, [case["stride"]] * dims, [case["padding"]] * dims, [case["dilation"]] * dims
    )
    torch.testing.assert_close(ours, _original_grad_weight(x, go, kernel, case, groups=3))


# grad_input of a stride-1 convolution whose transposed convolution takes the THNN path: upstream
# picks it over oneDNN for an unstrided kernel of 1 in the last two dims, a batch < 16 and one thread.
SLOW_TRANSPOSED_LAYERS = {
    "2d,pointwise": dict(kernel=[1, 1], padding=[0, 0], c_in=8, c_out=16),
    "3d,temporal_3x1x1,padding=1": dict(kernel=[3, 1, 1], padding=[1, 0, 0], c_in=8, c_out=4),
    "3d,temporal_3x1x1,groups=2": dict(kernel=[3, 1, 1], padding=[0, 0, 0], c_in=8, c_out=4, groups=2),
}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)  # bfloat16 takes oneDNN
@pytest.mark.parametrize("layer", SLOW_TRANSPOSED_LAYERS.values(), ids=SLOW_TRANSPOSED_LAYERS.keys())
def test_grad_input_as_forward_convolution(one_thread, layer, dtype):
    kernel, padding, groups = layer["kernel"], layer["padding"], layer.get("groups", 1)
    dims = len(kernel)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, layer["c_in"], *[5] * dims, generator=g).to(dtype)
    w = torch.randn(layer["c_out"], layer["c_in"] // groups, *kernel, generator=g).to(dtype)
    out = [5 + 2 * p - k + 1 for p, k in zip(padding, kernel)]
    go = torch.randn(2, layer["c_out"], *out, generator=g).to(dtype)
    params = ([1] * dims, padding, [1] * dims, True, [0] * dims, groups)
    transposed_backend = torch._C._select_conv_backend(go, w, None, *params, None)
    assert int(transposed_backend) in python_impl._SLOW_TRANSPOSED, transposed_backend  # the branch runs
    for mask in ([True, False, False], [True, True, True]):
        args = (go, x, w, [layer["c_out"]], [1] * dims, padding, [1] * dims, False, [0] * dims, groups, mask)
        assert_matches_original(run_backend("python", *args), args)


# Transposed layers with output_padding: the output has rows no input reaches, so in grad_weight
# (input and grad_output swap roles) the "input" is longer than the kernel's reach. Every
# grad_weight formulation must cut them (the pointwise GEMMs did not: found by the fuzzer,
# a 1-D kernel-1 layer with dilation 2 and output_padding 1).
OUTPUT_PADDING_LAYERS = {
    "pointwise": dict(c_in=4, c_out=6, groups=1, kernel=1, stride=1, dilation=2, output_padding=1),
    "pointwise,grouped": dict(c_in=4, c_out=6, groups=2, kernel=1, stride=1, dilation=3, output_padding=2),
    "depthwise": dict(c_in=3, c_out=3, groups=3, kernel=3, stride=2, dilation=3, output_padding=2),
    "im2col": dict(c_in=1, c_out=4, groups=1, kernel=3, stride=2, dilation=1, output_padding=1),
    "shifted-window": dict(c_in=4, c_out=6, groups=2, kernel=3, stride=1, dilation=2, output_padding=1),
}


@pytest.mark.parametrize("dims", [1, 2, 3], ids=lambda d: f"dims={d}")
@pytest.mark.parametrize("layer", OUTPUT_PADDING_LAYERS.values(), ids=OUTPUT_PADDING_LAYERS.keys())
@pytest.mark.parametrize("backend", ["python", "compiled"])
def test_transposed_output_padding_rows_are_cut(backend, layer, dims):
    if aten_override.availability()[backend] is not None:
        pytest.skip(str(aten_override.availability()[backend]))
    g = torch.Generator().manual_seed(0)
    size, k = 4, layer["kernel"]
    x = torch.randn(2, layer["c_in"], *[size] * dims, generator=g, dtype=torch.float64)
    w = torch.randn(layer["c_in"], layer["c_out"] // layer["groups"], *[k] * dims, generator=g, dtype=torch.float64)
    conv = ([layer["stride"]] * dims, [0] * dims, [layer["dilation"]] * dims, True, [layer["output_padding"]] * dims,
            layer["groups"])
    out = torch.ops.aten.convolution(x, w, None, *conv)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    args = (go, x, w, [layer["c_out"]], *conv, [True, True, True])
    assert_matches_original(run_backend(backend, *args), args)
