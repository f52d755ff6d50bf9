r"""Pure-PyTorch ``aten::convolution_backward``: the readable reference backend.

Mirrors the contract of ``at::native::convolution_backward`` in
aten/src/ATen/native/Convolution.cpp, built from other ATen ops and never re-entering
``convolution_backward``:

- ``grad_input`` of a regular convolution is the transposed convolution of ``grad_output`` with
  ``weight`` (``output_padding`` chosen so the size is exactly ``spatial_in``), or with stride 1,
  where upstream would run that transposed convolution on the slow THNN path, the equivalent
  regular convolution with the flipped kernel; of a transposed convolution, the regular
  convolution of ``grad_output`` with ``weight``, cut to ``spatial_in``.
- ``grad_weight`` is a contraction of ``grad_output`` with windows of the zero-padded input,
  formulated per layer class: a depthwise convolution of ``input`` by ``grad_output`` (one channel
  per group, 2-D/3-D); an N-d im2col (an ``as_strided`` view) and a batched GEMM (few input
  channels per tap); otherwise one GEMM per kernel tap on shifted windows of the input's stride
  phases (kn2row, no im2col). A transposed convolution's weight gradient is the same contraction
  with the roles of ``input`` and ``grad_output`` swapped.
- ``grad_bias`` is ``grad_output`` summed over every dim but 1, shaped by ``grad_output`` (not by
  ``bias_sizes``, as upstream, pytorch#119407).

float16 / bfloat16 are accumulated in float32 and rounded once: in float32 ops, or for bfloat16 on
CPUs with oneDNN bfloat16 support in bfloat16 convolutions and GEMMs that accumulate in float32
(where each output element is one such op's result). Outputs get upstream's exact
strides (:func:`args.output_memory_format`); masked-out outputs are ``None`` and not computed.
"""

from __future__ import annotations

import itertools
import math

import torch

from .args import (
    ConvolutionBackwardArgs,
    FLOATING_DTYPES,
    canonical_call,
    check_args,
    is_empty_call,
    needs_weight_or_input,
    onednn_defect,
    empty_like_native,
    native_backend,
    output_memory_format,
)

__all__ = ["convolution_backward", "unsupported_reason", "NAME"]

NAME = "python"

# Elements of one im2col chunk (float32: 256 MiB), grad_weight's workspace: the chunk's view is
# copied once, into (G, N*Y, C*K).
_IM2COL_CHUNK_ELEMENTS = 1 << 26

# oneDNN's convolution backends; 2.13's torch._C._ConvBackend has no member for 9 (MkldnnTranspose).
_ONEDNN = frozenset({int(torch._C._ConvBackend.Mkldnn), 9})
_SLOW_TRANSPOSED = frozenset(
    int(b) for b in (torch._C._ConvBackend.SlowTranspose2d, torch._C._ConvBackend.SlowTranspose3d)
)


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


def _bf16_on_onednn(t: torch.Tensor, a: ConvolutionBackwardArgs) -> bool:
    """Whether bfloat16 work on ``t``'s device may run in bfloat16: oneDNN's convolutions and GEMMs
    accumulate bfloat16 products in float32 and round once, as the native kernel does. Not where
    torch 2.13's oneDNN convolutions are known wrong (:func:`.args.onednn_defect`: a kernel tap only
    meets padding, or a transposed layer of width 1): they segfault or read uninitialised memory there."""
    return (
        t.dtype == torch.bfloat16
        and t.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and not onednn_defect(a)
    )


