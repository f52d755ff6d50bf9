r"""OpInfo entries for ``aten.convolution_backward.default``: :data:`op_db`.

Upstream has no OpInfo for ``convolution_backward`` (one is proposed in pytorch#165008). These six
entries, one per forward op, derive their samples from PyTorch's own forward OpInfos
(``nn.functional.conv1d/2d/3d`` and ``nn.functional.conv_transpose1d/2d/3d`` of
``torch.testing._internal.common_methods_invocations.op_db``):

1. each upstream forward sample is run and its ``aten.convolution.default`` call is captured with a
   ``TorchDispatchMode`` (so ``padding="same"``, unbatched inputs and length-1 parameter lists arrive
   exactly as autograd would pass them to the backward);
2. ``grad_output`` is a fresh tensor shaped like that call's output;
3. for every distinct call, one :class:`SampleInput` with ``output_mask=[True, True, True]`` and
   one with another of the 7 other masks in turn, so each variant covers all 8.

A sample's ``input`` is ``grad_output``; its ``args`` are the rest of the aten arguments in
schema order, so ``op(sample.input, *sample.args)`` is the aten call.

Error inputs (:class:`ConvolutionBackwardErrorInput`) are invalid configurations with the error
our backends raise (``error_regex``, matched after ``convolution_backward[<backend>]: ``) and what
the original kernel does (``native_error_regex``; ``None`` when it does not raise).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._upstream import DecorateInfo, ErrorInput, OpInfo, SampleInput, floating_types_and, make_tensor
from ._upstream import op_db as upstream_op_db

__all__ = [
    "ConvolutionBackwardErrorInput",
    "OUTPUT_MASKS",
    "VARIANTS",
    "conv_op_db",
    "error_inputs_convolution_backward",
    "op_db",
    "sample_inputs_convolution_backward",
]

# variant_test_name -> (upstream forward OpInfo, spatial dims, transposed)
VARIANTS: dict[str, tuple[str, int, bool]] = {
    "conv1d": ("nn.functional.conv1d", 1, False),
    "conv2d": ("nn.functional.conv2d", 2, False),
    "conv3d": ("nn.functional.conv3d", 3, False),
    "conv_transpose1d": ("nn.functional.conv_transpose1d", 1, True),
    "conv_transpose2d": ("nn.functional.conv_transpose2d", 2, True),
    "conv_transpose3d": ("nn.functional.conv_transpose3d", 3, True),
}

OUTPUT_MASKS: tuple[tuple[bool, bool, bool], ...] = tuple(itertools.product((True, False), repeat=3))
"""All 8 ``output_mask`` values, all-True first."""

conv_op_db = [op for op in upstream_op_db if op.name in {v[0] for v in VARIANTS.values()}]
"""Upstream's six conv / conv-transpose forward OpInfos (their gradients run our backward)."""


def _upstream_op(name: str):
    for op in conv_op_db:
        if op.name == name:
            return op
    raise LookupError(f"aten_override.testing: torch's op_db has no OpInfo {name!r}")


