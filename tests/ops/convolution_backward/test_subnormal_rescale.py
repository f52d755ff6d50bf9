r"""The compiled backend on gradients at the bottom of the dtype's range (``_C.subnormal_cost()``).

Where a float32 / float64 call's ``grad_output`` lies below 2^-32 (2^-256), the thread does not flush
subnormals and the machine pays for them, serving computes the call on operands x 2^k (``grad_output``,
or ``input`` and ``weight``) and the results x 2^-k. Asserted here, with the rescale forced on so that
every machine runs it: where nothing underflows, the results are the same bits as without the
rescale; where products underflow, every result is within the dtype's rtol of float64's (native's are
not: every product below ``finfo.tiny`` rounds) with native's dtypes, shapes and strides; the caller's
tensors are not changed; a value the per-call sample missed (inf, NaN, a large one) serves the call as it
is; FTZ / DAZ, ``bfloat16``, normal gradients and ``set_subnormal_rescale(False)`` never rescale.
"""

from __future__ import annotations

import pytest
import torch

import aten_override
from aten_override.ops.convolution_backward import compiled
from aten_override.testing.comparison import call_native, float64_reference

pytestmark = pytest.mark.skipif(compiled.unavailable_reason() is not None, reason=str(compiled.unavailable_reason()))

_OP = torch.ops.aten.convolution_backward.default
ALL = [True, True, True]


@pytest.fixture
def ext():
    ext = compiled.extension()
    aten_override.reset_stats()
    yield ext
    ext.set_subnormal_rescale(None)


@pytest.fixture
def rescale(ext):
    """The rescale forced on (a machine without a subnormal penalty would not rescale)."""
    ext.set_subnormal_rescale(True)
    return ext


