r"""User backends in the form ``python -m aten_override test --backend module:function`` takes.

A backend is a function with the aten signature::

    fn(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
       output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)

``grad_output``: ``(N, C_out, *spatial_out)``; ``input``: ``(N, C_in, *spatial_in)``; ``weight``:
``(C_out, C_in / groups, *kernel)`` (transposed: ``(C_in, C_out / groups, *kernel)``); outputs
shaped like ``input``, ``weight`` and ``(C_out,)``, ``None`` where ``output_mask`` is False.

- :func:`delegating`: correct: delegates to the original ATen kernel (a template to start from);
- :func:`wrong_grad_weight` and :func:`wrong_strides`: deliberately wrong, to show the suite
  fails them (``aten_override test --backend aten_override.testing.example_backends:wrong_strides``).
"""

from __future__ import annotations

import aten_override

__all__ = ["delegating", "wrong_grad_weight", "wrong_strides"]


def delegating(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
               output_padding, groups, output_mask):
    """The original kernel of ``grad_output``'s device, with ``None`` for masked-out outputs."""
    outputs = aten_override.original_kernel(grad_output.device.type)(
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
        output_padding, groups, output_mask,
    )
    return tuple(t if wanted else None for t, wanted in zip(outputs, output_mask))


def wrong_grad_weight(*args):
    """:func:`delegating` with ``grad_weight`` 1 % too large (the size of a dropped summand)."""
    grad_input, grad_weight, grad_bias = delegating(*args)
    return grad_input, None if grad_weight is None else grad_weight * 1.01, grad_bias


def wrong_strides(*args):
    """:func:`delegating` with every output made contiguous: right values, but channels_last
    inputs get contiguous gradients (``torch.library.opcheck`` does not notice this)."""
    return tuple(None if t is None else t.contiguous() for t in delegating(*args))
