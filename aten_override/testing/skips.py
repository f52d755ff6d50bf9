r"""Every skip of the shipped suite, declared once with its reason.

Tests call ``self.skipTest(SKIPS[...])`` (or use the ``unittest.skip`` decorators below); the
runner's summary groups skipped tests by these reasons.
"""

from __future__ import annotations

from ..ops.convolution_backward.args import dead_taps, depth_without_full_row, width_one_transposed

__all__ = ["SKIPS", "dead_taps", "native_defect_reason", "width_one_transposed"]

SKIPS: dict[str, str] = {
    "channels_last_1d": "channels_last applies to 2-D and 3-D convolutions only",
    "native_unchecked": "the original kernel does not validate this input: {gap}",
    "all_fallback": "backend {backend!r} handed every call to the original kernel: {reasons}",
    "no_cuda": "no CUDA device in this process",
}


def native_defect_reason(*, device_type: str, dtype, transposed: bool, input_size, grad_output_size, kernel,
                         stride, padding, dilation) -> str | None:
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
    corrupted heap has aborted a test process after one. A crash or garbage cannot be compared against, so the fuzzer draws these calls in
    float32, or float64 where float32 is affected too.
    """
    import torch

    if device_type != "cpu" or dtype == torch.float64:
        return None
    if depth_without_full_row(transposed=transposed, input_size=input_size, grad_output_size=grad_output_size,
                              kernel=kernel, stride=stride, padding=padding, dilation=dilation):
        return ("the original CPU kernel computes wrong gradients, hangs or corrupts the heap on 3-D layers with "
                "padding > stride in depth and no row there meeting the whole kernel (oneDNN, torch 2.13)")
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
    return None
