r"""Every skip of the shipped suite, declared once with its reason.

Tests call ``self.skipTest(SKIPS[...])`` (or use the ``unittest.skip`` decorators below); the
runner's summary groups skipped tests by these reasons.
"""

from __future__ import annotations

__all__ = ["SKIPS", "native_crash_reason"]

SKIPS: dict[str, str] = {
    "channels_last_1d": "channels_last applies to 2-D and 3-D convolutions only",
    "native_unchecked": "the original kernel does not validate this input: {gap}",
    "all_fallback": "backend {backend!r} handed every call to the original kernel: {reasons}",
    "no_cuda": "no CUDA device in this process",
}


def native_crash_reason(*, device_type: str, dtype, transposed: bool, spatial_dims: int, output_mask,
                        padding, dilation) -> str | None:
    """Why the original kernel would crash the process on this call, or ``None``.

    Found by the fuzzer (torch 2.13.0+cpu, x86): the CPU kernel segfaults computing ``grad_input``
    of a float16 / bfloat16 3-D transposed convolution with dilation > 1 and padding > 0, e.g.
    ``input (1, 3, 3, 3, 2) f16, weight (3, 2, 1, 3, 1), stride 2, padding [1, 1, 1],
    dilation [2, 2, 2], output_mask [True, False, False]``. A crash cannot be compared against, so
    the fuzzer does not draw these calls.
    """
    import torch

    if (
        device_type == "cpu"
        and dtype in (torch.float16, torch.bfloat16)
        and transposed
        and spatial_dims == 3
        and output_mask[0]
        and any(d > 1 for d in dilation)
        and any(p > 0 for p in padding)
    ):
        return "the original CPU kernel segfaults on grad_input of reduced-precision 3-D transposed convolutions with dilation > 1 and padding > 0 (torch 2.13)"
    return None
