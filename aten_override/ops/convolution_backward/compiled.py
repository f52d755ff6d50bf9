r"""The compiled (C++) backend of ``aten::convolution_backward``: loads ``aten_override._C`` and
describes it. Importing this module never fails; without the extension
:func:`unavailable_reason` says why.

The C++ code (``aten_override/csrc``) mirrors the contract of the python backend
(:mod:`.python_impl`): the checks of :func:`.args.check_args` with ``convolution_backward[compiled]``
messages, upstream's output strides (``at::native::select_conv_backend`` +
``_determine_backend_memory_format``), ``None`` for masked outputs, zeros for empty batches.

Each call is served by the kernel of its *layer class* (:data:`LAYER_CLASSES`, the table in
``csrc/convolution_backward.cpp``):

==================== ======== =================================================================
class                kernel   why
==================== ======== =================================================================
empty                zeros    zero batch / zero input channels (upstream's Empty backend); no abort
                              with ``bias_sizes=None``
depthwise            direct   ``groups == C_in`` (any channel multiplier, any plane size): native
                              reaches 1-6% of FLOP peak; fused kernel (``csrc/cpu/depthwise.cpp``),
                              grad_input and grad_weight in one pass over grad_output and input;
                              the table takes channels in the vector lanes on small or strided
                              planes (:func:`depthwise_kernel`); the autotuner measures both walks;
                              the lanes walks keep a kernel row's taps in registers at stride 1 and
                              read / write channels-last tensors in place (ConvNeXt)
grouped              direct   ``1 < groups < C_in``, ``(C_in/groups)*(C_out/groups) <= 64``; larger groups: dense
one-channel          direct   ``groups == 1, C_in == 1`` (wav2vec2's first layer)
small-planes         native   grouped / one-channel with under 64 output elements per channel: the
                              direct kernel's per-plane cost loses there (depthwise stays depthwise)
dense                native   dense 1-D/2-D layers, and what the GEMM classes below leave to native:
                              native is near the hardware limit there, or as fast. The autotuner also
                              measures gemm-im2col there and, on 3x3 stride-1 layers, winograd
                              (``csrc/cpu/winograd.cpp``: F(2x2,3x3) grad_input, F(3x3,2x2) grad_weight,
                              2.25x fewer multiplications than native's oneDNN; its 16 GEMMs per chunk
                              on MKL or on our vector micro-kernels, whichever measured faster in this
                              process: ``_C.winograd_gemm()``), on 1x1 stride-1
                              float32/float64 layers pointwise-fused (``csrc/cpu/pointwise.cpp``: both
                              gradients in one pass over grad_output with vector micro-kernels, where
                              MKL runs the skinny GEMMs of few-channel layers at 30-50 GFLOP/s), on 1x1
                              stride-1 bfloat16 layers, where the CPU has AVX512_BF16, pointwise-bf16
                              (``csrc/cpu/pointwise_bf16.cpp``: the same plan on pairs of bfloat16
                              values with the CPU's bfloat16 dot products; ``_C.bf16_dot()``), and on
                              float32/float64 layers of 1-D shape (any stride, groups, padding,
                              dilation) kn2row-lanes (``csrc/cpu/kn2row.cpp``: per tap, one product over
                              only the positions where the tap meets the input, on channels-last copies;
                              wav2vec2's positional convolution, 128 taps over 49 frames, and its
                              feature encoder's stride-2 layers); wherever gemm-kn2row applies,
                              float32/float64, kn2row-planes (``csrc/cpu/gemm.cpp``: its per-tap products
                              on the same micro-kernels, in the tensors' own layout); on bfloat16
                              layers of any stride (groups 1, or stride 1 with taps in one dim)
                              gemm-kn2row (``csrc/cpu/gemm.cpp``: oneDNN's bfloat16 GEMMs on zero-padded
                              channel-major copies, taps stacked per phase of the input's positions,
                              each output rounded once; wav2vec2's stride-2 feature encoder, ResNet's
                              1x1 stride-1 and stride-2 layers)
transposed           native   no compiled kernel yet
bias-only            sum      ``output_mask`` asks for neither grad_input nor grad_weight: grad_bias is
                              grad_output's sum (whatever the weight: zero output channels or kernel size too)
pointwise            gemm     1x1, no padding, ``groups == 1``, at least 512 grad_output elements
                              (smaller pointwise and 3-D layers: dense), where native picks oneDNN (its backward
                              reaches 4-17% of peak): plain GEMMs on views (``csrc/cpu/gemm.cpp``);
                              bfloat16 only where each output is one AMX GEMM (the batch fits one
                              chunk). Where native picks Slow2d (itself GEMMs): dense. The autotuner
                              also measures pointwise-fused on both
grouped-gemm         gemm     float32/float64, ``1 < groups < C_in`` with more than 64 channel pairs per
                              group and more than 64 channels on a side, some stride > 1: im2col + GEMM
                              group by group (at stride 1 native is faster: dense)
kn2row-3d            gemm     3-D, ``groups == 1``, stride 1, taps in one dim (3x1x1), where native picks
                              Slow3d (or oneDNN, from 2^18 grad_output elements): one GEMM per tap on
                              shifted views, no copies
im2col-3d            gemm     other 3-D ``groups == 1`` layers where native picks Slow3d: vol2col + GEMM
                              in chunks bounded by an 8 MiB workspace
kn2row               native   1-D/2-D ``groups == 1``, stride 1, taps in one dim: kn2row measured no
                              faster than native's oneDNN there
dead-taps            upcast   bfloat16/float16 where native picks oneDNN and a kernel tap only meets
                              padding: torch 2.13's oneDNN leaves that tap of grad_weight uninitialised
                              and segfaults on grad_input of such transposed layers; also transposed
                              layers of input width 1 under a wider kernel (most of grad_input left
                              unwritten), and padded regular 3-D layers with a dim shorter than the
                              kernel (parts of both gradients left unwritten, heap corruption); computed in float32 by the compiled
                              backend's own choice for the float32 call (native, or a kernel that
                              measured faster: gemm-kn2row on R(2+1)D's 3x1x1 layers), rounded once.
                              Also 3-D layers (any dtype but float64) with padding > stride in depth
                              and no row there that meets the whole kernel (transposed: no input
                              position writing inside the output; regular: no output position reading
                              inside the input): oneDNN's float32 gradients are wrong, hang or corrupt
                              the heap on some; computed in float64 the same way. And
                              bfloat16 3-D layers asking for grad_weight on a CPU with AMX-BF16
                              (``args.amx_3d_weight``: oneDNN's grad_weight off by up to half its
                              scale on larger planes): where the call folds into a 2-D one (a 1x1
                              spatial kernel, or kernel depth 1 without depth padding: R(2+1)D's
                              layers), fold-2d serves that bfloat16 2-D call, where native is right
                              (tests/ops/convolution_backward/test_native_defects.py).
                              A regular call whose dead taps are the kernel's ends in each dim
                              (R(2+1)D's 3x1x1 layers at one frame, padding 1) is the same
                              convolution without them and with the padding lowered: kernel
                              ``live-taps`` serves that call in its own dtype (where native is right
                              on it, or it folds), grad_weight zero on the dead taps
grouped-lanes        direct   float32/float64/bfloat16, more than 64 channel pairs per group, 2 to 64
                              channels on each side, some stride > 1, at least 2^20 grad_output
                              elements (ResNeXt's stride-2 layers; fewer or stride 1: dense): each
                              group's planes transposed to [position][channel] tiles, both gradients
                              from them without im2col columns (``csrc/cpu/grouped.cpp``)
==================== ======== =================================================================

"native" is a deliberate choice, not a fallback: the call is counted as served by the compiled
backend. Where native's oneDNN path is known wrong on a call (the dead-taps conditions) that a class
of our own kernels serves, the class stays, and the upcast stands in for native wherever native would
run: the autotuner's reference and baseline, and the result of a call a kernel declines. A *fallback* (:func:`unsupported_reason` is not ``None``: integer / complex dtypes, sparse
layouts, CUDA tensors unless the CUDA kernels are enabled) runs the original kernel with the reason
recorded in :func:`aten_override.stats`.

float16 / bfloat16 accumulate in float32; the direct kernels do not use atomics and their results
do not depend on the thread count. The GEMM kernels use no atomics either (two runs give the same
bits); their sums go through MKL / oneDNN.

CUDA: when torch has CUDA, ``setup.py`` also builds ``csrc/cuda/direct.cu``, the direct kernel of the
**depthwise** class for CUDA tensors (grad_input: one thread per input element; grad_weight: per-block
partial sums reduced in a fixed order; no atomics, so results are bitwise reproducible and
``torch.use_deterministic_algorithms(True)`` raises no alert; current stream, device guard). Every
other class on CUDA is computed by the original kernel by choice (cuDNN). These kernels have not
been run on hardware by this project yet, so they serve calls only when the environment variable
``ATEN_OVERRIDE_CUDA_KERNELS=1`` is set when the extension is imported (read once).
:func:`cuda_kernels` says which case holds; CUDA calls otherwise fall back with the reason

- ``"no CUDA kernels in this build"`` (torch without CUDA, or the CUDA build failed), or
- ``"CUDA kernels built but not enabled (unverified on hardware; set ATEN_OVERRIDE_CUDA_KERNELS=1)"``.
"""

