"""aten_override.testing.comparison: the checks fail on wrong values, strides, dtypes and masks."""

import pytest
import torch

from aten_override.testing.comparison import call_native, check_against_native, float64_reference


def _args(dtype=torch.float32, memory_format=torch.contiguous_format):
    g = torch.Generator().manual_seed(0)
    go = torch.randn(2, 4, 4, 4, generator=g).to(dtype)
    x = torch.randn(2, 3, 6, 6, generator=g).to(dtype).contiguous(memory_format=memory_format)
    w = torch.randn(4, 3, 3, 3, generator=g).to(dtype)
    return (go, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])


def test_native_matches_itself_in_every_dtype():
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        args = _args(dtype)
        ref = None if dtype == torch.float64 else float64_reference(args)
        check_against_native(call_native(args), call_native(args), ref)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda gi, gw, gb: (gi, gw * 1.001, gb), "grad_weight: Tensor-likes are not close"),
        (lambda gi, gw, gb: (gi.contiguous(), gw, gb), "grad_input: strides"),
        (lambda gi, gw, gb: (gi, gw.double(), gb), "grad_weight: dtype torch.float64"),
        (lambda gi, gw, gb: (gi, gw, None), "grad_bias: output_mask asks for it, got None"),
        (lambda gi, gw, gb: (gi, gw, gb[:-1]), r"grad_bias: shape \[3\]"),
    ],
    ids=["values", "strides", "dtype", "missing", "shape"],
)
def test_detects(corrupt, message):
    args = _args(memory_format=torch.channels_last)
    native = call_native(args)
    with pytest.raises(AssertionError, match=message):
        check_against_native(corrupt(*native), native, float64_reference(args))


def test_masked_outputs_are_not_compared():
    args = _args()
    native = call_native(args)
    check_against_native((None, native[1], None), native, output_mask=(False, True, False))


def test_a_reordered_sum_passes_and_a_dropped_summand_does_not():
    # issue #10: a correct kernel summing in another order than oneDNN's differs from native by a few
    # ulps; the bound is relative to native's own error vs float64, not assert_close's defaults.
    from aten_override.testing.comparison import assert_close_to_reference

    g = torch.Generator().manual_seed(0)
    terms = torch.randn(540, 64, generator=g, dtype=torch.float64)
    reference = terms.sum(1)
    native = terms.float().sum(1)
    reordered = terms.float().flip(1).cumsum(1)[:, -1]  # sequential, in the other order
    assert (reordered != native).any()
    assert_close_to_reference(reordered, native, reference)
    with pytest.raises(AssertionError, match="bound: 2 x original kernel's error"):
        assert_close_to_reference(reordered - terms[:, 0].float() * 1e-3, native, reference)
