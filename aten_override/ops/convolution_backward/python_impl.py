r"""Pure-PyTorch ``aten::convolution_backward``: the readable reference backend.

Mirrors the contract of ``at::native::convolution_backward`` in
aten/src/ATen/native/Convolution.cpp, built from other ATen ops and never re-entering
``convolution_backward``:

- ``grad_input`` of a regular convolution is the transposed convolution of ``grad_output`` with
  ``weight`` (``output_padding`` chosen so the size is exactly ``spatial_in``); of a transposed
  convolution, the regular convolution of ``grad_output`` with ``weight``, cut to ``spatial_in``.
- ``grad_weight`` is an N-d im2col (an ``as_strided`` view of the zero-padded input) contracted
  with ``grad_output`` by a batched GEMM over groups, in bounded batch chunks. A transposed
  convolution's weight gradient is the same contraction with the roles of ``input`` and
  ``grad_output`` swapped.
- ``grad_bias`` is ``grad_output`` summed over every dim but 1, shaped by ``grad_output`` (not by
  ``bias_sizes``, as upstream, pytorch#119407).

float16 / bfloat16 are accumulated in float32 and rounded once. Outputs get upstream's exact
strides (:func:`args.output_memory_format`); masked-out outputs are ``None`` and not computed.
"""

from __future__ import annotations

import math

import torch

from .args import (
    ConvolutionBackwardArgs,
    FLOATING_DTYPES,
    check_args,
    empty_like_native,
    native_backend,
    output_memory_format,
)

__all__ = ["convolution_backward", "unsupported_reason", "NAME"]

NAME = "python"

# Elements of one im2col chunk (float32: 256 MiB). The chunk's view is copied once by reshape and
# once more by the permute into (G, N*Y, C*K), so grad_weight's workspace is about twice this.
_IM2COL_CHUNK_ELEMENTS = 1 << 26

_EMPTY_BACKENDS = {torch._C._ConvBackend.Empty, torch._C._ConvBackend.MkldnnEmpty}


def unsupported_reason(args: ConvolutionBackwardArgs) -> str | None:
    """Why this backend hands ``args`` to the original kernel, or ``None`` when it serves them."""
    dtype = args.grad_output.dtype
    if dtype not in FLOATING_DTYPES:
        return f"dtype {dtype} is not supported (only float64/float32/bfloat16/float16)"
    for name in ("grad_output", "input", "weight"):
        t = getattr(args, name)
        if t.layout != torch.strided:
            return f"{name} has layout {t.layout}; only strided tensors are supported"
    return None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    return torch.ops.aten.convolution.default(
        x, w, None, stride, padding, dilation, transposed, output_padding, groups
    )