# (name, grad_output, input, weight sizes -> the call's other arguments): one layer of each kind
# the compiled backend serves differently
def _layers():
    def conv(n, c_in, c_out, size, k, *, stride=1, padding=0, dilation=1, groups=1, dims=2, transposed=False,
             output_padding=0):
        spatial = (size,) * dims
        x = torch.randn(n, c_in, *spatial)
        if transposed:
            w = torch.randn(c_in, c_out // groups, *(k,) * dims) * 0.3
            out = torch.nn.functional.conv_transpose2d if dims == 2 else None
            go_shape = out(x, w, stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                           dilation=dilation).shape
        else:
            w = torch.randn(c_out, c_in // groups, *(k,) * dims) * 0.3
            f = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[dims]
            go_shape = f(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups).shape
        rest = ([go_shape[1]], [stride] * dims, [padding] * dims, [dilation] * dims, transposed,
                [output_padding] * dims, groups)
        return torch.randn(go_shape), x, w, rest

    return {
        "pointwise 144->24": conv(4, 144, 24, 14, 1),
        "pointwise 24->144": conv(4, 24, 144, 14, 1),
        "dense 3x3": conv(2, 16, 32, 12, 3, padding=1),
        "strided 3x3": conv(2, 16, 16, 13, 3, stride=2, padding=1),
        "depthwise 5x5": conv(2, 32, 32, 14, 5, padding=2, groups=32),
        "grouped": conv(2, 16, 16, 10, 3, padding=1, groups=4),
        "1-d dilated": conv(2, 8, 12, 40, 3, padding=2, dilation=2, dims=1),
        "3-d": conv(2, 4, 8, 6, 3, padding=1, dims=3),
        "transposed": conv(2, 8, 6, 7, 3, stride=2, padding=1, transposed=True, output_padding=1),
    }


LAYERS = list(_layers())


def _call(name: str, scale: float, *, channels_last: bool = False, mask=ALL, dtype=torch.float32):
    torch.manual_seed(sum(map(ord, name)))
    go, x, w, rest = _layers()[name]
    go, x, w = go.to(dtype) * scale, x.to(dtype), w.to(dtype)
    if channels_last and x.dim() == 4:
        go, x = go.contiguous(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    return (go, x, w, *rest, list(mask))


def _served(ext, args):
    before = aten_override.stats().get("compiled_rescaled", 0)
    with aten_override.enable("compiled"):
        out = _OP(*args)
        last = ext.last_call()
    return out, last, aten_override.stats().get("compiled_rescaled", 0) - before


@pytest.mark.parametrize("mask", [ALL, [True, False, False], [False, True, True], [True, True, False]],
                         ids=["all", "grad_input", "grad_weight+bias", "no-bias"])
@pytest.mark.parametrize("layer", LAYERS)
def test_rescaling_changes_no_bit_where_nothing_underflows(rescale, layer, mask):
    """grad_output x 2^-60, unit inputs and weights: every product is ~2^-60, nothing underflows, so the
    call computed on operands x 2^k and scaled back is the same bits as computed as it is (the same
    kernel: the table decides in tests)."""
    args = _call(layer, 2.0**-60, mask=mask)
    ours, last, rescaled = _served(rescale, args)
    assert rescaled == 1 and last["rescale_exponent"] > 0, last
    rescale.set_subnormal_rescale(False)
    plain, last_plain, rescaled_plain = _served(rescale, args)
    assert rescaled_plain == 0 and last_plain["rescale_exponent"] == 0 and last_plain["kernel"] == last["kernel"]
    for i, (o, p) in enumerate(zip(ours, plain)):
        assert (o is None) == (p is None) == (not mask[i]), i
        if o is not None:
            assert o.dtype == p.dtype and o.shape == p.shape and o.stride() == p.stride(), i
            assert torch.equal(o, p), (layer, i, (o - p).abs().max())


@pytest.mark.parametrize("sliced", ["input", "weight", "both"])
@pytest.mark.parametrize("layer", [name for name in LAYERS if name in ("pointwise 144->24", "pointwise 24->144",
                                                                        "dense 3x3", "depthwise 5x5", "grouped",
                                                                        "transposed")])
def test_non_dense_operands_keep_their_layout(rescale, layer, sliced):
    """A channel slice of a channels-last tensor (ShuffleNet's chunk) is not dense: a copy of it would
    change the call's layout (native's output strides follow suggest_memory_format) and its kernel, so
    grad_output is the one copied. Where nothing underflows: the same bits and strides as without the
    rescale, native's strides."""
    go, x, w, *rest = _call(layer, 2.0**-60)
    def sliced_copy(t):
        wide = torch.cat([t, torch.zeros_like(t)], dim=1).contiguous(memory_format=torch.channels_last)
        return wide[:, : t.shape[1]]
    if sliced in ("input", "both"):
        x = sliced_copy(x)
    if sliced in ("weight", "both"):
        w = sliced_copy(w)
    assert not (x if sliced != "weight" else w).is_contiguous(memory_format=torch.channels_last)
    args = (go.contiguous(memory_format=torch.channels_last), x, w, *rest)
    ours, last, rescaled = _served(rescale, args)
    assert rescaled == 1, last
    rescale.set_subnormal_rescale(False)
    plain, _, _ = _served(rescale, args)
    for o, p, n in zip(ours, plain, call_native(args)):
        assert o.stride() == p.stride() == n.stride()
        assert torch.equal(o, p)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("layer", LAYERS)
def test_underflowing_gradients_are_right_to_the_dtype_rtol(rescale, layer, channels_last):
    """grad_output x 2^-120 against unit inputs and weights: its products are subnormal. Every result
    is within float32's rtol (1e-4) of its largest magnitude against float64 (the reference on the same
    values; natively every product below finfo.tiny rounds, up to ~2^-149 each), with native's dtype,
    shape and strides; the caller's tensors are unchanged."""
    args = _call(layer, 2.0**-120, channels_last=channels_last)
    before = [t.clone() for t in args[:3]]
    ours, last, rescaled = _served(rescale, args)
    assert rescaled == 1 and last["rescale_exponent"] >= 110, last
    for t, b in zip(args[:3], before):
        assert torch.equal(t, b) and t.stride() == b.stride()
    native, exact = call_native(args), float64_reference(args)
    for i, (o, n, r) in enumerate(zip(ours, native, exact)):
        assert o.dtype == n.dtype and o.shape == n.shape and o.stride() == n.stride(), (layer, i)
        scale = r.abs().max().item()
        assert scale > 0
        err = (o.double() - r).abs().max().item() / scale
        assert err <= 1e-4, (layer, i, err, (n.double() - r).abs().max().item() / scale)


def test_rescaling_is_more_accurate_than_native_where_native_rounds_every_product(rescale):
    """A 1x1 layer whose grad_output values, and so its products with unit inputs, are ~2^-140 (subnormal:
    2^-149 ulps, ~9 bits): native rounds every product to those bits, ours only its results."""
    args = _call("pointwise 24->144", 2.0**-140)
    ours, _, rescaled = _served(rescale, args)
    assert rescaled == 1
    native, exact = call_native(args), float64_reference(args)
    scale = exact[1].abs().max().item()
    ours_err = (ours[1].double() - exact[1]).abs().max().item() / scale
    native_err = (native[1].double() - exact[1]).abs().max().item() / scale
    assert ours_err <= 1e-5 < native_err, (ours_err, native_err)


def test_float64_calls_rescale_below_their_own_range(rescale):
    """float64 rescales below 2^-256 (its range ends at 2^-1022), not at float32's 2^-32."""
    args = _call("dense 3x3", 2.0**-100, dtype=torch.float64)
    _, last, rescaled = _served(rescale, args)
    assert rescaled == 0 and last["rescale_exponent"] == 0
    args = _call("dense 3x3", 2.0**-1000, dtype=torch.float64)
    ours, last, rescaled = _served(rescale, args)
    assert rescaled == 1 and last["rescale_exponent"] >= 990, last
    for o, r in zip(ours, float64_reference(args)):
        assert (o - r).abs().max().item() <= 1e-12 * r.abs().max().item()


@pytest.mark.parametrize("layer", ["pointwise 144->24", "pointwise 24->144"],
                         ids=["grad_output copied", "input and weight copied"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1.0], ids=["inf", "nan", "large"])
def test_a_value_the_sample_missed_is_served_right(rescale, value, layer):
    """The per-call check samples 1,024 values: one it missed (an inf, a NaN, a large value beside tiny
    ones) makes a copy or a result non-finite, and the call is served as it is (native's non-finite
    pattern); a large value is rescaled with the rest, exactly (native's values)."""
    args = _call(layer, 2.0**-100)
    go = args[0].clone()
    assert go.numel() // 1024 > 1  # the sample reads every (numel // 1024)-th value from the first
    go.view(-1)[1] = value
    args = (go, *args[1:])
    ours, last, rescaled = _served(rescale, args)
    assert rescaled == (value == 1.0) and (last["rescale_exponent"] > 0) == (value == 1.0), last
    for o, n in zip(ours, call_native(args)):
        assert o.stride() == n.stride()
        assert torch.equal(o.isnan(), n.isnan()) and torch.equal(o.isinf(), n.isinf())
        finite = n.isfinite()
        assert (o[finite] - n[finite]).abs().max() <= 1e-4 * n[finite].abs().max()


def test_input_too_large_to_rescale_copies_grad_output_instead(rescale):
    """grad_output all subnormal (2^-130, k = 128) on a layer whose input is the smaller copy: input x 2^128
    overflows float32, so grad_output is copied; the results are right to float32's rtol."""
    args = _call("pointwise 24->144", 2.0**-130)
    ours, last, rescaled = _served(rescale, args)
    assert rescaled == 1 and last["rescale_exponent"] >= 126, last
    exact = float64_reference(args)
    for o, r in zip(ours, exact):
        assert (o.double() - r).abs().max().item() <= 1e-4 * r.abs().max().item()


def test_ftz_daz_never_rescales(rescale):
    """A thread that flushes subnormals (torch.set_flush_denormal(True)) has nothing to gain."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no FTZ/DAZ")
    try:
        _, last, rescaled = _served(rescale, _call("dense 3x3", 2.0**-100))
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert rescaled == 0 and last["rescale_exponent"] == 0


@pytest.mark.parametrize("case", ["bfloat16", "normal gradients", "forced off", "bias only"])
def test_calls_that_never_rescale(ext, case):
    """bfloat16 (its kernels flush: AMX, vdpbf16ps), grad_output at 2^-20 (above 2^-32), the rescale forced
    off, and a call asking only for grad_bias (no products) are served as they are."""
    ext.set_subnormal_rescale(case != "forced off")
    scale = 2.0**-20 if case == "normal gradients" else 2.0**-100
    mask = [False, False, True] if case == "bias only" else ALL
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    _, last, rescaled = _served(ext, _call("dense 3x3", scale, mask=mask, dtype=dtype))
    assert rescaled == 0 and last["rescale_exponent"] == 0, last


def test_subnormal_cost_is_measured_once_and_forcing_shows(ext):
    cost = ext.subnormal_cost()
    assert set(cost) == {"normal_us", "subnormal_us", "rescale", "forced"}, cost
    assert cost["normal_us"] > 0 and cost["subnormal_us"] > 0 and not cost["forced"]
    assert cost["rescale"] == (cost["subnormal_us"] > 2 * cost["normal_us"])
    assert ext.subnormal_cost()["normal_us"] == cost["normal_us"]  # measured once per process
    ext.set_subnormal_rescale(not cost["rescale"])
    assert ext.subnormal_cost() == {**cost, "rescale": not cost["rescale"], "forced": True}


def test_the_tracer_names_the_rescale(rescale):
    args = _call("dense 3x3", 2.0**-100)
    with aten_override.trace() as t, aten_override.enable("compiled"):
        _OP(*args)
    (call,) = t.calls
    assert call.rescale_exponent == rescale.last_call()["rescale_exponent"] > 0
    assert f"rescaled=2^{call.rescale_exponent}" in "\n".join(aten_override.tracing.format_call(call))
