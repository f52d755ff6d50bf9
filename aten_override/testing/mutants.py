r"""Plausible bugs, one per backend, injected into :data:`.example_backends.from_forward_convolutions`.

Each mutant is :class:`~.example_backends.ForwardConvolutionBackward` with one step overridden,
a module-level backend the shipped suite loads by name::

    python -m aten_override test --backend aten_override.testing.mutants:flipped_kernel

:data:`MUTANTS` lists them as data (name -> the bug, in words); ``scripts/mutation_check.py`` runs
the suite against every one and requires each to fail (a mutant the suite passes names a gap in
it). The bugs are those a kernel author makes: output_padding rows lost, a weight gradient not
cut to the kernel or computed with stride and dilation in their forward roles, groups read in the
wrong channel order, the wrong output layout, outputs the mask leaves out, uninitialised or
missing empty paths, zero input channels rejected, transposed roles not swapped, the wrong dtype,
strides ignored, low-precision sums, bfloat16 computed in float16's range, small scale errors
and a flipped kernel.
"""

from __future__ import annotations

import torch

from .example_backends import ForwardConvolutionBackward, _crop

__all__ = ["MUTANTS", "CONTROL"]

CONTROL = "aten_override.testing.example_backends:from_forward_convolutions"
"""The unmutated backend (``--backend`` spec): the suite must pass it."""


class _OutputPaddingDropped(ForwardConvolutionBackward):
    def grad_weight(self, a, go, x):
        if a.transposed:  # the weight gradient's loops run over the output without output_padding
            go = _crop(go, [n - p for n, p in zip(go.shape[2:], a.output_padding)])
        return super().grad_weight(a, go, x)


class _GradWeightNotCropped(ForwardConvolutionBackward):
    def grad_weight(self, a, go, x):
        if a.transposed:
            go, x = x, go
        return self.weight_contraction(x, go, a.stride, a.padding, a.dilation, a.groups)


class _StrideDilationSwapped(ForwardConvolutionBackward):
    def weight_contraction(self, x, go, stride, padding, dilation, groups):
        # the weight-gradient convolution takes them in the forward's roles, not exchanged
        return super().weight_contraction(x, go, dilation, padding, stride, groups)


