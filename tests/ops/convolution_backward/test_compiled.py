"""The compiled (C++) backend against the original ATen kernel.

Every test that runs the backend proves it ran: ``aten_override.stats()`` counts the calls the C++
kernel served and the layer class that computed them (``compiled_layer_classes``). Values are
compared with the original kernel (float64) or with a float64 reference, within twice the original
kernel's own error (float32/bfloat16/float16); dtypes, shapes and strides must be identical.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import aten_override
from aten_override import _registration
from aten_override.ops.convolution_backward import compiled
from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs, amx_3d_weight

COMPILED_UNAVAILABLE = aten_override.availability()["compiled"]
pytestmark = pytest.mark.skipif(COMPILED_UNAVAILABLE is not None, reason=str(COMPILED_UNAVAILABLE))
NO_CUDA = "no CUDA device in this process (run scripts/gpu_check.sh on a GPU machine)"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

ALL_MASKS = [m for m in itertools.product([True, False], repeat=3)]
# The masks that reach a layer class's kernel: the others ask for neither grad_input nor grad_weight
# and are the bias-only class whatever the layer (test_matches_original runs them too).
KERNEL_MASKS = [m for m in ALL_MASKS if m[0] or m[1]]


# --- the problems --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
    """One convolution layer; ``layer_class`` is the compiled backend's class for it."""

    layer_class: str
    c_in: int
    c_out: int
    groups: int = 1
    transposed: bool = False


@dataclasses.dataclass(frozen=True)
class Geometry:
    name: str
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    output_padding: int = 0


LAYERS = {
    "depthwise": Layer("depthwise", 4, 4, groups=4),
    "depthwise-x2": Layer("depthwise", 4, 8, groups=4),  # channel multiplier 2
    "grouped": Layer("grouped", 8, 12, groups=2),
    "one-channel": Layer("one-channel", 1, 6),
    "dense": Layer("dense", 4, 6),
    "transposed": Layer("transposed", 4, 6, groups=2, transposed=True),
}
GEOMETRIES = [
    Geometry("k3,p1", 3, padding=1),
    Geometry("k3,s2", 3, stride=2),
    Geometry("k2,s3,p2,d2", 2, stride=3, padding=2, dilation=2),
]
TRANSPOSED_GEOMETRIES = [
    Geometry("k3,p1", 3, padding=1),
    Geometry("k3,s2,p1,op1", 3, stride=2, padding=1, output_padding=1),
    Geometry("k2,s3,p2,d2,op2", 2, stride=3, padding=2, dilation=2, output_padding=2),
]
# Large enough for 64 output elements per channel in every geometry (fewer: class "small-planes").
SPATIAL = {1: [200], 2: [22, 21], 3: [9, 10, 12]}
# Cases of the "dense" layer that a GEMM class claims: (dims, geometry, dtype) -> class.
DENSE_CLAIMED = {
    (1, "k3,p1", torch.float32): "kn2row",  # stride 1, taps in one dim (served by native)
    (3, "k3,s2", torch.float64): "im2col-3d",  # native picks Slow3d for float64 3-D
}


