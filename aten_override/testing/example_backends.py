r"""User backends in the form ``python -m aten_override test --backend module:function`` takes.

A backend is a function with the aten signature::

    fn(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
       output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)

``grad_output``: ``(N, C_out, *spatial_out)``; ``input``: ``(N, C_in, *spatial_in)``; ``weight``:
``(C_out, C_in / groups, *kernel)`` (transposed: ``(C_in, C_out / groups, *kernel)``); outputs
shaped like ``input``, ``weight`` and ``(C_out,)``, ``None`` where ``output_mask`` is False.

- :func:`delegating`: correct: delegates to the original ATen kernel (a template to start from);
- :data:`from_forward_convolutions`: correct, and independent of the original kernel: every
  gradient from forward convolutions, summed in another order than oneDNN's (a compact reference;
  :mod:`aten_override.testing.mutants` injects bugs into it);
- :func:`wrong_grad_weight` and :func:`wrong_strides`: deliberately wrong, to show the suite
  fails them (``aten_override test --backend aten_override.testing.example_backends:wrong_strides``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import aten_override
from aten_override.ops.convolution_backward.args import (
    ConvolutionBackwardArgs,
    empty_like_native,
    native_backend,
    output_memory_format,
)

__all__ = ["ForwardConvolutionBackward", "delegating", "from_forward_convolutions", "wrong_grad_weight", "wrong_strides"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_EMPTY_BACKENDS = frozenset({torch._C._ConvBackend.Empty, torch._C._ConvBackend.MkldnnEmpty})


def delegating(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
               output_padding, groups, output_mask):
    """The original kernel of ``grad_output``'s device, with ``None`` for masked-out outputs."""
    outputs = aten_override.original_kernel(grad_output.device.type)(
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
        output_padding, groups, output_mask,
    )
    return tuple(t if wanted else None for t, wanted in zip(outputs, output_mask))


def pass_through(*aten_args):
    """What users write first: the op itself (served by the original kernel inside this call).
    Under ``enable(pass_through)`` it works, frozen weights included (a ``grad_weight`` the original
    kernel's oneDNN path returns where ``output_mask[1]`` is False is dropped with a warning); the
    test bed fails it for exactly that output, which a backend should not return."""
    return torch.ops.aten.convolution_backward.default(*aten_args)