def grad_input(a: ConvolutionBackwardArgs, go: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(N, C_in, *spatial_in)``, any layout: in the compute dtype, or bfloat16 when the
    convolution it takes runs on oneDNN (float32 accumulation, one rounding: the native numerics).
    ``go`` and ``w`` in the input dtype."""
    spatial_in = a.input.shape[2:]
    dims = a.spatial_dims
    if not a.transposed:
        # Transposed conv of grad_output; output_padding makes up for the rows the stride dropped.
        out_pad = [
            i - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
            for i, o, k, s, p, d in zip(
                spatial_in, go.shape[2:], w.shape[2:], a.stride, a.padding, a.dilation
            )
        ]
        params = (a.stride, a.padding, a.dilation, True, out_pad, a.groups)
        backend = int(torch._C._select_conv_backend(go, w, None, *params, None))
        full_padding = [d * (k - 1) - p for k, p, d in zip(w.shape[2:], a.padding, a.dilation)]
        if backend in _SLOW_TRANSPOSED and all(s == 1 for s in a.stride) and min(full_padding) >= 0:
            # With stride 1 it is also a regular convolution (cheaper than the THNN transposed
            # path): grad_output correlated, fully padded, with the flipped kernel, C_in and C_out
            # swapped within each group.
            g = a.groups
            w = w.unflatten(0, (g, -1)).transpose(1, 2).flatten(0, 1).flip(list(range(2, 2 + dims)))
            params = ([1] * dims, full_padding, a.dilation, False, [0] * dims, g)
            backend = int(torch._C._select_conv_backend(go, w, None, *params, None))
    else:
        params = (a.stride, a.padding, a.dilation, False, [0] * dims, a.groups)
        backend = int(torch._C._select_conv_backend(go, w, None, *params, None))
    if not (backend in _ONEDNN and _bf16_on_onednn(go, a)):
        cdtype = _compute_dtype(go.dtype)
        go, w = go.to(cdtype), w.to(cdtype)
    gi = _conv(go, w, *params)
    # Transposed: output_padding >= stride (allowed when dilation > output_padding) leaves extra rows.
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
    reduced_gemm: bool,
) -> torch.Tensor:
    r"""``out[g, o, c, *kernel] = sum_{n, y} go[n, g*O+o, y] * x_pad[n, g*C+c, y*stride + kernel*dilation]``.

    ``x``: ``(N, G*C, *spatial_x)``; ``go``: ``(N, G*O, *spatial_y)``, both in the input dtype.
    Returns ``(G*O, C, *kernel)`` in the compute dtype (float32 for float16/bfloat16), by the
    formulation that suits the layer:

    - pointwise (kernel 1, stride 1, no padding; not float16/bfloat16): a GEMM per sample, no copies;
    - depthwise (``C == O == 1``, 2-D/3-D): one depthwise convolution (:func:`_depthwise_weight_grad`;
      not 1-D, where its kernel, as long as the sequence, is slow on oneDNN);
    - few input channels per tap (im2col smaller than ``kernel`` passes over ``grad_output``):
      im2col + one batched GEMM (:func:`_im2col_weight_grad`);
    - otherwise one GEMM per kernel tap on shifted windows (:func:`_shifted_window_weight_grad`), in
      the input dtype when ``reduced_gemm`` and one group (each output element is one GEMM's float32
      sum, rounded once).
    """
    n, gc = x.shape[:2]
    c, o = gc // groups, go.size(1) // groups
    cdtype = _compute_dtype(go.dtype)
    if n == 0 or c == 0 or o == 0:
        return torch.zeros(groups * o, c, *kernel, dtype=cdtype, device=go.device)
    kk = math.prod(kernel)
    if kk == 1 and set(stride) == {1} and not any(padding) and go.dtype == cdtype:
        # Pointwise: one GEMM per sample on grad_output and input as they are (views in either
        # memory format), accumulated over the batch. x may be longer than go: a transposed
        # convolution's output_padding rows (x here) meet no input; cut them.
        for dim, size in enumerate(go.shape[2:], start=2):
            x = x.narrow(dim, 0, size)
        out = torch.zeros(groups, o, c, dtype=cdtype, device=go.device)
        for i in range(n):
            out.baddbmm_(go[i].reshape(groups, o, -1), x[i].reshape(groups, c, -1).transpose(1, 2))
        return out.view(groups * o, c, *kernel)
    if c == 1 and o == 1 and len(kernel) > 1:
        return _depthwise_weight_grad(x.to(cdtype), go.to(cdtype), kernel, stride, padding, dilation)
    # Memory passes per output point: im2col writes, permutes and reads C*K columns and reads O once;
    # the shifted windows read O + C once per tap.
    if 3 * c * kk + o < kk * (o + c):
        return _im2col_weight_grad(x.to(cdtype), go.to(cdtype), kernel, stride, padding, dilation, groups)
    # bfloat16 only for one group: torch.mm takes the strided windows as they are, where a bfloat16
    # torch.bmm would copy both operands for every tap.
    dtype = go.dtype if reduced_gemm and groups == 1 else cdtype
    out = _shifted_window_weight_grad(x, go, kernel, stride, padding, dilation, groups, dtype)
    return out.to(cdtype)


def _depthwise_weight_grad(x, go, kernel, stride, padding, dilation) -> torch.Tensor:
    r"""``C == O == 1`` per group: ``out[g, 0, *kernel] = sum_n (x_pad[n, g] ⋆ go[n, g])[kernel]``.

    The weight gradient of a convolution is itself a convolution of ``input`` by ``grad_output``,
    with stride and dilation exchanged. With one channel per group it is a depthwise convolution
    with one group per (sample, channel): ``x`` as ``(1, N*G, *spatial_x)``, ``go`` as the weight
    ``(N*G, 1, *spatial_y)`` (both views), summed over the batch afterwards. Its output can be
    longer than ``kernel`` (rows the stride never reaches): those are cut.
    """
    n, channels = x.shape[:2]
    out = _conv(
        x.reshape(1, n * channels, *x.shape[2:]), go.reshape(n * channels, 1, *go.shape[2:]),
        dilation, padding, stride, False, [0] * len(kernel), n * channels,
    )
    for dim, k in enumerate(kernel, start=2):
        out = out.narrow(dim, 0, k)
    return out.view(n, channels, 1, *kernel).sum(0)


def _im2col_weight_grad(x, go, kernel, stride, padding, dilation, groups) -> torch.Tensor:
    """An N-d im2col (an ``as_strided`` view of the zero-padded input) contracted with
    ``grad_output`` by a batched GEMM over groups, a bounded batch chunk at a time."""
    n, gc = x.shape[:2]
    c, o = gc // groups, go.size(1) // groups
    spatial_y = list(go.shape[2:])
    kk, yy = math.prod(kernel), math.prod(spatial_y)
    out = torch.zeros(groups, o, c * kk, dtype=go.dtype, device=go.device)
    pads = []
    for p in reversed(padding):
        pads += [p, p]
    xp = torch.nn.functional.pad(x, pads) if any(padding) else x
    sn, sc, *ss = xp.stride()
    chunk = max(1, min(n, _IM2COL_CHUNK_ELEMENTS // (gc * kk * yy)))
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        cols = xp.as_strided(
            [m, groups, c, *kernel, *spatial_y],
            [sn, c * sc, sc, *(d * s for d, s in zip(dilation, ss)), *(st * s for st, s in zip(stride, ss))],
            xp.storage_offset() + start * sn,
        )
        # (G, N*Y, C*K), one copy, and (G, O, N*Y): one batched GEMM over groups.
        dims = len(kernel)
        order = [1, 0, *range(3 + dims, 3 + 2 * dims), 2, *range(3, 3 + dims)]
        cols = cols.permute(order).reshape(groups, m * yy, c * kk)
        g = go.narrow(0, start, m).reshape(m, groups, o, yy).permute(1, 2, 0, 3).reshape(groups, o, m * yy)
        out.baddbmm_(g, cols)
    return out.view(groups * o, c, *kernel)


def _shifted_window_weight_grad(x, go, kernel, stride, padding, dilation, groups, dtype) -> torch.Tensor:
    r"""One batched GEMM over groups per kernel tap (kn2row), with no im2col.

    Tap ``k`` reads ``x_pad`` at ``y*stride + k*dilation = (y + k*dilation // stride)*stride +
    k*dilation % stride``: in the phase ``r = k*dilation % stride`` of ``x_pad`` (its points
    ``r, r + stride, ...``) it is ``grad_output`` shifted by ``k*dilation // stride``. Every phase and
    ``grad_output`` are laid out on one frame of ``q = spatial_y + largest shift`` points per dim,
    ``grad_output`` zero beyond ``spatial_y``; flattened over ``(N, *q)`` each shift is a contiguous
    window, and ``out[:, :, :, k] = go_frame @ window_k^T`` with ``(G, O, L) @ (G, L, C)``. The frame
    points a window wraps onto meet the zeros of ``go_frame``. Works in ``dtype``; copies ``x`` and
    ``grad_output`` once each (into ``dtype``), with no padded intermediate.
    """
    n, gc = x.shape[:2]
    c, o = gc // groups, go.size(1) // groups
    dims = len(kernel)
    spatial_y = list(go.shape[2:])
    shifts = [[i * d // s for i in range(k)] for k, s, d in zip(kernel, stride, dilation)]
    q = [y + sh[-1] for y, sh in zip(spatial_y, shifts)]
    frame = n * math.prod(q)
    # The phases of x_pad on the frame, (s1, s2, ..., G, C, N, q1, q2, ...), filled phase by phase:
    # along a dim, frame point j of phase r is x[j*s + r - p], zero where that is padding or beyond x.
    # (Zeroing only those slabs: every page of these big buffers is touched once.)
    phases = torch.empty(*stride, groups, c, n, *q, dtype=dtype, device=x.device)
    x_gcn = x.unflatten(1, (groups, c)).permute(1, 2, 0, *range(3, 3 + dims))
    for phase in itertools.product(*(range(s) for s in stride)):
        dst, src = [slice(None)] * 3, [slice(None)] * 3
        for dim, (r, s, p, qq, size) in enumerate(zip(phase, stride, padding, q, x.shape[2:]), start=3):
            first = min(qq, max(0, -((r - p) // s)))  # the first frame point that is not padding
            start = first * s + r - p
            count = max(0, min(qq - first, -((start - size) // s)))
            phases[phase].narrow(dim, 0, first).zero_()
            phases[phase].narrow(dim, first + count, qq - first - count).zero_()
            dst.append(slice(first, first + count))
            src.append(slice(start, start + (count - 1) * s + 1, s))
        if all(d.stop > d.start for d in dst[3:]):
            phases[phase][tuple(dst)].copy_(x_gcn[tuple(src)])
    phases = phases.view(*stride, groups, c, frame)
    # grad_output on the frame, (G, O, N, q1, q2, ...), zero beyond spatial_y.
    go_frame = torch.empty(groups, o, n, *q, dtype=dtype, device=go.device)
    for dim, (y, qq) in enumerate(zip(spatial_y, q), start=3):
        go_frame.narrow(dim, y, qq - y).zero_()
    go_frame[(..., *(slice(0, y) for y in spatial_y))].copy_(
        go.unflatten(1, (groups, o)).permute(1, 2, 0, *range(3, 3 + dims))
    )
    go_frame = go_frame.view(groups, o, frame)
    # Flat offset of a shift; the longest window that stays inside the frame for every tap.
    frame_strides = [math.prod(q[i + 1 :]) for i in range(dims)]
    length = frame - sum(sh[-1] * fs for sh, fs in zip(shifts, frame_strides))
    go_frame = go_frame.narrow(2, 0, length)
    taps = list(itertools.product(*(range(k) for k in kernel)))
    out = torch.empty(len(taps), groups, o, c, dtype=dtype, device=go.device)
    for t, tap in enumerate(taps):
        phase = tuple(i * d % s for i, s, d in zip(tap, stride, dilation))
        offset = sum(sh[i] * fs for sh, i, fs in zip(shifts, tap, frame_strides))
        window = phases[phase].narrow(2, offset, length)
        if groups == 1:
            torch.mm(go_frame[0], window[0].t(), out=out[t, 0])
        else:
            torch.bmm(go_frame, window.transpose(1, 2), out=out[t])
    return out.permute(1, 2, 3, 0).reshape(groups * o, c, *kernel)


def grad_weight(a: ConvolutionBackwardArgs, go: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight``-shaped, in the compute dtype; ``go`` and ``x`` in the input dtype."""
    kernel = list(a.weight.shape[2:])
    if a.transposed:
        # y = conv_transpose(x, w): the roles of input and grad_output swap; (C_in, C_out/G, *k) falls out.
        go, x = x, go
    return _weight_contraction(
        x, go, kernel, a.stride, a.padding, a.dilation, a.groups, reduced_gemm=_bf16_on_onednn(go, a)
    )


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
    if is_empty_call(a):
        return _empty_backward(a)
    mask = a.output_mask
    dtype = a.grad_output.dtype
    if not needs_weight_or_input(a):
        return None, None, _grad_bias(a.grad_output, _compute_dtype(dtype)) if mask[2] else None
    backend = native_backend(a)
    fmt = output_memory_format(a, backend)
    if a.grad_output.numel() == 0:  # a transposed layer with an empty output: nothing flows back
        return (
            empty_like_native(a.input, fmt, backend, dtype, is_input=True).zero_() if mask[0] else None,
            empty_like_native(a.weight, fmt, backend, dtype).zero_() if mask[1] else None,
            torch.zeros(a.c_out, dtype=dtype, device=a.grad_output.device) if mask[2] else None,
        )
    # computed on size-1 strides upstream's kernels read right; laid out as upstream lays out `a`'s
    c = canonical_call(a)
    gi = gw = gb = None
    if mask[0]:
        gi = empty_like_native(a.input, fmt, backend, dtype, is_input=True)
        gi = _into(gi, grad_input(c, c.grad_output, c.weight), a)
    if mask[1]:
        gw = _into(empty_like_native(a.weight, fmt, backend, dtype), grad_weight(c, c.grad_output, c.input), a)
    if mask[2]:
        gb = _grad_bias(a.grad_output, _compute_dtype(dtype))
    return gi, gw, gb


def _into(out: torch.Tensor, result: torch.Tensor, a: ConvolutionBackwardArgs) -> torch.Tensor:
    """``result`` itself when it already is what ``out`` would be (dtype, shape, strides, a
    storage of its own that no argument shares), else ``out`` filled with it."""
    inputs = (a.grad_output, a.input, a.weight)
    if (
        all(result.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in inputs)
        and result.dtype == out.dtype
        and result.shape == out.shape
        and result.stride() == out.stride()
        and result.storage_offset() == 0
        and result.untyped_storage().nbytes() == out.untyped_storage().nbytes()
    ):
        return result
    return out.copy_(result)


def _grad_bias(grad_output: torch.Tensor, cdtype: torch.dtype) -> torch.Tensor:
    dims = [0, *range(2, grad_output.dim())]
    return grad_output.sum(dims, dtype=cdtype).to(grad_output.dtype)


def _empty_backward(a: ConvolutionBackwardArgs) -> tuple[torch.Tensor | None, ...]:
    """Upstream's ``ConvBackend::Empty`` (a zero batch or zero input channels): zeros shaped like
    ``input``, ``weight`` and ``bias_sizes``, whatever ``grad_output``'s sizes (the zero-channel
    forward drops the bias, so ``grad_output`` may have 0 channels where ``bias_sizes`` is
    ``[C_out]``). 1-D calls are computed on ``input.contiguous()`` / ``weight`` viewed as 2-D, as
    upstream's ``view4d`` does. With ``bias_sizes=None`` upstream aborts the process (it
    dereferences the empty optional); here ``grad_bias`` is ``zeros(C_out)``, ``C_out`` from
    ``weight`` as for any call.
    """
    mask = a.output_mask
    one_d = a.weight.dim() == 3

    def zeros_like(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t.unsqueeze(2)).squeeze(2) if one_d else torch.zeros_like(t)

    gi = zeros_like(a.input.contiguous() if one_d else a.input) if mask[0] else None
    gw = zeros_like(a.weight) if mask[1] else None
    gb = None
    if mask[2]:
        sizes = list(a.bias_sizes) if a.bias_sizes is not None else [a.c_out]
        gb = torch.zeros(sizes, dtype=a.weight.dtype, device=a.weight.device)
    return gi, gw, gb