class _GroupsInterleaved(ForwardConvolutionBackward):
    def weight_contraction(self, x, go, stride, padding, dilation, groups):
        # grad_output's channels read as (O, G) instead of (G, O)
        go = go.unflatten(1, (go.size(1) // groups, groups)).transpose(1, 2).flatten(1, 2)
        return super().weight_contraction(x, go, stride, padding, dilation, groups)


class _AlwaysContiguous(ForwardConvolutionBackward):
    def memory_format(self, a, backend):
        return torch.contiguous_format


class _FormatFromGradOutput(ForwardConvolutionBackward):
    def memory_format(self, a, backend):
        go = a.grad_output
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(go.dim())
        channels_last = fmt is not None and go.is_contiguous(memory_format=fmt) and not go.is_contiguous()
        return fmt if channels_last else torch.contiguous_format


class _OutputMaskIgnored(ForwardConvolutionBackward):
    def __call__(self, *args):
        return super().__call__(*args[:-1], [True, True, True])


class _EmptyOutputsUninitialised(ForwardConvolutionBackward):
    def zeros_like(self, t):
        return torch.empty_like(t)


class _NoEmptyPath(ForwardConvolutionBackward):
    def is_empty(self, a, backend):
        return False


class _ZeroInputChannelsRejected(ForwardConvolutionBackward):
    def __call__(self, grad_output, input, weight, *args):
        if input.size(1) == 0:
            raise RuntimeError(f"convolution_backward: input {list(input.shape)} has zero channels")
        return super().__call__(grad_output, input, weight, *args)


class _TransposedRolesNotSwapped(ForwardConvolutionBackward):
    def grad_weight(self, a, go, x):
        return _crop(self.weight_contraction(x, go, a.stride, a.padding, a.dilation, a.groups), a.weight.shape[2:])


class _Float64Results(ForwardConvolutionBackward):
    def __call__(self, grad_output, *args):
        outputs = super().__call__(grad_output, *args)
        if grad_output.dtype != torch.float32:
            return outputs
        return tuple(None if t is None else t.double() for t in outputs)


class _StridesIgnored(ForwardConvolutionBackward):
    def operands(self, a):
        go, x, w = super().operands(a)
        # input's storage read as if it were contiguous
        contiguous = [1] * x.dim()
        for d in range(x.dim() - 2, -1, -1):
            contiguous[d] = contiguous[d + 1] * x.size(d + 1)
        return go, x.as_strided(x.shape, contiguous, x.storage_offset()), w


class _BiasSummedInLowDtype(ForwardConvolutionBackward):
    def grad_bias(self, a, go):
        flat = a.grad_output.transpose(0, 1).reshape(a.grad_output.size(1), -1)
        total = torch.zeros(flat.size(0), dtype=flat.dtype, device=flat.device)
        for j in range(flat.size(1)):  # one running sum in the input dtype, rounded at every step
            total += flat[:, j]
        return total


class _BFloat16ViaFloat16(ForwardConvolutionBackward):
    def compute_dtype(self, dtype):
        return torch.float16 if dtype == torch.bfloat16 else super().compute_dtype(dtype)


class _GroupedScaleError(ForwardConvolutionBackward):
    def grad_weight(self, a, go, x):
        gw = super().grad_weight(a, go, x)
        return gw * 1.001 if a.groups > 1 else gw


class _GradInputScaleError(ForwardConvolutionBackward):
    def grad_input(self, a, go, w):
        return super().grad_input(a, go, w) * 1.0001


class _FlippedKernel(ForwardConvolutionBackward):
    def grad_weight(self, a, go, x):
        gw = super().grad_weight(a, go, x)
        return gw.flip(list(range(2, gw.dim())))


class _TransposedGradInputNotCut(ForwardConvolutionBackward):
    def grad_input(self, a, go, w):
        if a.transposed:  # output_padding >= stride leaves rows beyond spatial_in
            return torch.ops.aten.convolution.default(
                go, w, None, a.stride, a.padding, a.dilation, False, [0] * a.spatial_dims, a.groups
            )
        return super().grad_input(a, go, w)


class _BiasFirstSampleOnly(ForwardConvolutionBackward):
    def grad_bias(self, a, go):
        return super().grad_bias(a, go[:1])


class _PaddingIgnoredInGradWeight(ForwardConvolutionBackward):
    def weight_contraction(self, x, go, stride, padding, dilation, groups):
        return super().weight_contraction(x, go, stride, [0] * len(padding), dilation, groups)


_CLASSES: dict[str, tuple[type, str]] = {
    "output_padding_dropped": (_OutputPaddingDropped, "transposed: grad_weight ignores grad_output's output_padding rows"),
    "grad_weight_not_cropped": (_GradWeightNotCropped, "grad_weight keeps the taps the stride never reaches (not cut to kernel)"),
    "stride_dilation_swapped": (_StrideDilationSwapped, "the weight-gradient convolution takes stride and dilation unexchanged"),
    "groups_interleaved": (_GroupsInterleaved, "grad_weight reads grad_output's channels as (C_out/groups, groups)"),
    "always_contiguous": (_AlwaysContiguous, "memory format ignored: contiguous outputs for channels_last inputs"),
    "format_from_grad_output": (_FormatFromGradOutput, "output memory format taken from grad_output, not input/weight"),
    "output_mask_ignored": (_OutputMaskIgnored, "every output computed and returned, output_mask ignored"),
    "empty_outputs_uninitialised": (_EmptyOutputsUninitialised, "empty path returns torch.empty, not zeros"),
    "no_empty_path": (_NoEmptyPath, "no empty path: zero batch / zero channels go through the convolutions"),
    "zero_channels_rejected": (_ZeroInputChannelsRejected, "zero input channels raise instead of giving zeros"),
    "transposed_roles_not_swapped": (_TransposedRolesNotSwapped, "transposed: grad_weight without swapping input and grad_output"),
    "float64_results": (_Float64Results, "float32 calls get float64 results"),
    "strides_ignored": (_StridesIgnored, "input's storage read as contiguous, its strides ignored"),
    "bias_summed_in_low_dtype": (_BiasSummedInLowDtype, "grad_bias accumulated in the input dtype (bfloat16: 8 bits)"),
    "bfloat16_via_float16": (_BFloat16ViaFloat16, "bfloat16 computed in float16 (overflows beyond 65504)"),
    "grouped_scale_error": (_GroupedScaleError, "grad_weight 0.1% too large when groups > 1"),
    "grad_input_scale_error": (_GradInputScaleError, "grad_input 0.01% too large"),
    "flipped_kernel": (_FlippedKernel, "grad_weight with its kernel flipped"),
    "transposed_grad_input_not_cut": (_TransposedGradInputNotCut, "transposed: grad_input not cut to spatial_in (output_padding >= stride)"),
    "bias_first_sample_only": (_BiasFirstSampleOnly, "grad_bias sums only the first sample"),
    "padding_ignored_in_grad_weight": (_PaddingIgnoredInGradWeight, "the weight-gradient convolution without padding"),
}

MUTANTS: dict[str, str] = {name: description for name, (_, description) in _CLASSES.items()}
"""Mutant name (a function of this module, ``--backend aten_override.testing.mutants:NAME``) ->
the bug it injects."""

globals().update({name: cls() for name, (cls, _) in _CLASSES.items()})
