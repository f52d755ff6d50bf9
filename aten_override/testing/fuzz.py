r"""Differential fuzzing of ``aten::convolution_backward`` with ``hypothesis``.

:func:`convolution_backward_cases` draws random *valid* calls: 1-3 spatial dims, regular or
transposed, stride / padding / dilation / groups, ``output_padding`` up to
``max(stride, dilation) - 1`` (so also ``>= stride`` where the dilation allows it), every
``output_mask``, ``bias_sizes`` given or ``None``, an empty batch now and then, float64 / float32 /
bfloat16 / float16, channels_last or non-contiguous ``input`` / ``weight``, and contiguous,
channels_last, non-contiguous or expanded (stride-0) ``grad_output``. Calls on which the original
kernel crashes or returns uninitialised values (``args.native_defect_reason``) are drawn in
float32 (or float64) instead.

A drawn :class:`ConvolutionBackwardCase` renders itself as a self-contained Python snippet
(:meth:`ConvolutionBackwardCase.reproduction`) that calls
``torch.ops.aten.convolution_backward.default``; the tensors a test uses are built by running that
very snippet's setup (:meth:`ConvolutionBackwardCase.aten_args`), so the reproduction printed for
a failing, shrunk example is exactly what failed.

Every run first tries :func:`layout_cases` (hypothesis explicit examples): one call per memory
format that changes the layout of upstream's outputs (channels_last / channels_last_3d ``input`` or
``weight``, regular and transposed) and per degenerate call (expanded ``grad_output``, empty batch,
zero input channels). Random draws hit a channels_last output in only about 1 call in 7, so a
layout bug must not depend on the seed to be found. Then :func:`value_cases`: values and sizes the small random draws never reach.

Settings profiles (:func:`fuzz_settings`): ``aten_override-ci`` runs :data:`CI_EXAMPLES` examples,
derandomized (a CI run is reproducible); with the environment variable :data:`FUZZ_ENV` set to N
(``python -m aten_override test --fuzz N``) ``aten_override-fuzz`` runs N random examples.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Sequence

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ..backends import Backend, Implementation
from .selection import FUZZ_ENV
from .skips import native_defect_reason

__all__ = [
    "CI_EXAMPLES",
    "FUZZ_ENV",
    "ConvolutionBackwardCase",
    "TensorRecipe",
    "convolution_backward_cases",
    "fuzz_settings",
    "layout_cases",
    "value_cases",
]

CI_EXAMPLES = 100

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.register_profile("aten_override-ci", max_examples=CI_EXAMPLES, derandomize=True, database=None, **_COMMON)
settings.register_profile("aten_override-fuzz", max_examples=int(os.environ.get(FUZZ_ENV) or 1000), **_COMMON)


def fuzz_settings() -> settings:
    """``aten_override-fuzz`` when :data:`FUZZ_ENV` is set, else ``aten_override-ci``."""
    return settings.get_profile("aten_override-fuzz" if os.environ.get(FUZZ_ENV) else "aten_override-ci")


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_LAYOUTS = ("contiguous", "channels_last", "noncontiguous", "expanded_batch", "expanded_spatial")


@dataclasses.dataclass(frozen=True)
class TensorRecipe:
    """How to build one tensor argument from the snippet's generator ``g``.

    ``layout``: ``contiguous``; ``channels_last`` (``channels_last_3d`` for 5-D); ``noncontiguous``
    (every other element of a twice-as-wide last dim); ``expanded_batch`` / ``expanded_spatial``
    (a stride-0 broadcast over the batch / the spatial dims). ``scale``: the standard deviation of
    the values (``randn * scale``).
    """

    shape: tuple[int, ...]
    layout: str = "contiguous"
    scale: float = 1.0

    def source(self, name: str, dtype: torch.dtype, device: str) -> str:
        shape = list(self.shape)
        base = shape
        suffix = ""
        if self.layout == "noncontiguous":
            base = [*shape[:-1], 2 * shape[-1]]
            suffix = "[..., ::2]"
        elif self.layout == "expanded_batch":
            base = [1, *shape[1:]]
            suffix = f".expand({shape})"
        elif self.layout == "expanded_spatial":
            base = [*shape[:2], *[1] * (len(shape) - 2)]
            suffix = f".expand({shape})"
        elif self.layout == "channels_last":
            fmt = "channels_last" if len(shape) == 4 else "channels_last_3d"
            suffix = f".contiguous(memory_format=torch.{fmt})"
        scaled = "" if self.scale == 1 else f".mul({self.scale!r})"
        return (
            f"{name} = torch.randn({base}, generator=g, dtype=torch.float64){scaled}"
            f".to(device={device!r}, dtype={dtype}){suffix}"
        )


@dataclasses.dataclass(frozen=True)
class ConvolutionBackwardCase:
    """One valid call of ``aten::convolution_backward``, with its tensors' recipes."""

    grad_output: TensorRecipe
    input: TensorRecipe
    weight: TensorRecipe
    bias_sizes: list[int] | None
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    transposed: bool
    output_padding: list[int]
    groups: int
    output_mask: list[bool]
    dtype: torch.dtype
    device: str
    seed: int

    def _call_args(self) -> str:
        return (
            f"grad_output, input, weight, {self.bias_sizes}, {self.stride}, {self.padding}, "
            f"{self.dilation}, {self.transposed}, {self.output_padding}, {self.groups}, {self.output_mask}"
        )

    def setup_source(self) -> str:
        """Python source that builds ``grad_output``, ``input`` and ``weight``."""
        return "\n".join(
            [
                f"g = torch.Generator().manual_seed({self.seed})",
                self.grad_output.source("grad_output", self.dtype, self.device),
                self.input.source("input", self.dtype, self.device),
                self.weight.source("weight", self.dtype, self.device),
            ]
        )

    def aten_args(self) -> tuple:
        """The arguments of ``torch.ops.aten.convolution_backward.default``, built by running
        :meth:`setup_source`."""
        namespace: dict = {"torch": torch}
        exec(compile(self.setup_source(), "<aten_override.testing.fuzz reproduction>", "exec"), namespace)
        return (
            namespace["grad_output"], namespace["input"], namespace["weight"], self.bias_sizes,
            self.stride, self.padding, self.dilation, self.transposed, self.output_padding,
            self.groups, self.output_mask,
        )

    def reproduction(self, backend: Implementation) -> str:
        """A copy-pasteable snippet comparing ``backend`` with the original kernel on this call."""
        spec = getattr(backend, "spec", None)  # set by selection.backend_from_spec
        enable_import = ""
        if backend.name in {b.value for b in Backend}:
            enable_arg = repr(backend.name)
        elif spec and ":" in spec:
            module, _, fn = spec.partition(":")
            enable_import, enable_arg = f"from {module} import {fn}\n", fn
        else:
            enable_arg = f"<your backend {backend.name}>"
        device_type = torch.device(self.device).type
        return (
            "import torch\nimport aten_override\n" + enable_import + "\n" + self.setup_source() + "\n"
            + textwrap.dedent(
                f"""
                args = ({self._call_args()})
                expected = aten_override.original_kernel({device_type!r})(*args)
                with aten_override.enable({enable_arg}):
                    actual = torch.ops.aten.convolution_backward.default(*args)
                for name, wanted, a, e in zip(("grad_input", "grad_weight", "grad_bias"), args[-1], actual, expected):
                    if wanted:
                        diff = (a.double() - e.double()).abs().max().item() if e.numel() else 0.0
                        print(f"{{name}}: expected {{e.dtype}} {{list(e.shape)}} strides {{e.stride()}}; "
                              f"got {{a.dtype}} {{list(a.shape)}} strides {{a.stride()}}; max abs diff {{diff:.3g}}")
                """
            )
        )