def make_args(
    layer: Layer,
    geometry: Geometry,
    dims: int,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
    output_mask=(True, True, True),
    batch: int = 2,
    device: str = "cpu",
    seed: int = 0,
    spatial: list[int] | None = None,
) -> ConvolutionBackwardArgs:
    """Random arguments of ``aten::convolution_backward`` for one layer (grad_output of the right size;
    input of ``spatial``, by default ``SPATIAL[dims]``)."""
    g = torch.Generator().manual_seed(seed)
    spatial = spatial or SPATIAL[dims]
    k = [geometry.kernel] * dims
    if layer.transposed:
        w_shape = [layer.c_in, layer.c_out // layer.groups, *k]
    else:
        w_shape = [layer.c_out, layer.c_in // layer.groups, *k]
    x = torch.randn([batch, layer.c_in, *spatial], generator=g, dtype=torch.float64)
    w = torch.randn(w_shape, generator=g, dtype=torch.float64)
    s, p, d, op = geometry.stride, geometry.padding, geometry.dilation, geometry.output_padding
    if layer.transposed:
        out = [(i - 1) * s - 2 * p + d * (kk - 1) + op + 1 for i, kk in zip(spatial, k)]
    else:
        out = [(i + 2 * p - d * (kk - 1) - 1) // s + 1 for i, kk in zip(spatial, k)]
    go = torch.randn([batch, layer.c_out, *out], generator=g, dtype=torch.float64)

    def place(t):
        t = t.to(dtype=dtype, device=device)
        if memory_format is not torch.contiguous_format and t.dim() in (4, 5):
            t = t.contiguous(memory_format=memory_format)
        return t

    return ConvolutionBackwardArgs(
        place(go), place(x), place(w), [layer.c_out], [s], [p], [d], layer.transposed,
        [op if layer.transposed else 0], layer.groups, list(output_mask),
    )


def _fmt_name(fmt: torch.memory_format) -> str:
    return str(fmt).replace("torch.", "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _mask_name(mask) -> str:
    return "mask=" + "".join("1" if m else "0" for m in mask)


def _cases():
    """(id, layer, geometry, dims, dtype, memory_format, output_mask)."""
    cases = []

    def add(name, geometry, dims, dtype=torch.float32, fmt=torch.contiguous_format, mask=(True, True, True)):
        layer = LAYERS[name]
        parts = [f"dim={dims}", name, geometry.name]
        if dtype is not torch.float32:
            parts.append(_dtype_name(dtype))
        if fmt is not torch.contiguous_format:
            parts.append(_fmt_name(fmt))
        if mask != (True, True, True):
            parts.append(_mask_name(mask))
        cases.append(pytest.param(layer, geometry, dims, dtype, fmt, mask, id=",".join(parts)))

    for name, layer in LAYERS.items():
        geometries = TRANSPOSED_GEOMETRIES if layer.transposed else GEOMETRIES
        for dims, geometry in itertools.product((1, 2, 3), geometries):
            add(name, geometry, dims)
        for dims, dtype in itertools.product((1, 2, 3), (torch.float64, torch.bfloat16, torch.float16)):
            add(name, geometries[1], dims, dtype=dtype)
        add(name, geometries[0], 2, fmt=torch.channels_last)
        add(name, geometries[1], 2, dtype=torch.bfloat16, fmt=torch.channels_last)
        add(name, geometries[0], 3, fmt=torch.channels_last_3d)
    for name in ("depthwise", "grouped", "one-channel", "dense"):
        for mask in ALL_MASKS:
            if mask != (True, True, True):
                add(name, GEOMETRIES[1], 2, mask=mask)
    return cases


# --- comparison -----------------------------------------------------------------------------------


def run_compiled(args: ConvolutionBackwardArgs):
    """``aten::convolution_backward`` through the dispatcher with the compiled backend enabled."""
    with aten_override.enable("compiled"):
        return torch.ops.aten.convolution_backward.default(*args.as_aten_args())


def to_float64(args: ConvolutionBackwardArgs) -> ConvolutionBackwardArgs:
    return dataclasses.replace(
        args, grad_output=args.grad_output.double(), input=args.input.double(), weight=args.weight.double()
    )


def assert_matches_original(args: ConvolutionBackwardArgs, ours) -> None:
    """``ours`` has the original kernel's None pattern, shapes, dtypes and strides, and its values
    (float64: close to the original's; float32/bfloat16/float16: as close to a float64 reference as
    twice the original kernel's own error, plus 8 eps of the largest magnitude)."""
    device = args.grad_output.device.type
    original = aten_override.original_kernel(device)
    ref = original(*args.as_aten_args())
    dtype = args.grad_output.dtype
    reduced = dtype != torch.float64
    ref64 = original(*to_float64(args).as_aten_args()) if reduced else None
    eps = torch.finfo(dtype).eps
    for i, name in enumerate(("grad_input", "grad_weight", "grad_bias")):
        if not args.output_mask[i]:
            assert ours[i] is None, f"{name} must be None when output_mask[{i}] is False"
            continue
        a, b = ours[i], ref[i]
        assert a.shape == b.shape, name
        assert a.dtype == b.dtype, name
        assert a.stride() == b.stride(), f"{name}: strides {a.stride()} != original's {b.stride()}"
        if not reduced:
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
        else:
            exact = ref64[i]
            ours_err = (a.double() - exact).abs().max().item()
            native_err = (b.double() - exact).abs().max().item()
            scale = exact.abs().max().item()
            assert ours_err <= 2 * native_err + 8 * eps * scale, (
                f"{name}: error {ours_err:.3g} vs the original kernel's {native_err:.3g} (scale {scale:.3g})"
            )


def run_compiled_on_one_thread(args: ConvolutionBackwardArgs):
    """:func:`run_compiled` with ``torch.set_num_threads(1)``, the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_compiled(args)
    finally:
        torch.set_num_threads(threads)


def assert_compiled_served(layer_class: str, calls: int = 1) -> None:
    stats = aten_override.stats()
    assert stats.get("compiled", 0) == calls, stats
    assert stats.get("fallback", 0) == 0, stats
    assert stats.get("compiled_layer_classes", {}) == {layer_class: calls}, stats


def assert_class_serves_with_original_results(args: ConvolutionBackwardArgs, layer_class: str) -> None:
    """``layer_class`` is the class of ``args``, the compiled backend serves the call through the
    dispatcher with it, and the result matches the original kernel's (:func:`assert_matches_original`)."""
    assert compiled.layer_class(args) == layer_class
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served(layer_class)
    assert_matches_original(args, ours)


# --- the matrix -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer,geometry,dims,dtype,memory_format,output_mask", _cases())
def test_matches_original(layer, geometry, dims, dtype, memory_format, output_mask):
    args = make_args(layer, geometry, dims, dtype, memory_format, output_mask)
    aten_override.reset_stats()
    ours = run_compiled(args)
    expected = layer.layer_class
    if layer.layer_class == "dense":
        expected = DENSE_CLAIMED.get((dims, geometry.name, dtype), "dense")
    if expected in ("dense", "transposed") and amx_3d_weight(args):
        expected = "dead-taps"  # native's bfloat16 3-D grad_weight is wrong on AMX: fold-2d or the upcast
    if not output_mask[0] and not output_mask[1] and expected != "empty":
        expected = "bias-only"  # grad_bias alone is grad_output's sum, whatever the layer
    assert_compiled_served(expected)
    assert_matches_original(args, ours)


@pytest.mark.parametrize("name", ["depthwise", "grouped", "one-channel"])
def test_non_contiguous_inputs(name):
    """Transposed-stride grad_output/input/weight views (not in a memory format) give the same values."""
    args = make_args(LAYERS[name], GEOMETRIES[0], 2)

    def strided(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    args = dataclasses.replace(
        args, grad_output=strided(args.grad_output), input=strided(args.input), weight=strided(args.weight)
    )
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served(LAYERS[name].layer_class)
    assert_matches_original(args, ours)


def test_python_kernel_path_uses_the_binding():
    """With install() the Python kernel stays registered and serves the compiled backend through the
    extension's binding: same values, the C++ layer class is counted."""
    args = make_args(LAYERS["depthwise"], GEOMETRIES[1], 2)
    aten_override.install()
    try:
        assert "_registration.py" in torch._C._dispatch_dump("aten::convolution_backward")
        aten_override.reset_stats()
        ours = run_compiled(args)
        assert "_registration.py" in torch._C._dispatch_dump("aten::convolution_backward")
    finally:
        aten_override.uninstall()
    assert_compiled_served("depthwise")
    assert_matches_original(args, ours)


def test_cpp_kernel_registered_only_while_enabled():
    def ours_registered():
        return "csrc/convolution_backward.cpp" in torch._C._dispatch_dump("aten::convolution_backward")

    assert not ours_registered()
    with aten_override.enable("compiled"):
        assert ours_registered()
        with aten_override.enable("python"):
            assert not ours_registered()
        assert ours_registered()
        previous = _registration.set_observer(lambda keyset, aten_args, impl, route: route(keyset, aten_args, impl))
        try:
            assert not ours_registered()
        finally:
            _registration.set_observer(previous)
        assert ours_registered()
    assert not ours_registered()
    assert not aten_override.is_registered()


# --- contract details -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["depthwise", "grouped", "one-channel"])
def test_deterministic_across_runs_and_thread_counts(name):
    args = make_args(LAYERS[name], GEOMETRIES[0], 2, batch=3)
    first = run_compiled(args)
    single = run_compiled_on_one_thread(args)
    again = run_compiled(args)
    for a, b, c in zip(first, single, again):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("bias_sizes", [None, [4]], ids=["bias_sizes=None", "bias_sizes=[4]"])
@pytest.mark.parametrize("empty", ["batch", "channels"])
def test_empty_gives_zeros(empty, bias_sizes):
    """Zero batch / zero input channels: zeros of the right shapes, and no abort with bias_sizes=None
    (upstream dereferences the empty optional there)."""
    n, c = (0, 4) if empty == "batch" else (2, 0)
    x = torch.randn(n, c, 5, 5)
    w = torch.randn(4, c, 3, 3)
    go = torch.randn(n, 4, 3, 3)
    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        gi, gw, gb = torch.ops.aten.convolution_backward.default(
            go, x, w, bias_sizes, [1], [0], [1], False, [0], 1, [True, True, True]
        )
    assert_compiled_served("empty")
    assert gi.shape == x.shape and gw.shape == w.shape and gb.shape == (4,)
    assert not gi.any() and not gw.any() and not gb.any()


@pytest.mark.parametrize("grad", ["input", "weight"])
@pytest.mark.parametrize("name", ["depthwise", "grouped"])
def test_nn_grad_placeholders(name, grad):
    """torch.nn.grad passes a stride-0 placeholder for the tensor whose gradient it does not want."""
    layer = LAYERS[name]
    args = make_args(layer, GEOMETRIES[1], 2)
    x, w, go = args.input, args.weight, args.grad_output
    if grad == "input":
        def fn():
            return torch.nn.grad.conv2d_input(x.shape, w, go, stride=2, groups=layer.groups)
    else:
        def fn():
            return torch.nn.grad.conv2d_weight(x, w.shape, go, stride=2, groups=layer.groups)
    expected = fn()
    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        ours = fn()
    assert_compiled_served(layer.layer_class)
    torch.testing.assert_close(ours, expected)
    assert ours.stride() == expected.stride()


def test_vmap_per_sample_grads():
    """vmap over a batch of B samples calls convolution_backward with groups=groups*B."""
    conv = torch.nn.Conv2d(4, 8, 3, padding=1, groups=2)
    params = {k: v.detach() for k, v in conv.named_parameters()}
    x = torch.randn(5, 4, 10, 10)

    def loss(p, sample):
        return torch.func.functional_call(conv, p, (sample.unsqueeze(0),)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    expected = per_sample(params, x)
    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        ours = per_sample(params, x)
    stats = aten_override.stats()
    assert stats.get("compiled") == 1 and stats["compiled_layer_classes"] == {"grouped": 1}, stats
    for key in expected:
        torch.testing.assert_close(ours[key], expected[key])


ERRORS = [
    ("groups", dict(groups=4), r"convolution_backward\[compiled\]: groups \(4\) must divide C_out \(6\)"),
    ("stride", dict(stride=[0]), r"convolution_backward\[compiled\]: non-positive stride is not supported, got stride=\[0, 0\]"),
    ("padding", dict(padding=[-1]), r"negative padding is not supported"),
    ("dilation", dict(dilation=[1, 1, 1]), r"expected dilation to be a single integer value or a list of 2 values"),
    ("output_padding", dict(output_padding=[1]), r"output_padding is not supported for non-transposed"),
    ("grad_output", dict(grad_output=torch.randn(2, 6, 4, 4)), r"grad_output spatial size \[4, 4\] does not match"),
    ("dtype", dict(weight=torch.randn(6, 4, 3, 3, dtype=torch.float64)), r"must have the same dtype"),
]


@pytest.mark.parametrize("change,match", [pytest.param(c, m, id=i) for i, c, m in ERRORS])
def test_errors_name_op_backend_and_values(change, match):
    args = ConvolutionBackwardArgs(
        torch.randn(2, 6, 3, 3), torch.randn(2, 4, 5, 5), torch.randn(6, 4, 3, 3), [6], [1], [0], [1], False, [0], 1,
        [True, True, True],
    )
    args = dataclasses.replace(args, **change)
    with aten_override.enable("compiled"), pytest.raises(RuntimeError, match=match):
        torch.ops.aten.convolution_backward.default(*args.as_aten_args())
    with pytest.raises(RuntimeError, match=match):
        compiled.convolution_backward(args)


def test_unsupported_dtype_falls_back_with_reason():
    x, w, go = torch.ones(2, 4, 5, 5, dtype=torch.int64), torch.ones(6, 4, 3, 3, dtype=torch.int64), None
    go = torch.ones(2, 6, 3, 3, dtype=torch.int64)
    args = ConvolutionBackwardArgs(go, x, w, [6], [1], [0], [1], False, [0], 1, [True, True, True])
    assert compiled.unsupported_reason(args) == "dtype torch.int64 is not supported (only float64/float32/bfloat16/float16)"
    aten_override.reset_stats()
    with aten_override.enable("compiled"), pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        torch.ops.aten.convolution_backward.default(*args.as_aten_args())
    stats = aten_override.stats()
    assert stats["fallback"] == 1 and stats["aten"] == 1, stats
    assert stats["fallback_reasons"] == {"compiled: " + compiled.unsupported_reason(args): 1}


def _small_planes(name: str, dims: int = 2) -> ConvolutionBackwardArgs:
    """Planes of 7, 7x7 and 1x7x7: under the direct kernel's 64 output elements per channel."""
    args = make_args(LAYERS[name], GEOMETRIES[0], dims)
    window = (slice(None), slice(None)) + (slice(0, 1),) * (dims - 2) + (slice(0, 7),) * min(dims, 2)
    return dataclasses.replace(
        args, input=args.input[window].contiguous(), grad_output=args.grad_output[window].contiguous()
    )


def test_small_planes_go_to_native():
    small = _small_planes("grouped")
    assert compiled.layer_class(small) == "small-planes"
    aten_override.reset_stats()
    ours = run_compiled(small)
    assert_compiled_served("small-planes")
    assert_matches_original(small, ours)


@pytest.mark.parametrize("output_mask", [(True, True, True), (True, False, False), (False, True, True)], ids=_mask_name)
def test_depthwise_large_output(output_mask):
    """A grad_input of 10 MiB (written with non-temporal stores) and 32x32 planes (several channels per
    task): the original kernel's values (float32; the float64 reference is in the matrix above), and
    bitwise the same with one thread."""
    g = torch.Generator().manual_seed(0)
    n, c = 5, 512
    args = ConvolutionBackwardArgs(
        torch.randn(n, c, 32, 32, generator=g), torch.randn(n, c, 32, 32, generator=g),
        torch.randn(c, 1, 3, 3, generator=g), [c], [1], [1], [1], False, [0], c, list(output_mask),
    )
    assert args.input.numel() * 4 >= 8 << 20
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served("depthwise")
    ref = aten_override.original_kernel("cpu")(*args.as_aten_args())
    for name, a, b in zip(("grad_input", "grad_weight", "grad_bias"), ours, ref):
        if a is None:
            continue
        assert a.stride() == b.stride(), name
        # Sums over 5 * 32 * 32 products (grad_weight): float32 rounding of either kernel.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3, msg=lambda m: f"{name}: {m}")
    single = run_compiled_on_one_thread(args)
    for a, b in zip(ours, single):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dims", [1, 2, 3], ids=lambda d: f"dim={d}")
@pytest.mark.parametrize("name", ["depthwise", "depthwise-x2"])
def test_depthwise_small_planes_stay_depthwise(name, dims):
    """MobileNetV2's 7x7 stages: the fused depthwise kernel serves planes of any size."""
    small = _small_planes(name, dims)
    assert small.grad_output[0, 0].numel() < 64
    aten_override.reset_stats()
    ours = run_compiled(small)
    assert_compiled_served("depthwise")
    assert_matches_original(small, ours)


# --- the channels-in-lanes depthwise kernel -------------------------------------------------------

# 20 channels: a full block of 16 lanes (float32 / reduced; 8 for float64) and a partial one.
LANES_LAYERS = {
    "c20": Layer("depthwise", 20, 20, groups=20),
    "c20-x2": Layer("depthwise", 20, 40, groups=20),  # channel multiplier 2
}
LANES_GEOMETRIES = GEOMETRIES + [
    Geometry("k5,s2,p2", 5, stride=2, padding=2),
    Geometry("k3,p2,d2", 3, padding=2, dilation=2),
]
# "small": input planes of at most 128 elements, any stride; "strided": larger planes, stride > 1
# (grad_output planes of at most 1,024 elements).
LANES_SPATIAL = {
    "small": {1: [37], 2: [9, 11], 3: [3, 5, 6]},
    "strided": {1: [300], 2: [30, 34], 3: [6, 10, 12]},
}


def _lanes_cases():
    cases = []

    def add(name, geometry, dims, size="small", dtype=torch.float32, fmt=torch.contiguous_format, mask=(True,) * 3):
        parts = [f"dim={dims}", name, geometry.name, size]
        if dtype is not torch.float32:
            parts.append(_dtype_name(dtype))
        if fmt is not torch.contiguous_format:
            parts.append(_fmt_name(fmt))
        if mask != (True,) * 3:
            parts.append(_mask_name(mask))
        cases.append(pytest.param(name, geometry, dims, size, dtype, fmt, mask, id=",".join(parts)))

    for name, dims, geometry in itertools.product(LANES_LAYERS, (1, 2, 3), LANES_GEOMETRIES):
        add(name, geometry, dims)
        if geometry.stride > 1:
            add(name, geometry, dims, size="strided")
    for name, dims, dtype in itertools.product(LANES_LAYERS, (1, 2, 3), (torch.float64, torch.bfloat16, torch.float16)):
        add(name, LANES_GEOMETRIES[3], dims, dtype=dtype)
        add(name, LANES_GEOMETRIES[1], dims, size="strided", dtype=dtype)
    for name in LANES_LAYERS:
        add(name, GEOMETRIES[0], 2, fmt=torch.channels_last)
        add(name, GEOMETRIES[1], 2, size="strided", dtype=torch.bfloat16, fmt=torch.channels_last)
        add(name, GEOMETRIES[0], 3, fmt=torch.channels_last_3d)
        for mask in KERNEL_MASKS:
            if mask != (True,) * 3:
                add(name, GEOMETRIES[1], 2, mask=mask)
    return cases


@pytest.mark.parametrize("name,geometry,dims,size,dtype,memory_format,output_mask", _lanes_cases())
def test_depthwise_lanes_kernel_matches_original(name, geometry, dims, size, dtype, memory_format, output_mask):
    """The channels-in-lanes depthwise kernel (small or strided planes: MobileNetV2's 7x7 and
    stride-2 stages) against the original kernel and float64, as the matrix above."""
    args = make_args(
        LANES_LAYERS[name], geometry, dims, dtype, memory_format, output_mask, batch=3,
        spatial=LANES_SPATIAL[size][dims],
    )
    assert compiled.depthwise_kernel(args) == "channels-in-lanes"
    assert_class_serves_with_original_results(args, "depthwise")


def test_depthwise_kernel_choice():
    """Which depthwise kernel takes a call: lanes for small or strided planes with at least half a
    vector of channels, per-plane otherwise; None for other classes."""
    def kernel(c, spatial, geometry=GEOMETRIES[0], dtype=torch.float32, layer=None):
        layer = layer or Layer("depthwise", c, c, groups=c)
        return compiled.depthwise_kernel(make_args(layer, geometry, len(spatial), dtype, spatial=spatial))

    assert kernel(16, [11, 11]) == "channels-in-lanes"  # 121 elements
    assert kernel(16, [12, 12]) == "per-plane"  # 144, stride 1
    assert kernel(16, [56, 56], GEOMETRIES[1]) == "channels-in-lanes"  # stride 2: 27x27 grad_output
    assert kernel(16, [70, 70], GEOMETRIES[1]) == "per-plane"  # 34x34 grad_output
    assert kernel(7, [7, 7]) == "per-plane"  # under half of 16 lanes
    assert kernel(4, [7, 7], dtype=torch.float64) == "channels-in-lanes"  # half of 8 lanes
    assert kernel(0, [7, 7], layer=LAYERS["grouped"]) is None


@pytest.mark.parametrize("output_mask", [(True, True, True), (True, False, False)], ids=_mask_name)
def test_depthwise_lanes_kernel_large_output_and_deterministic(output_mask):
    """A 10 MiB grad_input (written with non-temporal stores) through the lanes kernel: the original
    kernel's values, bitwise the same again and with one thread."""
    layer = Layer("depthwise", 520, 520, groups=520)
    args = make_args(layer, GEOMETRIES[1], 2, output_mask=output_mask, batch=5, spatial=[32, 32])
    assert args.input.numel() * 4 >= 8 << 20
    assert compiled.depthwise_kernel(args) == "channels-in-lanes"
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served("depthwise")
    assert_matches_original(args, ours)
    for again in (run_compiled(args), run_compiled_on_one_thread(args)):
        for a, b in zip(ours, again):
            assert (a is None and b is None) or torch.equal(a, b)


# --- the grouped-lanes class --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GroupedLanesCase:
    """A strided grouped layer of at least 2^20 grad_output elements whose group tiles fit L2."""

    c_in: int
    c_out: int
    groups: int
    batch: int
    spatial: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple

    def args(self, dtype=torch.float32, output_mask=(True, True, True)) -> ConvolutionBackwardArgs:
        g = torch.Generator().manual_seed(0)
        out = [
            (i + 2 * p - d * (k - 1) - 1) // s + 1
            for i, k, s, p, d in zip(self.spatial, self.kernel, self.stride, self.padding, self.dilation)
        ]

        def rand(*shape):
            return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

        return ConvolutionBackwardArgs(
            rand(self.batch, self.c_out, *out), rand(self.batch, self.c_in, *self.spatial),
            rand(self.c_out, self.c_in // self.groups, *self.kernel), [self.c_out], list(self.stride),
            list(self.padding), list(self.dilation), False, [0] * len(self.kernel), self.groups, list(output_mask),
        )


GROUPED_LANES = {
    # Each over 2^20 grad_output elements (the class's bound), with float32 tiles within a 512 KiB L2
    # (Zen 3's; the 2-D cases' 62x62 planes, 795 KiB of tiles, were grouped-gemm there).
    # ResNeXt-like: 16 channels per group, 3x3 stride 2; 62 x 32 x 23 x 23 grad_output elements. Rows
    # of 23 positions per stride phase: blocks of 4 and a tail of 3 (the 1-D case: tails of 2 and 1).
    "16x16,g2,2d": GroupedLanesCase(32, 32, 2, 62, (46, 46), (3, 3), (2, 2), (1, 1), (1, 1)),
    # Stride 3, dilation 2, padding 2 (stride phases with no tap).
    "16x16,g2,2d,s3,d2": GroupedLanesCase(32, 32, 2, 128, (44, 44), (2, 2), (3, 3), (2, 2), (2, 2)),
    # Partial vectors on both sides (9 and 20 channels per group).
    "9x20,g3,1d": GroupedLanesCase(27, 60, 3, 18, (2003,), (3,), (2,), (1,), (1,)),
    # 3-D, stride 2 in one dim only, 20 x 12 channels per group.
    "20x12,g2,3d": GroupedLanesCase(40, 24, 2, 122, (6, 10, 12), (3, 3, 3), (1, 1, 2), (1, 1, 1), (1, 1, 1)),
}


def skip_unless_grouped_tiles_fit(args: ConvolutionBackwardArgs) -> None:
    """grouped-lanes declines a call whose tiles exceed this machine's L2, saying so: the cases above
    fit 512 KiB; on a CPU with less L2 they are skipped with that reason, not failed."""
    try:
        compiled.extension().run_kernel("grouped-lanes", *args.as_aten_args())
    except ValueError as e:
        if "are over the L2" not in str(e):
            raise
        pytest.skip(str(e))


def _grouped_lanes_cases():
    cases = [pytest.param(name, torch.float32, (True,) * 3, id=name) for name in GROUPED_LANES]
    # float64 tiles are twice the bytes: the 2-D case is over the L2 bound there (grouped-gemm).
    for name, dtype in [("9x20,g3,1d", torch.float64), ("9x20,g3,1d", torch.bfloat16), ("16x16,g2,2d", torch.bfloat16)]:
        cases.append(pytest.param(name, dtype, (True,) * 3, id=f"{name},{_dtype_name(dtype)}"))
    for mask in ((True, False, False), (False, True, True)):
        cases.append(pytest.param("9x20,g3,1d", torch.float32, mask, id=f"9x20,g3,1d,{_mask_name(mask)}"))
    return cases


@pytest.mark.parametrize("name,dtype,output_mask", _grouped_lanes_cases())
def test_grouped_lanes_matches_original(name, dtype, output_mask):
    """ResNeXt-like strided grouped layers: the grouped kernel's values (within twice native's error
    against float64), None pattern, dtypes and strides."""
    args = GROUPED_LANES[name].args(dtype, output_mask)
    assert args.grad_output.numel() >= 1 << 20
    skip_unless_grouped_tiles_fit(args)
    assert_class_serves_with_original_results(args, "grouped-lanes")


def test_grouped_lanes_long_sums_as_accurate_as_native():
    """grad_weight sums a sample's 1,002 output positions of mean-1 data: summed in float32 chunks of
    32 positions (then in double over the batch) it measured 0.9 eps of the scale, native 3.5; one
    running float32 sum per sample (the lanes kernels' known failure, see
    test_compiled_adversarial.py) 3.2. Within 2 eps, and within twice native's error."""
    args = GROUPED_LANES["9x20,g3,1d"].args(output_mask=(False, True, False))
    args = dataclasses.replace(args, grad_output=args.grad_output + 1, input=args.input + 1)
    assert compiled.layer_class(args) == "grouped-lanes"
    ours = run_compiled(args)[1]
    original = aten_override.original_kernel("cpu")
    native = original(*args.as_aten_args())[1]
    exact = original(*to_float64(args).as_aten_args())[1]
    eps, scale = torch.finfo(torch.float32).eps, exact.abs().max().item()
    ours_err, native_err = ((t.double() - exact).abs().max().item() for t in (ours, native))
    assert ours_err <= min(2 * eps * scale, 2 * native_err), (ours_err / eps / scale, native_err / eps / scale)


def test_grouped_lanes_deterministic_and_layouts():
    """Bitwise the same again and with one thread; channels_last input gives native's strides."""
    args = GROUPED_LANES["9x20,g3,1d"].args()
    first = run_compiled(args)
    for again in (run_compiled(args), run_compiled_on_one_thread(args)):
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    cl = GROUPED_LANES["16x16,g2,2d"].args()
    cl = dataclasses.replace(cl, input=cl.input.contiguous(memory_format=torch.channels_last))
    skip_unless_grouped_tiles_fit(cl)
    assert compiled.layer_class(cl) == "grouped-lanes"
    assert_matches_original(cl, run_compiled(cl))


@pytest.mark.parametrize(
    "c_in, c_out, groups, batch, spatial, stride, dtype, expected",
    [
        (32, 32, 2, 32, [64, 64], 1, torch.float32, "dense"),  # stride 1: native is as fast or faster
        (132, 132, 2, 1, [40, 40], 1, torch.float32, "dense"),  # stride 1, over 64 channels a side
        (32, 32, 2, 2, [46, 46], 2, torch.float32, "dense"),  # 2^15 grad_output elements
        (32, 32, 2, 62, [46, 46], 2, torch.float16, "dense"),  # float16: not measured
        (32, 32, 2, 62, [46, 46], 2, torch.float32, "grouped-lanes"),  # 449 KiB of tiles
        (32, 32, 2, 8, [128, 128], 2, torch.float32, "grouped-gemm"),  # tiles over 3 MiB
    ],
    ids=["stride=1", "stride=1,gemm-sized", "small", "float16", "claimed", "large-planes"],
)
def test_grouped_lanes_routing(c_in, c_out, groups, batch, spatial, stride, dtype, expected):
    """grouped-lanes (and grouped-gemm) take only strided grouped layers, large enough; the rest go to
    native (the dense class), which was faster there."""
    geometry = Geometry("k3", 3, stride=stride, padding=1)
    layer = Layer("grouped-lanes", c_in, c_out, groups=groups)
    args = make_args(layer, geometry, len(spatial), dtype, batch=batch, spatial=spatial)
    if stride > 1 and expected != "grouped-gemm" and dtype != torch.float16:
        skip_unless_grouped_tiles_fit(args)
    assert compiled.layer_class(args) == expected


def test_layer_class_table_matches_docs():
    names = [row[0] for row in compiled.LAYER_CLASSES]
    assert names == [
        "empty", "depthwise", "grouped", "one-channel", "small-planes", "dense", "transposed", "bias-only",
        "pointwise", "grouped-gemm", "kn2row-3d", "im2col-3d", "kn2row", "dead-taps", "grouped-lanes",
    ]
    for name, kernel, _ in compiled.LAYER_CLASSES:
        assert f"{name} " in compiled.__doc__ and kernel in ("direct", "gemm", "zeros", "sum", "native", "upcast")
    args = make_args(LAYERS["grouped"], GEOMETRIES[0], 2)
    assert compiled.layer_class(args) == "grouped"


# --- the GEMM classes (cpu/gemm.cpp) -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """A layer one GEMM class claims; ``native`` is the backend native picks, which the class depends on."""

    layer_class: str
    c_in: int
    c_out: int
    spatial: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    groups: int = 1
    batch: int = 2
    native: str = ""

    def args(self, dtype=torch.float32, memory_format=torch.contiguous_format, output_mask=(True, True, True)):
        g = torch.Generator().manual_seed(0)
        out = [(i + 2 * p - (k - 1) - 1) // s + 1 for i, k, s, p in zip(self.spatial, self.kernel, self.stride, self.padding)]

        def rand(*shape):
            t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            return t.contiguous(memory_format=memory_format) if memory_format is not torch.contiguous_format else t

        return ConvolutionBackwardArgs(
            rand(self.batch, self.c_out, *out), rand(self.batch, self.c_in, *self.spatial),
            rand(self.c_out, self.c_in // self.groups, *self.kernel), [self.c_out], list(self.stride),
            list(self.padding), [1] * len(self.kernel), False, [0] * len(self.kernel), self.groups, list(output_mask),
        )


GEMM_CASES = {
    # 1x1 stride 1, 24x24 = 576 positions per sample: input / grad_input used in place (views).
    "pointwise,views": GemmCase("pointwise", 8, 6, (24, 24), (1, 1), (1, 1), (0, 0), native="Mkldnn"),
    # 1x1 stride 2: a strided gather; the batch folded into one GEMM.
    "pointwise,s2": GemmCase("pointwise", 8, 6, (19, 19), (1, 1), (2, 2), (0, 0), native="Mkldnn"),
    # 1x1 stride 1, small samples: folded (copies).
    "pointwise,folded": GemmCase("pointwise", 8, 6, (10, 10), (1, 1), (1, 1), (0, 0), batch=3, native="Mkldnn"),
    # (C_in / groups) * (C_out / groups) = 81 > 64: im2col per group, samples folded / whole / row chunks.
    # 66 channels per group (over grouped-lanes' 64), stride 2; 66 * 10 rows of 4 bytes per column in a
    # 1 MiB chunk: up to 397 columns. 6x6 output positions: samples folded; 15x16: one sample a chunk;
    # 30x31: chunks of rows.
    "grouped-gemm": GemmCase("grouped-gemm", 132, 132, (11, 12), (3, 3), (2, 2), (1, 1), groups=2),
    "grouped-gemm,whole": GemmCase("grouped-gemm", 132, 132, (30, 32), (3, 3), (2, 2), (1, 1), groups=2),
    "grouped-gemm,rows": GemmCase("grouped-gemm", 132, 132, (60, 61), (3, 3), (2, 2), (1, 1), groups=2, batch=1),
    # native picks Slow3d for float32 3-D with batch 1.
    "kn2row-3d": GemmCase("kn2row-3d", 4, 5, (6, 7, 8), (3, 1, 1), (1, 1, 1), (1, 0, 0), batch=1, native="Slow3d"),
    # float32 with a batch of 2 goes to oneDNN; from 2^18 grad_output elements kn2row-3d takes it too.
    "kn2row-3d,onednn": GemmCase("kn2row-3d", 16, 16, (8, 32, 32), (3, 1, 1), (1, 1, 1), (1, 0, 0), batch=2, native="Mkldnn"),
    "im2col-3d": GemmCase("im2col-3d", 4, 5, (6, 7, 8), (3, 2, 3), (1, 2, 1), (1, 0, 2), batch=1, native="Slow3d"),
    # 3 x 27 rows x 25600 positions (9 MB) exceed the 8 MiB workspace: chunks of output rows.
    "im2col-3d,rows": GemmCase("im2col-3d", 3, 8, (16, 40, 40), (3, 3, 3), (1, 1, 1), (1, 1, 1), batch=1, native="Slow3d"),
    "kn2row": GemmCase("kn2row", 4, 5, (50,), (7,), (1,), (9,)),
}


def native_backend(args: ConvolutionBackwardArgs) -> str:
    a = args
    backend = torch._C._select_conv_backend(
        a.input, a.weight, None, a.stride, a.padding, a.dilation, a.transposed, a.output_padding, a.groups, None
    )
    return backend.name


@pytest.fixture
def native_multithreaded():
    """At least two intra-op threads for the block, the thread count restored after. Native picks
    oneDNN for an unstrided 1x1 float32 layer with a batch under 16 only when more than one thread
    runs (upstream's ``ConvParams::use_mkldnn``: THNN is faster single-threaded); with one
    (``OMP_NUM_THREADS=1``, a one-CPU runner) it picks Slow2d and the pointwise cases below would
    test the dense class instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gemm_cases():
    cases = []
    for name, case in GEMM_CASES.items():
        cases.append(pytest.param(name, torch.float32, torch.contiguous_format, (True, True, True), id=name))
    for name in ("pointwise,views", "pointwise,s2", "grouped-gemm", "kn2row-3d", "im2col-3d"):
        fmt = torch.channels_last_3d if "3d" in name else torch.channels_last
        cases.append(pytest.param(name, torch.float32, fmt, (True, True, True), id=f"{name},{_fmt_name(fmt)}"))
        cases.append(pytest.param(name, torch.float64, torch.contiguous_format, (True, True, True), id=f"{name},float64"))
        for mask in KERNEL_MASKS:
            if mask != (True, True, True):
                cases.append(
                    pytest.param(name, torch.float32, torch.contiguous_format, mask, id=f"{name},{_mask_name(mask)}")
                )
    cases.append(pytest.param("pointwise,s2", torch.bfloat16, torch.contiguous_format, (True,) * 3, id="pointwise,s2,bfloat16"))
    return cases


@pytest.mark.usefixtures("native_multithreaded")
@pytest.mark.parametrize("name,dtype,memory_format,output_mask", _gemm_cases())
def test_gemm_class_matches_original(name, dtype, memory_format, output_mask):
    """Each GEMM class serves the layers it claims, with the original kernel's values (within twice its
    error in float32 / bfloat16), None pattern, dtypes and exact strides."""
    case = GEMM_CASES[name]
    args = case.args(dtype, memory_format, output_mask)
    # The class depends on native's choice: it takes over oneDNN's pointwise and Slow3d's 3-D layers;
    # others (float64 pointwise: Slow2d; bfloat16 on a CPU without oneDNN bfloat16) stay dense.
    if case.native and dtype is torch.float32:
        assert native_backend(args) == case.native, "native changed its backend; revisit the GEMM classes"
    expected = case.layer_class if not case.native or native_backend(args) == case.native else "dense"
    assert compiled.layer_class(args) == expected
    aten_override.reset_stats()
    ours = run_compiled(args)
    assert_compiled_served(expected)
    assert_matches_original(args, ours)


@pytest.mark.usefixtures("native_multithreaded")
@pytest.mark.parametrize("name", ["pointwise,views", "grouped-gemm", "kn2row-3d", "im2col-3d"])
def test_gemm_expanded_grad_output_and_deterministic(name):
    """A stride-0 (expanded) grad_output and transposed-stride input give native's values; two runs
    give the same bits; no input is changed."""
    case = GEMM_CASES[name]
    args = case.args()
    go = args.grad_output[:, :, ..., :1].expand(args.grad_output.shape)
    x = args.input.transpose(-1, -2).contiguous().transpose(-1, -2)
    args = dataclasses.replace(args, grad_output=go, input=x)
    before = [t.clone() for t in (go, x, args.weight)]
    aten_override.reset_stats()
    first, again = run_compiled(args), run_compiled(args)
    assert_compiled_served(case.layer_class, calls=2)
    assert_matches_original(args, first)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for t, b in zip((go, x, args.weight), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize(
    "name,dtype",
    [("grouped-gemm", torch.bfloat16), ("im2col-3d", torch.float16), ("pointwise,views", torch.bfloat16)],
)
def test_gemm_classes_leave_unmeasured_dtypes_to_native(name, dtype):
    """float16 and bfloat16 layers stay "dense" but bfloat16 pointwise layers whose batch is one GEMM
    (pointwise,views: one GEMM per sample, which would need float32): not measured faster than native."""
    args = GEMM_CASES[name].args(dtype)
    assert compiled.layer_class(args) == "dense"


def test_tiny_pointwise_and_3d_layers_stay_dense():
    """Under 512 grad_output elements the GEMM classes do not ask native's path: dense."""
    case = dataclasses.replace(GEMM_CASES["pointwise,s2"], spatial=(9, 9))  # 2 x 6 x 5 x 5 = 300
    args = case.args()
    assert native_backend(args) == "Mkldnn" and args.grad_output.numel() < 512
    assert compiled.layer_class(args) == "dense"


@pytest.mark.parametrize("name", ["depthwise", "one-channel"])
def test_opcheck(name):
    args = make_args(LAYERS[name], GEOMETRIES[1], 2)
    with aten_override.enable("compiled"):
        torch.library.opcheck(
            torch.ops.aten.convolution_backward.default,
            args.as_aten_args(),
            test_utils=("test_schema", "test_faketensor"),
        )
    assert aten_override.stats()["compiled_layer_classes"][LAYERS[name].layer_class] >= 1


@requires_cuda
@pytest.mark.cuda
@pytest.mark.skipif(compiled.cuda_kernels() == "enabled", reason="CUDA kernels enabled: test_compiled_cuda.py tests CUDA calls")
@pytest.mark.parametrize("name", list(LAYERS))
def test_cuda_routes_to_original_with_reason(name):
    """CUDA kernels not built or not enabled: CUDA calls run the original kernel with the reason recorded."""
    layer = LAYERS[name]
    geometry = (TRANSPOSED_GEOMETRIES if layer.transposed else GEOMETRIES)[1]
    args = make_args(layer, geometry, 2, device="cuda")
    aten_override.reset_stats()
    ours = run_compiled(args)
    stats = aten_override.stats()
    reason = compiled.extension().cuda_unsupported_reason()
    assert stats["fallback_reasons"] == {f"compiled: {reason}": 1}, stats
    assert_matches_original(args, ours)


@pytest.mark.parametrize(
    "layer_class, c_in, c_out, groups",
    [("depthwise", 8, 8, 8), ("depthwise", 4, 8, 4), ("grouped", 8, 8, 2), ("one-channel", 1, 8, 1)],
    ids=["depthwise", "depthwise-x2", "grouped", "one-channel"],
)
def test_long_reductions_as_accurate_as_native(layer_class, c_in, c_out, groups):
    """grad_weight and grad_bias sum over N x H x W = 36,864 products per element of data with mean 1,
    where a float32 running sum drifts: within twice native's error against the float64 result for
    every class of the direct kernels (the fused depthwise kernel sums each sample in float32 lanes,
    then the batch in double; it measured 1-2 eps here, native 14-31 eps)."""
    from tests.helpers import assert_matches_original as assert_matches_native

    g = torch.Generator().manual_seed(0)
    grad_output = torch.randn(4, c_out, 96, 96, generator=g) + 1
    x = torch.randn(4, c_in, 96, 96, generator=g) + 1
    weight = torch.randn(c_out, c_in // groups, 3, 3, generator=g)
    aten_args = (grad_output, x, weight, [c_out], [1, 1], [1, 1], [1, 1], False, [0, 0], groups, [True, True, True])
    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        ours = torch.ops.aten.convolution_backward.default(*aten_args)
    assert_compiled_served(layer_class)
    assert_matches_native(ours, aten_args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["weight", "input"])
@pytest.mark.parametrize(
    "layer_class, c_in, c_out, groups, dims",
    [
        ("depthwise", 2, 2, 2, 1), ("depthwise", 2, 4, 2, 2), ("depthwise", 16, 16, 16, 2), ("grouped", 8, 8, 2, 2),
        ("one-channel", 1, 4, 1, 2),
    ],
    ids=["depthwise-1d", "depthwise-x2-2d", "depthwise-lanes-2d", "grouped-2d", "one-channel-2d"],
)
def test_non_finite_values_give_natives_result(layer_class, c_in, c_out, groups, dims, where, dtype):
    """An inf in weight (grad_input) or input (grad_weight) must not turn into NaN where native skips
    the term (padding, stride gaps): the direct kernels multiplied padding zeros by it (a reviewer's
    find: native [2, inf, ...], ours [nan, inf, ...]). inf / NaN positions and values as native's."""
    from tests.helpers import run_original

    size = [17] * dims  # 9 x 9 output planes: over the small-planes threshold
    x = torch.ones(1, c_in, *size, dtype=dtype)
    weight = torch.ones(c_out, c_in // groups, *[3] * dims, dtype=dtype)
    target = weight if where == "weight" else x
    target.view(-1)[-1] = float("inf")
    out_size = [(s + 2 * 1 - 3) // 2 + 1 for s in size]
    grad_output = torch.ones(1, c_out, *out_size, dtype=dtype)
    mask = [where == "weight", where == "input", False]
    aten_args = (grad_output, x, weight, None, [2] * dims, [1] * dims, [1] * dims, False, [0] * dims, groups, mask)
    native = run_original(*aten_args)
    aten_override.reset_stats()
    with aten_override.enable("compiled"):
        ours = torch.ops.aten.convolution_backward.default(*aten_args)
    assert aten_override.stats().get("compiled_layer_classes") == {layer_class: 1}
    i = 0 if where == "weight" else 1
    assert native[i].isinf().any()  # the case is one that matters
    assert ours[i].stride() == native[i].stride()
    torch.testing.assert_close(ours[i], native[i], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["grouped", "one-channel"])
def test_reduced_precision_grad_bias(name, dtype):
    """grad_bias of a contiguous bfloat16 / float16 grad_output is summed plane by plane (ATen's sum
    would upcast all of grad_output first): native's values within the suite's rule, a large offset
    included (float32 chunks added in double), and the same bits at 1 and 2 threads."""
    args = make_args(LAYERS[name], GEOMETRIES[0], 2, dtype=dtype, output_mask=(False, True, True), batch=3, spatial=[40, 40])
    args = dataclasses.replace(args, grad_output=args.grad_output + 3)  # a long sum of one sign
    assert compiled.layer_class(args) == name
    ours = run_compiled(args)
    assert_matches_original(args, ours)
    reference = args.grad_output.double().sum([0, 2, 3])
    assert (ours[2].double() - reference).abs().max() <= 2 ** -7 * reference.abs().max()
    assert torch.equal(run_compiled_on_one_thread(args)[2], ours[2])
