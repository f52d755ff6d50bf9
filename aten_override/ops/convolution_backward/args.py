r"""The arguments of ``aten::convolution_backward``, their validation, and upstream's output layout.

One small dataclass mirrors the aten schema (``native_functions.yaml``)::

    convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes,
                         SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed,
                         SymInt[] output_padding, SymInt groups, bool[3] output_mask)
        -> (Tensor, Tensor, Tensor)

Shapes, in ``torch/nn/modules/conv.py``'s notation, with ``D = weight.dim() - 2`` spatial dims:

- ``input``:       ``(N, C_in, *spatial_in)``
- ``weight``:      ``(C_out, C_in / groups, *kernel)``; transposed: ``(C_in, C_out / groups, *kernel)``
- ``grad_output``: ``(N, C_out, *spatial_out)``

The support checks, every implementation and the tracer share this module. Nothing here touches
the dispatcher.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import torch
from torch._prims_common import suggest_memory_format  # c10's Tensor::suggest_memory_format

__all__ = [
    "ConvolutionBackwardArgs",
    "FLOATING_DTYPES",
    "check_args",
    "is_empty_call",
    "needs_weight_or_input",
    "native_backend",
    "output_memory_format",
    "empty_like_native",
    "canonical_strides",
    "canonical_size1_strides",
    "canonical_call",
    "significant_strides",
    "expected_output_spatial",
    "dead_taps",
    "has_dead_tap",
    "width_one_transposed",
    "onednn_defect",
    "padded_3d",
    "amx_3d_weight",
    "depthwise_dilated",
    "cpu_has_amx_bf16",
    "depth_without_full_row",
    "onednn_avx2",
    "strided_1x1_avx2",
    "native_defect_reason",
]

FLOATING_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
OP = "convolution_backward"


@dataclasses.dataclass(frozen=True, slots=True)
class ConvolutionBackwardArgs:
    """One call of ``aten::convolution_backward``, field for field in schema order.

    ``stride``, ``padding``, ``dilation`` and ``output_padding`` are kept as passed (a length-1 list
    broadcasts to every spatial dim, as upstream's ``expand_param_if_needed`` does); use
    :meth:`expanded` for the per-dim lists.
    """

    grad_output: torch.Tensor
    input: torch.Tensor
    weight: torch.Tensor
    bias_sizes: Sequence[int] | None
    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    transposed: bool
    output_padding: Sequence[int]
    groups: int
    output_mask: Sequence[bool]

    def as_aten_args(self) -> tuple:
        """The positional arguments of ``torch.ops.aten.convolution_backward.default``."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def spatial_dims(self) -> int:
        """``D``: 1, 2 or 3 for conv1d/2d/3d."""
        return self.weight.dim() - 2

    @property
    def device_type(self) -> str:
        return self.grad_output.device.type

    def expanded(self) -> ConvolutionBackwardArgs:
        """A copy with ``stride``/``padding``/``dilation``/``output_padding`` as lists of ``D``
        ints, ``groups`` an int and ``output_mask`` a tuple. Assumes :func:`check_args` passed."""
        d = self.spatial_dims
        return dataclasses.replace(
            self,
            stride=_expand(self.stride, d),
            padding=_expand(self.padding, d),
            dilation=_expand(self.dilation, d),
            output_padding=_expand(self.output_padding, d),
            groups=int(self.groups),
            output_mask=tuple(bool(m) for m in self.output_mask),
        )

    @property
    def c_out(self) -> int:
        """Output channels of the forward convolution (``grad_output.size(1)`` when consistent)."""
        w = self.weight
        return w.size(1) * int(self.groups) if self.transposed else w.size(0)


def _expand(values: Sequence[int], d: int) -> list[int]:
    values = [int(v) for v in values]
    return values * d if len(values) == 1 else values


def dead_taps(*, transposed: bool, input_size, grad_output_size, kernel, stride, padding, dilation) -> list[list[int]]:
    """Per spatial dim, the kernel taps that never meet a valid position: their gradient is zero.

    Regular: output ``o`` reads input ``o*s - p + j*d`` with tap ``j``; transposed: input ``i``
    writes output ``i*s - p + j*d``. Sizes are spatial (``input.shape[2:]``,
    ``grad_output.shape[2:]``, ``weight.shape[2:]``). E.g. ``padding >= dilation * (kernel - 1)`` on a
    size-1 dim. torch 2.13's oneDNN convolutions are wrong on reduced-precision calls with a dead tap
    (see the ``dead-taps`` class of the compiled backend). Mirrors ``has_dead_tap`` in
    csrc/convolution_backward.cpp.
    """
    dead = []
    for size_in, size_out, k, s, p, d in zip(input_size, grad_output_size, kernel, stride, padding, dilation):
        strided, other = (size_in, size_out) if transposed else (size_out, size_in)
        # tap j is valid at position t where lo <= t*s <= other - 1 + lo, lo = p - j*d: the first
        # such t is max(0, ceil(lo / s)); O(kernel) per dim, not O(kernel * size) (per-call path)
        dead.append([
            j for j in range(k)
            if (t := max(0, -(-(p - j * d) // s))) >= strided or t * s > other - 1 + p - j * d
        ])
    return dead


def has_dead_tap(args: ConvolutionBackwardArgs) -> bool:
    """Whether :func:`dead_taps` finds any for ``args`` (expanded params)."""
    a = args.expanded()
    return any(dead_taps(
        transposed=a.transposed, input_size=a.input.shape[2:], grad_output_size=a.grad_output.shape[2:],
        kernel=a.weight.shape[2:], stride=a.stride, padding=a.padding, dilation=a.dilation,
    ))


def width_one_transposed(*, transposed: bool, input_size, kernel) -> bool:
    """Whether a transposed layer's input has width 1 (its last spatial dim) under a kernel more than
    one tap wide there, and more than one spatial position in all (e.g. ``input (N, C, 8, 1)``,
    ``kernel (3, 3)``, ``stride 2``). Sizes are spatial. On x86 with AMX, torch 2.13's oneDNN
    bfloat16 path leaves most of ``grad_input`` unwritten on such layers, with no dead tap (found by
    scripts/sweep_native_defects.py; a ``(1, 1)`` input, as in DCGAN's first layer, is right).
    Mirrors ``width_one_transposed`` in csrc/convolution_backward.cpp.
    """
    positions = 1
    for size in input_size:
        positions *= size
    return bool(transposed) and len(input_size) > 0 and input_size[-1] == 1 and kernel[-1] > 1 and positions > 1


def depth_without_full_row(*, transposed: bool, input_size, grad_output_size, kernel, stride, padding,
                           dilation) -> bool:
    """Whether a 3-D layer has padding > stride in its depth dim (the first spatial dim) and no row
    there that meets the whole kernel: transposed, no input ``i`` whose taps all land inside the
    output (input ``i`` writes output ``i*s - p + j*d``); regular, no output ``o`` whose taps all read
    inside the input (output ``o`` reads input ``o*s - p + j*d``). Sizes are spatial. Covers every
    call found (scripts/sweep_native_defects.py, and a sweep of regular 3-D layers with long depth
    kernels: 14 of 55 such strided calls defective, none of 200 others) where torch 2.13's oneDNN
    float32 path computes wrong gradients, hangs, or corrupts the heap (SIGSEGV / SIGABRT), e.g.
    transposed ``input (2, 16, 3, 1, 1)``, ``kernel (4, 1, 1)``, stride 2, padding (3, 0, 0), or
    regular ``input (2, 16, 3, 1, 1)``, ``kernel (9, 1, 1)``, stride 4, padding (7, 0, 0); it is wider
    than that set (most such layers are right; long kernels in height or width were right). Mirrors
    ``depth_without_full_row`` in csrc/convolution_backward.cpp.
    """
    if len(input_size) != 3:
        return False
    size_in, size_out, k, s, p, d = (v[0] for v in (input_size, grad_output_size, kernel, stride, padding, dilation))
    if p <= s:
        return False
    strided, other = (size_in, size_out) if transposed else (size_out, size_in)
    return not any(t * s - p >= 0 and t * s - p + (k - 1) * d < other for t in range(strided))


def padded_3d(args: ConvolutionBackwardArgs) -> bool:
    """Whether a regular 3-D layer has padding and, in some dim, an input shorter than the dilated
    kernel. torch 2.13's oneDNN bfloat16 backward leaves parts of ``grad_weight`` / ``grad_input``
    of such layers unwritten (found on an AMD EPYC with AVX512_BF16: 51 of 328 small padded layers,
    e.g. ``input (2, 16, 2, 2, 2)``, kernel 3, padding 1; the values are whatever the allocator
    hands back, so they change with the heap; no unpadded layer). Every defective call of two later
    targeted sweeps (750 small padded 3-D layers, 13 defective, one heap corruption) and a random
    one (783 padded 3-D calls, 2) had such a short dim; none of the 461 targeted calls without one
    was wrong, nor any of R(2+1)D's 18 layer geometries (whose bfloat16 backward the unnarrowed
    predicate sent to float32, at 2x native's step time). Mirrors ``padded_3d`` in csrc/convolution_backward.cpp."""
    if args.transposed or args.weight.dim() != 5:
        return False
    a = args.expanded()
    short = any(n < d * (k - 1) + 1 for n, k, d in zip(a.input.shape[2:], a.weight.shape[2:], a.dilation))
    return short and any(p > 0 for p in a.padding)


@functools.cache
def cpu_capability(name: str) -> bool:
    """Whether this CPU has the capability ``name`` (a key of ``torch._C._cpu._get_cpu_capability()``,
    cpuinfo's reading of CPUID: ``"avx2"``, ``"avx512_f"``, ``"amx_bf16"``, ...). Mirrors
    ``cpu_capability`` in csrc/convolution_backward.cpp."""
    return bool(torch._C._cpu._get_cpu_capability().get(name, False))


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16. Mirrors ``cpu_has_amx_bf16`` in csrc/convolution_backward.cpp."""
    return cpu_capability("amx_bf16")


def amx_3d_weight(args: ConvolutionBackwardArgs) -> bool:
    """Whether a bfloat16 3-D call asks for ``grad_weight`` on a CPU with AMX-BF16.

    There torch 2.13's oneDNN weight gradient (``brgconv_bwd_w:avx10_1_512_amx``) is off by 12-52% of
    its scale on larger planes, regular and transposed, the same on every run: e.g. ``input (2, 64,
    4, 56, 56)``, kernel 1x3x3, padding ``[0, 1, 1]`` (R(2+1)D's spatial layers), or a 1x1x1 kernel
    at depth 1. 2-D layers, float16 and ``grad_input`` were right (random sweeps of 3-D layers,
    regular and transposed, Sapphire Rapids). No size bound separates the wrong calls from the right ones
    (input channels x plane 1e5-9e5 elements among the wrong, up to 3e6 among the right), so every
    such call counts. Mirrors ``amx_3d_weight`` in csrc/convolution_backward.cpp.
    """
    return (args.weight.dim() == 5 and args.grad_output.dtype == torch.bfloat16 and bool(args.output_mask[1])
            and cpu_has_amx_bf16())


def depthwise_dilated(args: ConvolutionBackwardArgs) -> bool:
    """Whether a bfloat16 2-D depthwise call (``groups == C_in > 1``), regular or transposed, with a
    dilation > 1 and a channels-last ``input`` asks for ``grad_weight``.

    torch 2.13's oneDNN ``grad_weight`` there was NaN, unwritten (a dilated tap left as the heap's
    values) or off by more than its scale: e.g. transposed ``input (2, 4, 3, 64)`` channels-last,
    ``weight (4, 1, 3, 1)``, dilation ``[2, 1]``; regular ``input (1, 2, 3, 40)`` channels-last,
    ``weight (2, 1, 2, 1)``, dilation ``[2, 1]`` (inputs at least 30 wide; found by helpers' fuzzes,
    Sapphire Rapids). float16, a channel multiplier of 2, stride 2, a contiguous input and dilation in
    width only were right; the predicate keeps the wider set. Mirrors ``depthwise_dilated`` in
    csrc/convolution_backward.cpp.
    """
    a = args.expanded()
    return (a.weight.dim() == 4 and a.grad_output.dtype == torch.bfloat16 and bool(a.output_mask[1])
            and 1 < a.groups == a.input.shape[1]
            and suggest_memory_format(a.input) == torch.channels_last
            and any(d > 1 for d in a.dilation))


@functools.cache
def onednn_avx2() -> bool:
    """Whether oneDNN runs its AVX2 kernels here: a CPU with AVX2 but not all of AVX-512 F, BW, VL and
    DQ (oneDNN's ``avx512_core``; ``torch._C._cpu._get_cpu_capability()``), or ``ONEDNN_MAX_CPU_ISA`` /
    ``DNNL_MAX_CPU_ISA`` capping oneDNN at an AVX2 ISA (``AVX2``, ``AVX2_VNNI``, ``AVX2_VNNI_2``). Read
    once, as oneDNN reads them. Mirrors ``onednn_avx2`` in csrc/convolution_backward.cpp."""
    avx512_core = all(cpu_capability(f"avx512_{x}") for x in ("f", "bw", "vl", "dq"))
    if not cpu_capability("avx2"):
        return False
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if var in os.environ:
            return os.environ[var].upper().startswith("AVX2") or not avx512_core
    return not avx512_core


def _strided_1x1_avx2(*, transposed: bool, kernel, stride, padding, groups: int, c_in: int, c_out: int) -> bool:
    """:func:`strided_1x1_avx2` from sizes, whatever the layout and ``output_mask``."""
    return (len(kernel) == 2 and int(groups) == 1 and all(int(k) == 1 for k in kernel)
            and all(int(p) == 0 for p in _expand(padding, 2)) and any(int(s) > 1 for s in _expand(stride, 2))
            and (c_out if transposed else c_in) < 8 and onednn_avx2())


def strided_1x1_avx2(args: ConvolutionBackwardArgs) -> bool:
    """Whether a 2-D call asks for ``grad_weight`` of an ungrouped, unpadded, strided 1x1 layer on
    channels-last tensors (``input`` or ``weight`` channels-last, upstream's
    ``mkldnn_conv_use_channels_last``; never float64) whose oneDNN source (a regular call's ``input``, a
    transposed call's ``grad_output``) has fewer than 8 channels, where oneDNN runs its AVX2 kernels
    (:func:`onednn_avx2`).

    There torch 2.13's ``jit_avx2_1x1_convolution_bwd_weights_t`` (float32 reaches it on such CPUs)
    returns a wrong ``grad_weight`` at two threads, hangs in an endless loop, or at one thread writes
    past a buffer (``free(): invalid next size``): e.g. transposed ``input (2, 4, 8, 8)`` channels-last,
    ``weight (4, 6, 1, 1)``, stride 2, ``output_padding`` 1, wrong in 8 of 8 calls (Zen 3, two threads);
    regular ``input (10, 4, 8, 8)``, ``weight (6, 4, 1, 1)``, stride 2, 1-4 of 8. Found on a Zen 3 VM
    (AVX2 only; ``scripts/sweep_native_defects.py --strided-1x1``): every wrong or hanging call had a
    source of 1-7 channels, no padding, stride > 1, groups 1 and a source exactly stride x the other
    side in every dim; 8-24 channels, padding 1, groups 2, contiguous tensors, 3-D layers and stride 1
    were right. The predicate keeps the wider set (any size). Mirrors ``strided_1x1_avx2`` in
    csrc/convolution_backward.cpp.
    """
    a = args.expanded()
    # upstream's mkldnn_convolution_backward runs the weight-gradient primitive for grad_bias too
    if not (a.weight.dim() == 4 and (bool(a.output_mask[1]) or bool(a.output_mask[2]))):
        return False
    if not _strided_1x1_avx2(transposed=a.transposed, kernel=a.weight.shape[2:], stride=a.stride,
                             padding=a.padding, groups=a.groups, c_in=a.input.shape[1], c_out=a.c_out):
        return False
    channels_last = any(suggest_memory_format(t) == torch.channels_last for t in (a.input, a.weight))
    return channels_last and torch.float64 not in (a.input.dtype, a.weight.dtype) and not a.input.is_mkldnn


def onednn_defect(args: ConvolutionBackwardArgs) -> bool:
    """Whether torch 2.13's oneDNN convolutions are known wrong on ``args`` in bfloat16 / float16:
    :func:`has_dead_tap`, :func:`width_one_transposed`, :func:`padded_3d`, :func:`amx_3d_weight` or
    :func:`depthwise_dilated`. Mirrors ``onednn_defect`` in csrc/convolution_backward.cpp."""
    width_one = width_one_transposed(
        transposed=args.transposed, input_size=args.input.shape[2:], kernel=args.weight.shape[2:])
    return (width_one or has_dead_tap(args) or padded_3d(args) or amx_3d_weight(args)
            or depthwise_dilated(args))


def expected_output_spatial(args: ConvolutionBackwardArgs) -> list[int]:
    """``spatial_out`` of the forward convolution, from ``input``, ``weight`` and the params.

    Regular:    ``(in + 2p - d(k-1) - 1) // s + 1``;
    transposed: ``(in - 1)s - 2p + d(k-1) + output_padding + 1``.
    """
    a = args.expanded()
    ins = a.input.shape[2:]
    ks = a.weight.shape[2:]
    if a.transposed:
        return [
            (i - 1) * s - 2 * p + d * (k - 1) + op + 1
            for i, k, s, p, d, op in zip(ins, ks, a.stride, a.padding, a.dilation, a.output_padding)
        ]
    return [
        (i + 2 * p - d * (k - 1) - 1) // s + 1
        for i, k, s, p, d in zip(ins, ks, a.stride, a.padding, a.dilation)
    ]


def _fail(backend: str, message: str) -> None:
    raise RuntimeError(f"{OP}[{backend}]: {message}")


def is_empty_call(args: ConvolutionBackwardArgs) -> bool:
    """Whether upstream serves the call with its ``Empty`` backend: a zero batch or zero input
    channels (``input.size(0) == 0 or input.size(1) == 0``, ``_select_conv_backend``). It returns
    zeros shaped like ``input``, ``weight`` and ``bias_sizes`` and reads nothing of ``grad_output``
    but its number of dims."""
    return args.input.dim() >= 2 and (args.input.size(0) == 0 or args.input.size(1) == 0)


def needs_weight_or_input(args: ConvolutionBackwardArgs) -> bool:
    """Whether ``output_mask`` asks for ``grad_input`` or ``grad_weight``. When it does not, the call
    needs nothing but ``grad_output`` (``grad_bias`` is its sum over every dim but 1, or nothing is
    requested): upstream computes no convolution then, and checks nothing of ``grad_output``'s sizes."""
    return bool(args.output_mask[0]) or bool(args.output_mask[1])


def check_args(args: ConvolutionBackwardArgs, backend: str) -> ConvolutionBackwardArgs:
    """Validate one call as upstream does, with messages that name the op, the backend and the values.

    Mirrors, in upstream's order, the checks of ``at::native::convolution_backward`` in
    aten/src/ATen/native/Convolution.cpp: ``ConvParams`` (list lengths), ``check_shape_backward``
    (``check_shape_forward`` without the bias: signs of the params, ``groups > 0``, ``weight.size(0)``
    at least and a multiple of ``groups``, channel counts, the kernel fitting the padded input),
    ``input.dim() == grad_output.dim()`` and no ``output_padding`` on regular convolutions. A call
    with a zero batch or zero input channels (:func:`is_empty_call`) is then valid: upstream's
    ``Empty`` backend returns zeros without reading ``grad_output``'s sizes, dtype or device, so
    nothing more is checked. Otherwise this adds the checks upstream leaves to the backend, where
    its error is an opaque oneDNN message (``grad_output``'s batch, channel count and spatial size,
    mixed dtypes and devices, ``output_padding`` against stride and dilation), and upstream's "only
    zero batch or zero channel inputs" for other zero-size inputs. A call that asks for neither
    ``grad_input`` nor ``grad_weight`` (:func:`needs_weight_or_input`) needs only ``grad_output``
    and is not checked further; otherwise a weight with zero output channels or a zero kernel size
    is rejected, as upstream's backends reject it (with messages such as "non-empty 2D or 4D weight
    tensor expected" or oneDNN's "could not create a primitive descriptor").

    Deliberately stricter than upstream: ``dilation`` must be positive (upstream's float32 paths
    accept 0 and return a result; float64 raises).

    Returns:
        ``args.expanded()``.

    Raises:
        RuntimeError: naming the offending values, e.g.
            ``convolution_backward[python]: groups (3) must divide C_in (8)``.
    """
    go, x, w = args.grad_output, args.input, args.weight
    k = w.dim()
    if k < 3:
        _fail(backend, f"weight should have at least three dimensions, got weight of size {list(w.shape)}")
    if x.dim() != k or go.dim() != k:
        _fail(
            backend,
            f"expected input and grad_output to be {k}-dimensional like weight {list(w.shape)}, "
            f"got input of size {list(x.shape)} and grad_output of size {list(go.shape)}",
        )
    if len(args.output_mask) != 3:
        _fail(backend, f"output_mask must have 3 entries, got {list(args.output_mask)}")
    d = k - 2
    for name in ("stride", "padding", "dilation", "output_padding"):
        values = list(getattr(args, name))
        if len(values) not in (1, d):
            _fail(
                backend,
                f"expected {name} to be a single integer value or a list of {d} values to match the "
                f"convolution dimensions, but got {name}={values}",
            )
    a = args.expanded()
    if any(s <= 0 for s in a.stride):
        _fail(backend, f"non-positive stride is not supported, got stride={a.stride}")
    if any(dd <= 0 for dd in a.dilation):
        _fail(backend, f"dilation should be greater than zero, got dilation={a.dilation}")
    if any(p < 0 for p in a.padding):
        _fail(backend, f"negative padding is not supported, got padding={a.padding}")
    if any(p < 0 for p in a.output_padding):
        _fail(backend, f"negative output_padding is not supported, got output_padding={a.output_padding}")
    groups = a.groups
    if groups <= 0:
        _fail(backend, f"expected groups to be greater than 0, but got groups={groups}")
    c_in = x.size(1)
    role = "C_in" if a.transposed else "C_out"
    if w.size(0) < groups:
        _fail(backend, f"{role} ({w.size(0)}) = weight.size(0) of weight {list(w.shape)} must be at least groups ({groups})")
    if w.size(0) % groups:
        _fail(backend, f"groups ({groups}) must divide {role} ({w.size(0)}) = weight.size(0) of weight {list(w.shape)}")
    if not a.transposed:
        if c_in != w.size(1) * groups:
            _fail(
                backend,
                f"input has C_in ({c_in}) channels but weight {list(w.shape)} with groups={groups} expects "
                f"weight.size(1) * groups = {w.size(1) * groups}"
                + (f"; groups ({groups}) must divide C_in ({c_in})" if c_in % groups else ""),
            )
        padded = [i + 2 * p for i, p in zip(x.shape[2:], a.padding)]
        kernel = [dd * (kk - 1) + 1 for kk, dd in zip(w.shape[2:], a.dilation)]
        if any(pi < ki for pi, ki in zip(padded, kernel)):
            _fail(
                backend,
                f"calculated padded input size per channel: {padded}, dilated kernel size: {kernel}; "
                "kernel size can't be greater than actual input size",
            )
        if any(p != 0 for p in a.output_padding):
            _fail(
                backend,
                f"output_padding is not supported for non-transposed convolutions; got output_padding={a.output_padding}",
            )
        c_out = w.size(0)
    else:
        if c_in != w.size(0):
            _fail(
                backend,
                f"transposed: input has C_in ({c_in}) channels but weight {list(w.shape)} expects weight.size(0) = {w.size(0)}",
            )
        c_out = w.size(1) * groups
    if is_empty_call(a):
        if a.output_mask[2] and a.bias_sizes is not None and any(int(b) < 0 for b in a.bias_sizes):
            _fail(backend, f"bias_sizes must be non-negative, got bias_sizes={list(a.bias_sizes)}")
        return a
    if not (go.dtype == x.dtype == w.dtype):
        _fail(
            backend,
            f"grad_output, input and weight must have the same dtype, got {go.dtype}, {x.dtype} and {w.dtype}",
        )
    if not (go.device == x.device == w.device):
        _fail(
            backend,
            f"grad_output, input and weight must be on the same device, got {go.device}, {x.device} and {w.device}",
        )
    if any(s == 0 for s in x.shape[2:]):
        _fail(
            backend,
            f"input {list(x.shape)} has a zero spatial size; only zero batch or zero channel inputs are supported",
        )
    if not needs_weight_or_input(a):
        return a
    if c_out == 0 or 0 in w.shape[2:]:
        _fail(
            backend,
            f"weight {list(w.shape)} has zero output channels or a zero kernel size; with a non-empty input "
            f"{list(x.shape)} only grad_bias can be computed (output_mask={list(a.output_mask)})",
        )
    if a.transposed:
        for i, (op, s, dd) in enumerate(zip(a.output_padding, a.stride, a.dilation)):
            if op >= s and op >= dd:
                _fail(
                    backend,
                    f"output padding must be smaller than either stride or dilation, but got "
                    f"output_padding={a.output_padding}, stride={a.stride}, dilation={a.dilation} (dim {i})",
                )
    if go.size(0) != x.size(0):
        _fail(backend, f"grad_output batch size ({go.size(0)}) does not match input batch size ({x.size(0)})")
    if go.size(1) != c_out:
        _fail(backend, f"grad_output has {go.size(1)} channels, expected C_out = {c_out} for weight {list(w.shape)}")
    expected = expected_output_spatial(a)
    # A transposed layer's output may be empty (input (2, 3, 1, 5), kernel (2, 3), padding 1 gives
    # (2, 4, 0, 5) natively): its gradients are zeros. A regular layer's is at least 1 (kernel check).
    if any(e < 0 for e in expected):
        _fail(backend, f"computed output size {expected} is too small for input {list(x.shape)} and weight {list(w.shape)}")
    if list(go.shape[2:]) != expected:
        _fail(
            backend,
            f"grad_output spatial size {list(go.shape[2:])} does not match the convolution's output size "
            f"{expected} (grad_output {list(go.shape)}, input {list(x.shape)}, weight {list(w.shape)}, "
            f"stride={a.stride}, padding={a.padding}, dilation={a.dilation}, transposed={a.transposed}, "
            f"output_padding={a.output_padding})",
        )
    return a


# --- upstream's output layout ------------------------------------------------------------------


def native_backend(args: ConvolutionBackwardArgs) -> torch._C._ConvBackend:
    """The backend upstream's ``select_conv_backend`` picks for this call (``torch._C._ConvBackend``).

    ``need_backward`` is derived from grad mode upstream; it only matters for forward-only
    backends (Winograd / XNNPACK, not on x86), so it is asked under ``torch.enable_grad()``.
    """
    a = args
    with torch.enable_grad():
        return torch._C._select_conv_backend(
            a.input, a.weight, None, a.stride, a.padding, a.dilation, a.transposed,
            a.output_padding, a.groups, a.bias_sizes,
        )


def output_memory_format(args: ConvolutionBackwardArgs, backend: torch._C._ConvBackend) -> torch.memory_format:
    """The memory format of upstream's ``grad_input`` and ``grad_weight``.

    Mirrors ``_determine_backend_memory_format(input, weight, backend)`` as used by
    ``at::native::convolution_backward``: only ``input`` and ``weight`` matter, never
    ``grad_output``. 1-D convolutions are computed as 2-D on a contiguous ``input.unsqueeze(2)``.
    """
    x, w = args.input, args.weight
    if w.dim() == 3:
        x, w = x.contiguous().unsqueeze(2), w.unsqueeze(2)
    return torch._C._conv_determine_backend_memory_format(x, w, backend)


# Backends whose grad_weight is ``empty_like(weight.contiguous(memory_format))`` (found by probing
# torch 2.13 on every ambiguous layout: a size-1 channel or kernel dim); every other output is
# ``empty(size, memory_format)``.
_WEIGHT_PRESERVING_BACKENDS = frozenset(
    getattr(torch._C._ConvBackend, name) for name in ("Slow2d", "SlowTranspose2d")
)


def empty_like_native(
    like: torch.Tensor,
    memory_format: torch.memory_format,
    backend: torch._C._ConvBackend,
    dtype: torch.dtype | None = None,
    *,
    is_input: bool = False,
) -> torch.Tensor:
    """An uninitialised tensor shaped like ``like`` (``input`` or ``weight``) with the exact strides
    upstream gives its gradient.

    - Upstream allocates ``empty(size, memory_format)``, except ``grad_weight`` of the THNN
      ``Slow2d`` / ``SlowTranspose2d`` paths: ``empty_like(weight.contiguous(memory_format))``,
      where an ambiguous layout (a size-1 channel or kernel dim) keeps ``weight``'s own strides.
    - 1-D convolutions run as 2-D on ``input.contiguous().unsqueeze(2)`` / ``weight.unsqueeze(2)``
      and the result is squeezed back (upstream's ``view4d`` / ``view3d``).
    """
    dtype = dtype or like.dtype
    t = like
    one_d = t.dim() == 3
    if one_d:
        t = (t.contiguous() if is_input else t).unsqueeze(2)
    if not is_input and backend in _WEIGHT_PRESERVING_BACKENDS and t.is_contiguous(memory_format=memory_format):
        out = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
    else:
        out = torch.empty(t.shape, dtype=dtype, device=t.device, memory_format=memory_format)
    return out.squeeze(2) if one_d else out


# Dims from innermost to outermost of each memory format (contiguous: the last dim first).
_FORMAT_ORDER = {torch.channels_last: (1, 3, 2, 0), torch.channels_last_3d: (1, 4, 3, 2, 0)}
_FORMAT_DIMS = {torch.channels_last: 4, torch.channels_last_3d: 5}


def canonical_strides(shape: Sequence[int], memory_format: torch.memory_format) -> tuple[int, ...]:
    """The strides ``torch.empty(shape, memory_format=memory_format)`` gives, with no allocation (c10's
    contiguous strides count a size-0 dim as 1, ``get_channels_last_strides_2d`` / ``_3d`` as 0)."""
    order = _FORMAT_ORDER.get(memory_format)
    if order is not None and len(order) != len(shape):
        raise ValueError(f"canonical_strides: {memory_format} needs {len(order)} dims, got shape {tuple(shape)}")
    strides = [0] * len(shape)
    step = 1
    for d in order or range(len(shape) - 1, -1, -1):
        strides[d] = step
        step *= int(shape[d]) if order else max(int(shape[d]), 1)
    return tuple(strides)


def _contiguous_formats(t: torch.Tensor, preferred: torch.memory_format) -> list[torch.memory_format]:
    """The memory formats ``t`` is contiguous in, ``preferred`` first, then contiguous, then the
    channels-last format of its dims."""
    own = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim(), torch.contiguous_format)
    formats = []
    for fmt in (preferred, torch.contiguous_format, own):
        if fmt not in formats and _FORMAT_DIMS.get(fmt, t.dim()) == t.dim() and t.is_contiguous(memory_format=fmt):
            formats.append(fmt)
    return formats


def canonical_size1_strides(t: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``t``, or a view of the same elements with the strides :func:`canonical_strides` gives it in a
    memory format it is contiguous in (``memory_format`` first), where it is contiguous in a format but
    has the canonical strides of none: strides that differ only on size-1 dims. No copy: a size-1 dim's
    stride never moves a pointer. A tensor with the canonical strides of any of its formats (a 1x1
    weight, an ``(N, C, 1, 1)`` activation) is left as it is: the original kernel reads those right.

    torch counts such a tensor as contiguous in the format (``is_contiguous`` skips size-1 dims), and
    ordinary code makes them: a batch of one from an HWC image, ``hwc.permute(2, 0, 1).unsqueeze(0)``,
    has strides ``(C, 1, W*C, C)``. torch 2.13's kernels take ``t`` as it is then (``contiguous`` returns
    it) and some read the odd stride: the grouped channels-last ``grad_weight`` of
    ``at::native::convolution_backward`` (float64 and bfloat16, off by more than its scale) and oneDNN's
    forward convolution with such a weight (the python backend's ``grad_input``).
    Mirrors ``canonical_size1_strides`` in csrc/convolution_backward.cpp."""
    fmt = _size1_restride_format(t, memory_format)
    return t if fmt is None else t.as_strided(t.shape, canonical_strides(t.shape, fmt), t.storage_offset())


def _size1_restride_format(t: torch.Tensor, memory_format: torch.memory_format) -> torch.memory_format | None:
    """The format whose canonical strides :func:`canonical_size1_strides` gives ``t``, ``None`` where it
    leaves ``t`` as it is. Whether it is ``None`` does not depend on ``memory_format``."""
    if t.numel() == 0 or 1 not in t.shape:
        return None
    formats = _contiguous_formats(t, memory_format)
    if not formats or any(t.stride() == canonical_strides(t.shape, fmt) for fmt in formats):
        return None
    return formats[0]


def canonical_call(args: ConvolutionBackwardArgs) -> ConvolutionBackwardArgs:
    """``args``, or a copy whose ``grad_output``, ``input`` and ``weight`` are
    :func:`canonical_size1_strides` views (preferring the memory format upstream gives the call's
    outputs, :func:`output_memory_format`): the same values, on strides upstream's kernels read right.
    Restriding can change the layout upstream gives the outputs (an odd stride can decide
    ``suggest_memory_format``; ``weight``'s own strides survive into the THNN paths' ``grad_weight``,
    :func:`empty_like_native`), so a caller computes on the copy and lays the results out as upstream
    lays out ``args``. Calls that read no convolution (:func:`is_empty_call`: zeros like ``input`` and
    ``weight``, their own strides; ``grad_bias`` alone) are ``args``. Mirrors ``canonical_call`` in
    csrc/convolution_backward.cpp."""
    if is_empty_call(args) or not needs_weight_or_input(args):
        return args
    tensors = (args.grad_output, args.input, args.weight)
    if all(_size1_restride_format(t, torch.contiguous_format) is None for t in tensors):
        return args  # (no tensor restrides whatever the format: no select_conv_backend)
    fmt = output_memory_format(args, native_backend(args))
    go, x, w = (canonical_size1_strides(t, fmt) for t in tensors)
    if go is args.grad_output and x is args.input and w is args.weight:
        return args
    return dataclasses.replace(args, grad_output=go, input=x, weight=w)


def significant_strides(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``(dim, stride)`` for every dim of size > 1: a tensor's layout (a size-1 dim's stride never moves a
    pointer; Inductor's ``assert_size_stride`` compares fallback kernels' outputs by the same rule)."""
    return tuple((d, s) for d, (n, s) in enumerate(zip(t.shape, t.stride())) if n > 1)


def native_defect_reason(*, device_type: str, dtype, transposed: bool, input_size, grad_output_size, kernel,
                         stride, padding, dilation, groups: int = 1, c_in: int | None = None,
                         c_out: int | None = None) -> str | None:
    """Why the original kernel's result cannot be the reference for this call, or ``None``.

    Found on torch 2.13.0+cpu, x86 (tests/ops/convolution_backward/test_native_defects.py): for
    float16 / bfloat16 on the CPU, where a kernel tap only ever meets padding (:func:`dead_taps`), the
    oneDNN path leaves that tap of ``grad_weight`` uninitialised (bfloat16) and segfaults computing
    ``grad_input`` of transposed layers, e.g. ``input (1, 3, 3, 3, 2) f16, weight (3, 2, 1, 3, 1),
    stride 2, padding [1, 1, 1], dilation [2, 2, 2], output_mask [True, False, False]``; on transposed
    layers of input width 1 under a wider kernel (:func:`width_one_transposed`, e.g. ``input
    (2, 16, 8, 1) bf16``, kernel 3x3, stride 2) it leaves most of bfloat16 ``grad_input`` unwritten.
    3-D layers with padding > stride in depth and no row there meeting the whole kernel
    (:func:`depth_without_full_row`) get wrong gradients, a hang or a corrupted heap in every dtype
    but float64; regular padded 3-D bfloat16 layers with a dim shorter than the kernel (``args.padded_3d``) get unwritten outputs, and a
    corrupted heap has aborted a test process after one; on a CPU with AMX-BF16, 3-D bfloat16 layers
    get a wrong ``grad_weight`` (:func:`amx_3d_weight`), and so do dilated 2-D depthwise
    bfloat16 layers with a channels-last input (:func:`depthwise_dilated`; any layout
    here, where ``groups`` and ``c_in`` are given). Where oneDNN runs its AVX2 kernels, strided 1x1
    layers whose oneDNN source has under 8 channels get a wrong ``grad_weight``, a hang or a corrupted
    heap in float32 too (:func:`strided_1x1_avx2`; any layout here, where ``c_in`` and ``c_out`` are
    given). A crash or garbage cannot be compared against, so
    the fuzzer draws these calls in
    float32, or float64 where float32 is affected too.
    """
    if device_type != "cpu" or dtype == torch.float64:
        return None
    if depth_without_full_row(transposed=transposed, input_size=input_size, grad_output_size=grad_output_size,
                              kernel=kernel, stride=stride, padding=padding, dilation=dilation):
        return ("the original CPU kernel computes wrong gradients, hangs or corrupts the heap on 3-D layers with "
                "padding > stride in depth and no row there meeting the whole kernel (oneDNN, torch 2.13)")
    if c_in is not None and c_out is not None and _strided_1x1_avx2(
            transposed=transposed, kernel=kernel, stride=stride, padding=padding, groups=groups, c_in=c_in,
            c_out=c_out):
        return ("the original CPU kernel's grad_weight is wrong, or it hangs or corrupts the heap, on strided 1x1 "
                "channels-last layers whose oneDNN source has under 8 channels where oneDNN runs its AVX2 kernels "
                "(torch 2.13; args.strided_1x1_avx2; counted here whatever the layout)")
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if any(dead_taps(transposed=transposed, input_size=input_size, grad_output_size=grad_output_size, kernel=kernel,
                     stride=stride, padding=padding, dilation=dilation)):
        return ("the original CPU kernel leaves grad_weight uninitialised (bfloat16) or segfaults (grad_input, "
                "transposed) where a kernel tap only meets padding (torch 2.13)")
    if width_one_transposed(transposed=transposed, input_size=input_size, kernel=kernel):
        return ("the original CPU kernel leaves most of grad_input unwritten (bfloat16, oneDNN) on transposed layers "
                "whose input has width 1 under a wider kernel (torch 2.13)")
    if dtype == torch.bfloat16 and not transposed and len(kernel) == 3 and any(int(p) > 0 for p in padding):
        return ("the original CPU kernel leaves parts of grad_weight / grad_input unwritten and can corrupt the heap "
                "on padded 3-D bfloat16 layers (oneDNN, torch 2.13; args.padded_3d)")
    if dtype == torch.bfloat16 and len(kernel) == 2 and 1 < groups == c_in and any(int(d) > 1 for d in dilation):
        return ("the original CPU kernel's grad_weight is NaN or unwritten on dilated 2-D depthwise bfloat16 "
                "layers with a channels-last input (oneDNN, torch 2.13; "
                "args.depthwise_dilated; counted here whatever the layout)")
    if dtype == torch.bfloat16 and len(kernel) == 3 and cpu_has_amx_bf16():
        return ("the original CPU kernel's grad_weight is off by up to half its scale on 3-D bfloat16 layers "
                "on a CPU with AMX-BF16 (oneDNN, torch 2.13; args.amx_3d_weight)")
    return None