from __future__ import annotations

from types import ModuleType

from .args import ConvolutionBackwardArgs

__all__ = [
    "NAME",
    "LAYER_CLASSES",
    "extension",
    "unavailable_reason",
    "cuda_kernels",
    "unsupported_reason",
    "layer_class",
    "convolution_backward",
]

NAME = "compiled"

try:
    from ... import _C as _ext
except Exception as e:  # noqa: BLE001 - not built, or built against another torch: never fail import
    _ext = None
    _REASON: str | None = f"compiled kernels not built ({type(e).__name__}: {e})"
else:
    _REASON = None
    from ... import autotune as _autotune

    # A process-wide default for calls outside enable(): ATEN_OVERRIDE_AUTOTUNE (unset: on).
    _ext.set_autotune(_autotune.setting().enabled)

LAYER_CLASSES: tuple[tuple[str, str, str], ...] = tuple(_ext.layer_classes()) if _ext is not None else ()
"""``(class, kernel, why)`` rows of the C++ table; empty when the extension is not built."""


def extension() -> ModuleType | None:
    """The loaded ``aten_override._C`` module, or ``None`` when it is not built."""
    return _ext


def unavailable_reason() -> str | None:
    """``None`` when the extension is loaded, else ``"compiled kernels not built (<why>)"``."""
    return _REASON


