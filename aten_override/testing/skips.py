r"""Every skip of the shipped suite, declared once with its reason.

Tests call ``self.skipTest(SKIPS[...])`` (or use the ``unittest.skip`` decorators below); the
runner's summary groups skipped tests by these reasons.
"""

from __future__ import annotations

# native_defect_reason lives with the predicates it combines (the tracer's verify uses it too)
from ..ops.convolution_backward.args import dead_taps, native_defect_reason, width_one_transposed

__all__ = ["SKIPS", "dead_taps", "native_defect_reason", "width_one_transposed"]

SKIPS: dict[str, str] = {
    "channels_last_1d": "channels_last applies to 2-D and 3-D convolutions only",
    "native_unchecked": "the original kernel does not validate this input: {gap}",
    "all_fallback": "backend {backend!r} handed every call to the original kernel: {reasons}",
    "no_cuda": "no CUDA device in this process",
}