def layout_cases(device: str = "cpu") -> list[ConvolutionBackwardCase]:
    """Fixed calls every fuzz run tries first, whatever the seed (hypothesis explicit examples).

    Upstream returns channels_last (``_3d``) gradients for each of the first three (the input
    suggests it); the others are the degenerate ``grad_output`` layouts: a stride-0 batch
    over a non-contiguous input, a stride-0 spatial broadcast, an empty batch and zero input
    channels (upstream's Empty backend: zeros, ``grad_bias`` shaped by ``bias_sizes``).
    """
    def case(grad_output, input, weight, *, stride, padding, dilation, transposed=False, output_padding=None,
             groups=1, output_mask=(True, True, True), bias_sizes=None, dtype=torch.float32):
        dims = len(input.shape) - 2
        return ConvolutionBackwardCase(
            grad_output=grad_output, input=input, weight=weight, bias_sizes=bias_sizes, stride=stride,
            padding=padding, dilation=dilation, transposed=transposed,
            output_padding=output_padding or [0] * dims, groups=groups, output_mask=list(output_mask),
            dtype=dtype, device=device, seed=0,
        )

    return [
        # 2-D, channels_last input, grouped, strided: (2, 4, 5, 5) -> (2, 6, 3, 3)
        case(TensorRecipe((2, 6, 3, 3)), TensorRecipe((2, 4, 5, 5), "channels_last"), TensorRecipe((6, 2, 3, 3)),
             stride=[2, 2], padding=[1, 1], dilation=[1, 1], groups=2, bias_sizes=[6]),
        # 3-D, channels_last_3d input (upstream picks oneDNN here: batch > 1), float32: (2, 4, 6, 6, 6) -> (2, 4, 5, 5, 5)
        case(TensorRecipe((2, 4, 5, 5, 5)), TensorRecipe((2, 4, 6, 6, 6), "channels_last"), TensorRecipe((4, 4, 2, 2, 2)),
             stride=[1, 1, 1], padding=[0, 0, 0], dilation=[1, 1, 1], output_mask=(True, True, False)),
        # 2-D transposed, channels_last input, bfloat16, dilated: (2, 3, 3, 4) -> (2, 2, 5, 6)
        case(TensorRecipe((2, 2, 5, 6)), TensorRecipe((2, 3, 3, 4), "channels_last"), TensorRecipe((3, 2, 2, 2)),
             stride=[1, 1], padding=[0, 0], dilation=[2, 2], transposed=True, output_mask=(True, True, True),
             bias_sizes=[2], dtype=torch.bfloat16),
        # 1-D, stride-0 batch grad_output, non-contiguous input, dilated depthwise: (3, 3, 7) -> (3, 3, 3)
        case(TensorRecipe((3, 3, 3), "expanded_batch"), TensorRecipe((3, 3, 7), "noncontiguous"), TensorRecipe((3, 1, 3)),
             stride=[1], padding=[0], dilation=[2], groups=3, bias_sizes=[3], dtype=torch.float64),
        # 2-D, stride-0 spatial grad_output, 1x1 strided: (2, 3, 4, 4) -> (2, 2, 2, 2)
        case(TensorRecipe((2, 2, 2, 2), "expanded_spatial"), TensorRecipe((2, 3, 4, 4)), TensorRecipe((2, 3, 1, 1), "noncontiguous"),
             stride=[2, 2], padding=[0, 0], dilation=[1, 1], output_mask=(False, True, True)),
        # 2-D, empty batch: zeros of the right shapes
        case(TensorRecipe((0, 4, 3, 3)), TensorRecipe((0, 2, 3, 3)), TensorRecipe((4, 2, 3, 3)),
             stride=[1, 1], padding=[1, 1], dilation=[1, 1], bias_sizes=[4]),
        # 2-D, zero input channels: upstream's forward of input (2, 0, 5, 5) by weight (3, 0, 3, 3)
        # gives a 0-channel output; its backward gives zeros, grad_bias (3,) from bias_sizes
        case(TensorRecipe((2, 0, 3, 3)), TensorRecipe((2, 0, 5, 5)), TensorRecipe((3, 0, 3, 3)),
             stride=[1, 1], padding=[0, 0], dilation=[1, 1], bias_sizes=[3]),
    ]