def cuda_kernels() -> str:
    """The CUDA kernels of this build: ``"not built"``, ``"built, disabled"`` (CUDA calls go to the
    original kernel) or ``"enabled"`` (``ATEN_OVERRIDE_CUDA_KERNELS=1`` at import); ``"not built"``
    also when the extension itself is not."""
    return _ext.cuda_kernels() if _ext is not None else "not built"


def unsupported_reason(args: ConvolutionBackwardArgs) -> str | None:
    """Why the compiled backend hands ``args`` to the original kernel, or ``None`` when it serves them
    (possibly by choosing native for its layer class, which is not a fallback)."""
    if _ext is None:
        return _REASON
    return _ext.unsupported_reason(args.grad_output, args.input, args.weight)


def layer_class(args: ConvolutionBackwardArgs) -> str:
    """The layer class (a :data:`LAYER_CLASSES` name) that serves ``args``.

    Raises:
        RuntimeError: ``convolution_backward[compiled]: ...`` for invalid arguments, or when the
            extension is not built.
    """
    _require()
    return _ext.layer_class(*_aten_args(args))


def planned_kernel(args: ConvolutionBackwardArgs) -> str:
    """The kernel (one of ``_C.kernel_names()``) that will serve ``args``, or a split
    ``"gi_kernel+gw_kernel"`` (grad_input and grad_bias from the first, grad_weight from the second):
    the layer-class table's, the autotuner's for a tuned signature, or ``"tuning"`` when its first
    call will tune it. Runs nothing.

    Raises:
        RuntimeError: as :func:`layer_class`.
    """
    _require()
    return _ext.planned_kernel(*_aten_args(args))


def depthwise_kernel(args: ConvolutionBackwardArgs) -> str | None:
    """The layer-class table's walk of ``csrc/cpu/depthwise.cpp`` for ``args`` when its class is
    ``depthwise`` (the autotuner measures the walks, ``depthwise-lanes``, ``depthwise-plane`` and, on
    planes whose whole-plane lanes tiles exceed the L2 cache, ``depthwise-bands``, and
    :func:`planned_kernel` says which it chose): ``"channels-in-lanes"`` (planes of at most 128 elements, or strided with at most 1,024 grad_output
    elements per plane, and at least half a vector of channels: 8 for float32 / bfloat16 / float16, 4
    for float64) or ``"per-plane"``; ``None`` for other classes and for CUDA calls.

    Raises:
        RuntimeError: as :func:`layer_class`.
    """
    _require()
    return _ext.depthwise_kernel(*_aten_args(args))


def convolution_backward(args: ConvolutionBackwardArgs):
    """``(grad_input, grad_weight, grad_bias)`` computed by the C++ backend; ``None`` where
    ``args.output_mask`` is False. Shapes, dtypes and strides as :func:`.python_impl.convolution_backward`.

    Raises:
        RuntimeError: ``convolution_backward[compiled]: ...`` for invalid arguments (the checks of
            :func:`.args.check_args`), or when the extension is not built.
    """
    _require()
    return _ext.convolution_backward(*_aten_args(args))


def _require() -> None:
    if _ext is None:
        raise RuntimeError(f"convolution_backward[{NAME}]: {_REASON}")


def _aten_args(args: ConvolutionBackwardArgs) -> tuple:
    a = args
    bias_sizes = None if a.bias_sizes is None else [int(s) for s in a.bias_sizes]
    return (
        a.grad_output, a.input, a.weight, bias_sizes, [int(s) for s in a.stride], [int(s) for s in a.padding],
        [int(s) for s in a.dilation], bool(a.transposed), [int(s) for s in a.output_padding], int(a.groups),
        [bool(m) for m in a.output_mask],
    )