class ForwardConvolutionBackward:
    r"""``aten::convolution_backward`` from forward convolutions: a correct backend that shares no
    code with the original kernel's backward and sums in another order than oneDNN's.

    - ``grad_input``: of a regular convolution, ``conv_transpose{1,2,3}d(grad_output, weight)``
      with the ``output_padding`` that gives back ``spatial_in``; of a transposed one,
      ``conv{1,2,3}d(grad_output, weight)``, cut to ``spatial_in`` (``output_padding >= stride``
      leaves extra rows);
    - ``grad_weight``: a forward convolution of ``input`` by ``grad_output`` with ``stride`` and
      ``dilation`` exchanged (:meth:`weight_contraction`), cut to ``kernel``; transposed: the roles
      of ``input`` and ``grad_output`` swapped;
    - ``grad_bias``: ``grad_output`` summed over every dim but 1, shaped ``(C_out,)`` by
      ``grad_output`` as upstream (pytorch#119407).

    float16 / bfloat16 are computed in float32 and rounded once. Outputs have upstream's strides
    (:func:`~aten_override.ops.convolution_backward.args.output_memory_format`,
    :func:`~aten_override.ops.convolution_backward.args.empty_like_native`, filled by ``copy_``);
    masked-out outputs are ``None``; upstream's ``Empty`` backend (a zero batch or zero channels)
    gives zeros.

    Args: the aten signature (module docstring), float64 / float32 / bfloat16 / float16, 1-3
        spatial dims, assumed valid (:class:`aten_override.FunctionBackend` checks them first).

    Returns:
        ``(grad_input (N, C_in, *spatial_in), grad_weight like weight, grad_bias (C_out,))`` in the
        inputs' dtype, ``None`` where ``output_mask`` is False.

    Raises:
        RuntimeError: from the forward convolutions, on arguments no valid call has.

    Each step is a method, so :mod:`aten_override.testing.mutants` can break one at a time.
    """

    def __call__(self, grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                 output_padding, groups, output_mask):
        a = ConvolutionBackwardArgs(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                                    output_padding, groups, output_mask).expanded()
        backend = native_backend(a)
        if self.is_empty(a, backend):
            return self.empty_outputs(a)
        dtype = grad_output.dtype
        fmt = self.memory_format(a, backend)
        go, x, w = self.operands(a)
        gi = gw = gb = None
        if a.output_mask[0]:
            gi = empty_like_native(a.input, fmt, backend, dtype, is_input=True).copy_(self.grad_input(a, go, w))
        if a.output_mask[1]:
            gw = empty_like_native(a.weight, fmt, backend, dtype).copy_(self.grad_weight(a, go, x))
        if a.output_mask[2]:
            gb = self.grad_bias(a, go).to(dtype)
        return gi, gw, gb

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """float32 for float16 / bfloat16, else ``dtype``."""
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def operands(self, a: ConvolutionBackwardArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``grad_output``, ``input`` and ``weight`` in :meth:`compute_dtype`, strides as they come."""
        return tuple(t.to(self.compute_dtype(t.dtype)) for t in (a.grad_output, a.input, a.weight))

    def is_empty(self, a: ConvolutionBackwardArgs, backend: torch._C._ConvBackend) -> bool:
        """Whether upstream serves the call with its ``Empty`` backend (nothing to sum)."""
        return backend in _EMPTY_BACKENDS

    def empty_outputs(self, a: ConvolutionBackwardArgs) -> tuple[torch.Tensor | None, ...]:
        """Upstream's ``Empty`` backend: :meth:`zeros_like` ``input`` and ``weight``, and
        ``zeros(bias_sizes)`` (``(C_out,)`` for ``bias_sizes=None``, where upstream aborts)."""
        sizes = list(a.bias_sizes) if a.bias_sizes is not None else [a.grad_output.size(1)]
        likes = (a.input, a.weight, a.weight.new_empty(sizes))
        return tuple(self.zeros_like(t) if wanted else None for t, wanted in zip(likes, a.output_mask))

    def zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        """The empty path's outputs: ``torch.zeros_like`` (``t``'s strides)."""
        return torch.zeros_like(t)

    def memory_format(self, a: ConvolutionBackwardArgs, backend: torch._C._ConvBackend) -> torch.memory_format:
        """Upstream's: suggested by ``input`` and ``weight``, never ``grad_output``."""
        return output_memory_format(a, backend)

    def grad_input(self, a: ConvolutionBackwardArgs, go: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``(N, C_in, *spatial_in)`` in the compute dtype, any strides."""
        spatial_in = a.input.shape[2:]
        if a.transposed:
            gi = _CONV[a.spatial_dims](go, w, None, a.stride, a.padding, a.dilation, a.groups)
            return _crop(gi, spatial_in)
        # The rows the stride dropped in the forward come back as output_padding.
        output_padding = [
            i - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
            for i, o, k, s, p, d in zip(spatial_in, go.shape[2:], w.shape[2:], a.stride, a.padding, a.dilation)
        ]
        return _CONV_TRANSPOSE[a.spatial_dims](go, w, None, a.stride, a.padding, output_padding, a.groups, a.dilation)

    def grad_weight(self, a: ConvolutionBackwardArgs, go: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``weight``-shaped, in the compute dtype: :meth:`weight_contraction` cut to ``kernel``
        (its output may be longer: taps the stride never reaches)."""
        if a.transposed:  # y = conv_transpose(x, w) is x = conv(y, w) read backwards: the roles swap
            go, x = x, go
        return _crop(self.weight_contraction(x, go, a.stride, a.padding, a.dilation, a.groups), a.weight.shape[2:])

    def weight_contraction(self, x, go, stride, padding, dilation, groups) -> torch.Tensor:
        r"""``out[g*O + o, c, k] = sum_{n, y} go[n, g*O + o, y] * x_pad[n, g*C + c, y*stride + k*dilation]``.

        ``x``: ``(N, G*C, *spatial_x)``, ``go``: ``(N, G*O, *spatial_y)``; returns ``(G*O, C, *k')``
        with ``k' >= kernel``. A forward convolution in which a group's channels are the batch and
        its samples are the channels: ``x`` as ``(C, G*N, *spatial_x)`` by ``go`` as the weight
        ``(G*O, N, *spatial_y)``, ``groups=G``, with ``stride`` and ``dilation`` exchanged.
        """
        g = groups
        c, o = x.size(1) // g, go.size(1) // g
        spatial = list(range(3, x.dim() + 1))
        xs = x.unflatten(1, (g, c)).permute(2, 1, 0, *spatial).flatten(1, 2)
        gos = go.unflatten(1, (g, o)).permute(1, 2, 0, *spatial).flatten(0, 1)
        return _CONV[x.dim() - 2](xs, gos, None, dilation, padding, stride, g).transpose(0, 1)

    def grad_bias(self, a: ConvolutionBackwardArgs, go: torch.Tensor) -> torch.Tensor:
        """``(C_out,)`` in the compute dtype: ``grad_output`` summed over the batch and space."""
        return go.sum([0, *range(2, go.dim())])


def _crop(t: torch.Tensor, spatial) -> torch.Tensor:
    """``t``'s leading ``spatial`` positions in every spatial dim (a view)."""
    return t[(slice(None), slice(None), *(slice(0, n) for n in spatial))]


from_forward_convolutions = ForwardConvolutionBackward()
"""The :class:`ForwardConvolutionBackward` backend
(``--backend aten_override.testing.example_backends:from_forward_convolutions``)."""


def wrong_grad_weight(*args):
    """:func:`delegating` with ``grad_weight`` 1 % too large (the size of a dropped summand)."""
    grad_input, grad_weight, grad_bias = delegating(*args)
    return grad_input, None if grad_weight is None else grad_weight * 1.01, grad_bias


def wrong_strides(*args):
    """:func:`delegating` with every output made contiguous: right values, but channels_last
    inputs get contiguous gradients (``torch.library.opcheck`` does not notice this)."""
    return tuple(None if t is None else t.contiguous() for t in delegating(*args))