def value_cases(device: str = "cpu") -> list[ConvolutionBackwardCase]:
    """Fixed calls every fuzz run tries after :func:`layout_cases`, for bugs the small random draws
    cannot show: a long reduction in bfloat16 with values beyond float16's range. ``grad_output``
    ``(2, 4, 32, 32)`` is one value per sample and channel (standard deviation 1e4) broadcast over
    space, as the gradient of a mean pool is: a running sum in bfloat16 stalls once it is 256 times
    the summand (``grad_bias`` off by most of its value), and bfloat16 computed in float16 overflows
    past 65504."""
    return [
        ConvolutionBackwardCase(
            grad_output=TensorRecipe((2, 4, 32, 32), "expanded_spatial", scale=1e4), input=TensorRecipe((2, 3, 34, 34)),
            weight=TensorRecipe((4, 3, 3, 3)), bias_sizes=[4], stride=[1, 1], padding=[0, 0], dilation=[1, 1],
            transposed=False, output_padding=[0, 0], groups=1, output_mask=[True, True, True],
            dtype=torch.bfloat16, device=device, seed=0,
        ),
    ]


def _draw_layout(draw, dims: int, allowed: Sequence[str]) -> str:
    layouts = [l for l in allowed if l != "channels_last" or dims in (2, 3)]
    return draw(st.sampled_from(layouts))