def grad_input(a: ConvolutionBackwardArgs, go: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(N, C_in, *spatial_in)`` in the compute dtype, any layout."""
    spatial_in = a.input.shape[2:]
    if not a.transposed:
        # Transposed conv of grad_output; output_padding makes up for the rows the stride dropped.
        out_pad = [
            i - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
            for i, o, k, s, p, d in zip(
                spatial_in, go.shape[2:], w.shape[2:], a.stride, a.padding, a.dilation
            )
        ]
        return _conv(go, w, a.stride, a.padding, a.dilation, True, out_pad, a.groups)
    gi = _conv(go, w, a.stride, a.padding, a.dilation, False, [0] * a.spatial_dims, a.groups)
    # output_padding >= stride (allowed when dilation > output_padding) leaves extra rows: cut them.
    for dim, size in enumerate(spatial_in, start=2):
        if gi.size(dim) != size:
            gi = gi.narrow(dim, 0, size)
    return gi


def _weight_contraction(
    x: torch.Tensor,
    go: torch.Tensor,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    r"""``out[g, o, c, *kernel] = sum_{n, y} go[n, g*O+o, y] * x_pad[n, g*C+c, y*stride + kernel*dilation]``.

    ``x``: ``(N, G*C, *spatial_x)``; ``go``: ``(N, G*O, *spatial_y)``. Returns ``(G*O, C, *kernel)``
    in ``go``'s dtype. The im2col of ``x`` is materialised a batch chunk at a time.
    """
    n, gc = x.shape[:2]
    go_channels = go.size(1)
    c, o = gc // groups, go_channels // groups
    spatial_y = list(go.shape[2:])
    kk, yy = math.prod(kernel), math.prod(spatial_y)
    out = torch.zeros(groups, o, c * kk, dtype=go.dtype, device=go.device)
    if n == 0 or c == 0 or o == 0:
        return out.view(groups * o, c, *kernel)
    pads = []
    for p in reversed(padding):
        pads += [p, p]
    xp = torch.nn.functional.pad(x, pads) if any(padding) else x
    sn, sc, *ss = xp.stride()
    per_sample = gc * kk * yy
    chunk = max(1, min(n, _IM2COL_CHUNK_ELEMENTS // max(per_sample, 1)))
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        cols = xp.as_strided(
            [m, groups, c, *kernel, *spatial_y],
            [sn, c * sc, sc, *(d * s for d, s in zip(dilation, ss)), *(st * s for st, s in zip(stride, ss))],
            xp.storage_offset() + start * sn,
        )
        # (G, N*Y, C*K) and (G, O, N*Y): one batched GEMM over groups.
        cols = cols.reshape(m, groups, c * kk, yy).permute(1, 0, 3, 2).reshape(groups, m * yy, c * kk)
        g = go.narrow(0, start, m).reshape(m, groups, o, yy).permute(1, 2, 0, 3).reshape(groups, o, m * yy)
        out.baddbmm_(g, cols)
    return out.view(groups * o, c, *kernel)


def grad_weight(a: ConvolutionBackwardArgs, go: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight``-shaped, in the compute dtype."""
    kernel = list(a.weight.shape[2:])
    if not a.transposed:
        return _weight_contraction(x, go, kernel, a.stride, a.padding, a.dilation, a.groups)
    # y = conv_transpose(x, w): the roles of input and grad_output swap; (C_in, C_out/G, *k) falls out.
    return _weight_contraction(go, x, kernel, a.stride, a.padding, a.dilation, a.groups)


def convolution_backward(args: ConvolutionBackwardArgs) -> tuple[torch.Tensor | None, ...]:
    """``(grad_input, grad_weight, grad_bias)`` of one convolution; masked-out entries are ``None``.

    Args:
        args: ``grad_output (N, C_out, *spatial_out)``, ``input (N, C_in, *spatial_in)``,
            ``weight (C_out, C_in/groups, *kernel)`` (transposed: ``(C_in, C_out/groups, *kernel)``),
            float64/float32/bfloat16/float16, same dtype and device; ``input`` or ``weight`` may be a
            stride-0 placeholder when its gradient is not requested (``torch.nn.grad``).

    Returns:
        ``grad_input`` like ``input``, ``grad_weight`` like ``weight``, ``grad_bias`` of shape
        ``(C_out,)``; dtype of the inputs; strides as upstream's (channels_last(_3d) when
        ``input`` or ``weight`` suggests it).

    Raises:
        RuntimeError: ``convolution_backward[python]: …`` for invalid arguments (see
            :func:`args.check_args`).
    """
    a = check_args(args, NAME)
    mask = a.output_mask
    backend = native_backend(a)
    if backend in _EMPTY_BACKENDS:
        return _empty_backward(a)
    dtype = a.grad_output.dtype
    cdtype = _compute_dtype(dtype)
    go = a.grad_output.to(cdtype)
    fmt = output_memory_format(a, backend)
    gi = gw = gb = None
    if mask[0]:
        gi = empty_like_native(a.input, fmt, backend, dtype, is_input=True)
        gi.copy_(grad_input(a, go, a.weight.to(cdtype)))
    if mask[1]:
        gw = empty_like_native(a.weight, fmt, backend, dtype)
        gw.copy_(grad_weight(a, go, a.input.to(cdtype)))
    if mask[2]:
        gb = _grad_bias(a.grad_output, cdtype)
    return gi, gw, gb


def _grad_bias(grad_output: torch.Tensor, cdtype: torch.dtype) -> torch.Tensor:
    dims = [0, *range(2, grad_output.dim())]
    return grad_output.sum(dims, dtype=cdtype).to(grad_output.dtype)


def _empty_backward(a: ConvolutionBackwardArgs) -> tuple[torch.Tensor | None, ...]:
    """Upstream's ``ConvBackend::Empty`` (a zero batch or zero channels): zeros of the right shapes.

    ``grad_bias`` is ``zeros(bias_sizes)``; with ``bias_sizes=None`` upstream aborts the process
    (it dereferences the empty optional), here it is ``zeros(C_out)`` like a non-empty call.
    """
    mask = a.output_mask
    gi = torch.zeros_like(a.input) if mask[0] else None
    gw = torch.zeros_like(a.weight) if mask[1] else None
    gb = None
    if mask[2]:
        sizes = list(a.bias_sizes) if a.bias_sizes is not None else [a.grad_output.size(1)]
        gb = torch.zeros(sizes, dtype=a.weight.dtype, device=a.weight.device)
    return gi, gw, gb
