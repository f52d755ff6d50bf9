"""aten_override.testing.fuzz: drawn cases are valid, and a reproduction reruns the case."""

import contextlib
import io

import torch
from hypothesis import given, settings

from aten_override.testing.comparison import call_native
from aten_override.testing.fuzz import ConvolutionBackwardCase, TensorRecipe, convolution_backward_cases, layout_cases
from aten_override.testing.selection import backend_from_spec


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(case=convolution_backward_cases())
def test_drawn_cases_are_valid_calls(case):
    outputs = call_native(case.aten_args())  # raises for an invalid configuration
    for wanted, t, shape in zip(case.output_mask, outputs, (case.input.shape, case.weight.shape, None)):
        if wanted and shape is not None:
            assert tuple(t.shape) == shape


def test_layout_cases_are_valid_and_give_channels_last_gradients():
    # Every fuzz run tries these first: a layout bug must not depend on the seed to be found
    # (CI once passed a backend returning contiguous gradients: no drawn call had a channels_last output).
    cases = layout_cases()
    layouts = set()
    for case in cases[:3]:  # upstream gives channels_last gradients here: wrong_strides fails each
        grad_input = call_native(case.aten_args())[0]
        fmt = torch.channels_last if grad_input.dim() == 4 else torch.channels_last_3d
        assert grad_input.is_contiguous(memory_format=fmt) and not grad_input.is_contiguous()
    for case in cases:
        outputs = call_native(case.aten_args())
        for wanted, t, shape in zip(case.output_mask, outputs, (case.input.shape, case.weight.shape, None)):
            if wanted and shape is not None:
                assert tuple(t.shape) == shape
            if wanted and t.dim() in (4, 5):
                fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
                if t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
                    layouts.add(f"channels_last {t.dim() - 2}-D")
        layouts |= {case.grad_output.layout, case.input.layout, case.weight.layout}
        layouts.add("empty batch" if case.input.shape[0] == 0 else "batch")
        layouts.add("transposed" if case.transposed else "regular")
    assert {"channels_last 2-D", "channels_last 3-D", "expanded_batch", "expanded_spatial", "noncontiguous",
            "empty batch", "transposed", "regular"} <= layouts, layouts
    assert {case.dtype for case in cases} == {torch.float64, torch.float32, torch.bfloat16}
    assert len({case.input.shape[2:] and len(case.input.shape) for case in cases}) == 3  # 1-, 2- and 3-D


def test_reproduction_rebuilds_the_same_tensors_and_reports_the_difference():
    # 2-D: native's grad_weight is channels_last on every CPU (oneDNN and Slow2d both keep the
    # weight's layout). A 3-D bfloat16 case only where native picks oneDNN (a CPU with oneDNN
    # bfloat16); elsewhere Slow3d returns it contiguous, and wrong_strides is right by chance.
    case = ConvolutionBackwardCase(
        grad_output=TensorRecipe((1, 1, 1, 1)), input=TensorRecipe((1, 2, 2, 1)),
        weight=TensorRecipe((1, 2, 2, 1), "channels_last"), bias_sizes=[1], stride=[1, 1],
        padding=[0, 0], dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1,
        output_mask=[False, True, False], dtype=torch.bfloat16, device="cpu", seed=0,
    )
    backend = backend_from_spec("aten_override.testing.example_backends:wrong_strides")
    source = case.reproduction(backend)
    assert "torch.ops.aten.convolution_backward.default(*args)" in source
    assert "from aten_override.testing.example_backends import wrong_strides" in source
    namespace = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(source, namespace)
    for name, t in zip(("grad_output", "input", "weight"), case.aten_args()):
        assert torch.equal(namespace[name], t) and namespace[name].stride() == t.stride()
    assert "grad_weight: expected torch.bfloat16 [1, 2, 2, 1] strides (4, 1, 2, 2); got" in out.getvalue()
    assert "strides (4, 2, 1, 1)" in out.getvalue()


def test_layouts():
    def build(layout, shape=(2, 3, 4, 5)):
        ns = {"torch": torch}
        exec(TensorRecipe(shape, layout).source("t", torch.float32, "cpu").replace("generator=g", "generator=torch.Generator()"), ns)
        return ns["t"]

    assert build("channels_last").is_contiguous(memory_format=torch.channels_last)
    assert build("noncontiguous").stride()[-1] == 2
    assert build("expanded_batch").stride()[0] == 0
    assert build("expanded_spatial").stride()[2:] == (0, 0)


def test_native_defects_are_drawn_in_a_dtype_native_gets_right():
    from aten_override.ops.convolution_backward.args import cpu_has_amx_bf16
    from aten_override.testing.skips import native_defect_reason

    # 3-D transposed, padding > stride in depth, no full input row there: float32 is affected too
    depth = dict(device_type="cpu", transposed=True, input_size=[3, 1, 1], grad_output_size=[2, 1, 1],
                 kernel=[4, 1, 1], stride=[2, 2, 2], padding=[3, 0, 0], dilation=[1, 1, 1])
    assert native_defect_reason(dtype=torch.float32, **depth) is not None
    assert native_defect_reason(dtype=torch.float64, **depth) is None
    # a dead tap: reduced precision only
    dead = dict(device_type="cpu", transposed=False, input_size=[1], grad_output_size=[1], kernel=[3], stride=[2],
                padding=[1], dilation=[1])
    assert native_defect_reason(dtype=torch.bfloat16, **dead) is not None
    assert native_defect_reason(dtype=torch.float32, **dead) is None
    # a padded regular 3-D layer (args.padded_3d): bfloat16 only
    padded = dict(device_type="cpu", transposed=False, input_size=[2, 2, 2], grad_output_size=[2, 2, 2],
                  kernel=[3, 3, 3], stride=[1, 1, 1], padding=[1, 1, 1], dilation=[1, 1, 1])
    assert native_defect_reason(dtype=torch.bfloat16, **padded) is not None
    assert native_defect_reason(dtype=torch.float16, **padded) is None
    unpadded = dict(padded, input_size=[4, 4, 4], padding=[0, 0, 0])
    # ... unless the CPU has AMX-BF16, where every regular bfloat16 3-D grad_weight is suspect (args.amx_3d_weight)
    assert (native_defect_reason(dtype=torch.bfloat16, **unpadded) is None) == (not cpu_has_amx_bf16())
    assert native_defect_reason(dtype=torch.float16, **unpadded) is None