@st.composite
def convolution_backward_cases(draw, device: str = "cpu", dtypes: Sequence[torch.dtype] = _DTYPES):
    """A :class:`ConvolutionBackwardCase` strategy: random valid calls on ``device``."""
    dims = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    # 17 groups now and then: wide enough for the compiled backend's channels-in-lanes depthwise kernel
    # (at least 8 channels), and not a multiple of its 16 lanes.
    groups = draw(st.one_of(st.integers(1, 3), st.just(17)))
    c_in_per_group = draw(st.integers(1, 3))
    c_out_per_group = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([1, 2, 3, 0]))  # 0 (upstream's Empty backend) rarely and last
    max_size = {1: 7, 2: 5, 3: 4}[dims]
    kernel, stride, padding, dilation, output_padding, spatial_in = [], [], [], [], [], []
    for _ in range(dims):
        k = draw(st.integers(1, 3))
        s = draw(st.integers(1, 3))
        d = draw(st.integers(1, 3))
        p = draw(st.integers(0, 2))
        extent = d * (k - 1) + 1  # the dilated kernel
        if transposed:
            op = draw(st.integers(0, max(s, d) - 1))
            # output size (i-1)s - 2p + extent + op must be >= 1
            lo = max(1, 1 + -(-(2 * p - extent - op + 1) // s))
            size = draw(st.integers(lo, max(lo, max_size)))
        else:
            op = 0
            lo = max(1, extent - 2 * p)
            size = draw(st.integers(lo, max(lo, max_size)))
        kernel.append(k), stride.append(s), padding.append(p), dilation.append(d)
        output_padding.append(op), spatial_in.append(size)
    c_in, c_out = groups * c_in_per_group, groups * c_out_per_group
    if transposed:
        weight_shape = (c_in, c_out_per_group, *kernel)
        spatial_out = [
            (i - 1) * s - 2 * p + d * (k - 1) + op + 1
            for i, k, s, p, d, op in zip(spatial_in, kernel, stride, padding, dilation, output_padding)
        ]
    else:
        weight_shape = (c_out, c_in_per_group, *kernel)
        spatial_out = [
            (i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in zip(spatial_in, kernel, stride, padding, dilation)
        ]
    output_mask = [draw(st.booleans()) for _ in range(3)]
    # Upstream's Empty backend aborts the process on bias_sizes=None with output_mask[2].
    may_omit_bias = not (batch == 0 and output_mask[2])
    bias_sizes = None if may_omit_bias and draw(st.booleans()) else [c_out]
    dtype = draw(st.sampled_from(list(dtypes)))
    # Rare: where the reference would crash or be garbage, draw the call in float32, else float64.
    for fallback_dtype in (dtype, torch.float32, torch.float64):
        dtype = fallback_dtype
        if native_defect_reason(
            device_type=torch.device(device).type, dtype=dtype, transposed=transposed, input_size=spatial_in,
            grad_output_size=spatial_out, kernel=kernel, stride=stride, padding=padding, dilation=dilation,
            groups=groups, c_in=c_in, c_out=c_out,
        ) is None:
            break
    return ConvolutionBackwardCase(
        grad_output=TensorRecipe((batch, c_out, *spatial_out), _draw_layout(draw, dims, _LAYOUTS)),
        input=TensorRecipe((batch, c_in, *spatial_in), _draw_layout(draw, dims, _LAYOUTS[:3])),
        weight=TensorRecipe(weight_shape, _draw_layout(draw, dims, _LAYOUTS[:3])),
        bias_sizes=bias_sizes,
        stride=stride,
        padding=padding,
        dilation=dilation,
        transposed=transposed,
        output_padding=output_padding,
        groups=groups,
        output_mask=output_mask,
        dtype=dtype,
        device=device,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