class _CaptureConvolution(TorchDispatchMode):
    """Records every ``aten.convolution.default`` call as ``(args, output)``."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[tuple, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.convolution.default:
            self.calls.append((args, out))
        return out


def _mask_name(mask) -> str:
    return "".join("T" if m else "F" for m in mask)


def _describe(x, w, stride, padding, dilation, transposed, output_padding, groups) -> str:
    parts = [f"input={list(x.shape)}", f"weight={list(w.shape)}"]
    for name, value, default in (
        ("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1),
        ("output_padding", output_padding, 0),
    ):
        if any(v != default for v in value):
            parts.append(f"{name}={list(value)}")
    if groups != 1:
        parts.append(f"groups={groups}")
    return ",".join(parts)


def sample_inputs_convolution_backward(op_info, device, dtype, requires_grad=False, **kwargs) -> Iterator[SampleInput]:
    """Samples for ``op_info`` (one of :data:`op_db`): upstream's forward samples, all output_masks.

    ``requires_grad`` is accepted for the OpInfo protocol and ignored (the op has no autograd here).
    """
    forward = _upstream_op(VARIANTS[op_info.variant_test_name][0])
    seen = set()
    uncovered = list(OUTPUT_MASKS[1:])
    last = None
    for sample in forward.sample_inputs(device, dtype, requires_grad=False):
        with torch.no_grad(), _CaptureConvolution() as capture:
            forward(sample.input, *sample.args, **sample.kwargs)
        for args, out in capture.calls:
            x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
            desc = _describe(x, w, stride, padding, dilation, transposed, output_padding, groups)
            if desc in seen:  # upstream's batched and unbatched samples often coincide
                continue
            seen.add(desc)
            grad_output = make_tensor(out.shape, device=device, dtype=dtype)
            other = uncovered.pop(0) if uncovered else OUTPUT_MASKS[1 + len(seen) % (len(OUTPUT_MASKS) - 1)]
            last = (desc, grad_output, args, out)
            for mask in (OUTPUT_MASKS[0], other):
                yield _sample(desc, grad_output, args, out, mask)
            if x.dim() in (4, 5):  # upstream's output strides follow input's memory format
                fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                yield _sample(f"{desc},channels_last", grad_output, (x.contiguous(memory_format=fmt), *args[1:]), out, OUTPUT_MASKS[0])
    for mask in uncovered:  # fewer distinct calls than masks: the last call takes the rest
        yield _sample(*last, mask)


def _sample(desc, grad_output, conv_args, out, mask) -> SampleInput:
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = conv_args
    # bias_sizes as autograd passes it; None only when no bias grad is asked for, since upstream's
    # Empty backend aborts on None with output_mask[2] (upstream-notes §0.5).
    bias_sizes = list(bias.shape) if bias is not None else ([out.size(1)] if mask[2] else None)
    return SampleInput(
        grad_output.clone(),
        args=(
            x.detach().clone(), w.detach().clone(), bias_sizes, list(stride), list(padding),
            list(dilation), bool(transposed), list(output_padding), int(groups), list(mask),
        ),
        name=f"{desc},bias_sizes={bias_sizes},output_mask={_mask_name(mask)}",
    )


class ConvolutionBackwardErrorInput(ErrorInput):
    """An :class:`ErrorInput` plus what the original ATen kernel does with it.

    ``error_regex`` matches the end of our backends' message, which starts with
    ``convolution_backward[<backend>]: ``;
    ``native_error_regex`` matches the original kernel's message (``""``: it raises
    ``error_type`` with a message that depends on the library serving it, oneDNN or cuDNN;
    ``None``: upstream does not validate it, ``native_gap`` says what; it may compute something or
    fail deep inside a library, depending on dims and device).
    """

    __slots__ = ["name", "native_error_regex", "native_gap"]

    def __init__(self, sample_input, *, error_regex, native_error_regex, name, native_gap=None,
                 error_type=RuntimeError):
        super().__init__(sample_input, error_type=error_type, error_regex=error_regex)
        self.name = name
        self.native_error_regex = native_error_regex
        self.native_gap = native_gap


@dataclasses.dataclass(frozen=True)
class _Config:
    """A valid call; error inputs each change one thing."""

    grad_output: tuple
    input: tuple
    weight: tuple
    bias_sizes: list | None
    stride: list
    padding: list
    dilation: list
    transposed: bool
    output_padding: list
    groups: int
    dtypes: tuple = (None, None, None)  # per tensor; None: the sample dtype
    devices: tuple = (None, None, None)


def _base_config(dim: int, transposed: bool) -> _Config:
    sp = lambda n: (n,) * dim  # noqa: E731
    if transposed:  # input (2, 4, 4..), weight (C_in=4, C_out/groups=4, 3..) -> output 6..
        return _Config((2, 4, *sp(6)), (2, 4, *sp(4)), (4, 4, *sp(3)), [4], [1] * dim, [0] * dim,
                       [1] * dim, True, [0] * dim, 1)
    return _Config((2, 4, *sp(4)), (2, 4, *sp(6)), (4, 4, *sp(3)), [4], [1] * dim, [0] * dim,
                   [1] * dim, False, [0] * dim, 1)


def _error_cases(dim: int, transposed: bool, device: str):
    """``(name, changes, error_regex, native_error_regex, native_gap)`` for one variant."""
    sp = lambda n: (n,) * dim  # noqa: E731
    ones = [1] * dim
    spatial = lambda s: ", ".join([str(s)] * dim)  # noqa: E731
    common = [
        ("groups=0", dict(groups=0), r"expected groups to be greater than 0, but got groups=0",
         r"expected groups to be greater than 0, but got groups=0", None),
        ("groups=-1", dict(groups=-1), r"expected groups to be greater than 0, but got groups=-1",
         r"expected groups to be greater than 0, but got groups=-1", None),
        ("stride=0", dict(stride=[0] + ones[1:]), r"non-positive stride is not supported",
         r"non-positive stride is not supported", None),
        ("stride=-1", dict(stride=[-1] + ones[1:]), r"non-positive stride is not supported",
         r"non-positive stride is not supported", None),
        ("padding=-1", dict(padding=[-1] + [0] * (dim - 1)), r"negative padding is not supported",
         r"negative padding is not supported", None),
        ("dilation=0", dict(dilation=[0] + ones[1:]), r"dilation should be greater than zero", None,
         "dilation > 0 is checked by the forward only (2-D: computes a result; 3-D: 'dimensions are invalid')"),
        ("stride_has_dim+1_values", dict(stride=[1] * (dim + 1)),
         rf"expected stride to be a single integer value or a list of {dim} values",
         rf"expected stride to be a single integer value or a list of {dim} values", None),
        ("weight_2d", dict(weight=(4, 4)), r"weight should have at least three dimensions",
         r"weight should have at least three dimensions", None),
        ("grad_output_dim_mismatch", dict(grad_output=(2, 4)), r"expected input and grad_output to be",
         r"Expected input and grad_output to have the same number of dimensions", None),
        ("grad_output_batch_mismatch", "grad_output_batch", r"grad_output batch size \(1\) does not match input batch size \(2\)",
         "", None),
        ("grad_output_channels_mismatch", "grad_output_channels", r"grad_output has 3 channels, expected C_out = 4",
         "", None),
        ("grad_output_spatial_mismatch", "grad_output_spatial",
         r"grad_output spatial size \[.*\] does not match the convolution's output size", "", None),
        ("mixed_dtypes", dict(dtypes=(None, None, torch.float64)),
         r"grad_output, input and weight must have the same dtype, got torch.float32, torch.float32 and torch.float64",
         "", None),
    ]
    if device != "cpu":
        common.append(
            ("mixed_devices", dict(devices=("cpu", None, None)),
             r"grad_output, input and weight must be on the same device", "", None)
        )
    if not transposed:
        return common + [
            ("output_padding_not_transposed", dict(output_padding=[1] * dim),
             r"output_padding is not supported for non-transposed convolutions",
             r"output_padding is not supported for non-transposed convolutions", None),
            ("groups_not_dividing_C_in", dict(groups=3, weight=(6, 1, *sp(3)), grad_output=(2, 6, *sp(4))),
             r"groups \(3\) must divide C_in \(4\)",
             r"Given groups=3, weight of size .* to have 3 channels, but got 4 channels instead", None),
            ("groups_not_dividing_C_out", dict(groups=2, weight=(3, 2, *sp(3)), grad_output=(2, 3, *sp(4))),
             r"groups \(2\) must divide C_out \(3\)", r"Given groups=2, expected weight to be divisible by 2", None),
            ("C_in_mismatch", dict(input=(2, 5, *sp(6))),
             r"input has C_in \(5\) channels but weight .* expects weight.size\(1\) \* groups = 4",
             r"expected input.* to have 4 channels, but got 5 channels instead", None),
            ("kernel_larger_than_input", dict(input=(2, 4, *sp(2)), grad_output=(2, 4, *sp(1))),
             r"kernel size can't be greater than actual input size",
             r"Kernel size can't be greater than actual input size", None),
        ]
    return common + [
        ("output_padding_not_below_stride_or_dilation", dict(output_padding=[1] * dim, grad_output=(2, 4, *sp(7))),
         r"output padding must be smaller than either stride or dilation",
         r"output padding must be smaller than either stride or dilation", None),
        ("groups_not_dividing_C_in", dict(groups=3, weight=(4, 1, *sp(3)), grad_output=(2, 3, *sp(6))),
         r"groups \(3\) must divide C_in \(4\)", r"", None),
        ("C_in_mismatch", dict(input=(2, 5, *sp(4))),
         r"transposed: input has C_in \(5\) channels but weight .* expects weight.size\(0\) = 4",
         r"Given transposed=1, weight of size .* to have 4 channels, but got 5 channels instead", None),
    ]


def error_inputs_convolution_backward(op_info, device, **kwargs) -> Iterator[ConvolutionBackwardErrorInput]:
    """Invalid calls of ``op_info``'s variant, float32, each with the expected errors."""
    _, dim, transposed = VARIANTS[op_info.variant_test_name]
    base = _base_config(dim, transposed)
    for name, changes, regex, native_regex, gap in _error_cases(dim, transposed, torch.device(device).type):
        if isinstance(changes, str):  # grad_output off by one in batch, channels or spatial size
            go = list(base.grad_output)
            go[{"grad_output_batch": 0, "grad_output_channels": 1, "grad_output_spatial": 2}[changes]] -= 1
            changes = dict(grad_output=tuple(go))
        cfg = dataclasses.replace(base, **changes)
        tensors = [
            make_tensor(shape, device=dev or device, dtype=dt or torch.float32)
            for shape, dt, dev in zip((cfg.grad_output, cfg.input, cfg.weight), cfg.dtypes, cfg.devices)
        ]
        yield ConvolutionBackwardErrorInput(
            SampleInput(
                tensors[0],
                args=(tensors[1], tensors[2], cfg.bias_sizes, cfg.stride, cfg.padding, cfg.dilation,
                      cfg.transposed, cfg.output_padding, cfg.groups, [True, True, True]),
                name=name,
            ),
            error_regex=regex,
            native_error_regex=native_regex,
            native_gap=gap,
            name=name,
        )


def _opinfo(variant: str) -> OpInfo:
    return OpInfo(
        "convolution_backward",
        variant_test_name=variant,
        op=torch.ops.aten.convolution_backward.default,
        aten_name="convolution_backward",
        dtypes=floating_types_and(torch.float16, torch.bfloat16),
        sample_inputs_func=sample_inputs_convolution_backward,
        error_inputs_func=error_inputs_convolution_backward,
        supports_out=False,
        supports_autograd=False,
        supports_forward_ad=False,
        supports_fwgrad_bwgrad=False,
        decorators=(
            # CI covers float16 / bfloat16 by fuzzing (test_fuzz); the full sample set is slow here.
            DecorateInfo(pytest.mark.slow, "TestConvolutionBackward", "test_matches_native",
                         dtypes=(torch.float16, torch.bfloat16)),
        ),
    )


op_db: list[OpInfo] = [_opinfo(variant) for variant in VARIANTS]
"""Six OpInfos ``convolution_backward`` with ``variant_test_name`` conv1d … conv_transpose3d."""
