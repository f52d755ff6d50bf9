r"""What makes ``torch.compile``d code bypass the :func:`aten_override.enable` override, and a check.

The override is a kernel registered at the dispatcher for the CPU and CUDA dispatch keys, so it
serves every call that *goes through the dispatcher* at run time:

- eager autograd, ``torch.func`` / ``vmap`` (the batch rule calls the op again with
  ``groups = batch``), ``torch.utils.checkpoint``, DDP;
- ``torch.compile`` with ``aot_eager`` and with ``inductor``'s default Python wrapper: Inductor's
  ``convolution_backward`` lowering falls back to ``torch.ops.aten.convolution_backward`` at run
  time;
- while :func:`~aten_override.enable` is active (``compiled_graphs=True``, the default), every graph
  Inductor compiles whose code would skip the dispatcher (``cpp_wrapper``, AOTInductor, Triton
  conv-backward templates allowed) calls ``aten_override::convolution_backward`` instead
  (:mod:`aten_override.compiled_graphs`), a custom op that redispatches to aten's op: so those
  reach the override too.

Bypassed where the generated code calls ATen's C++ entry points directly, i.e. only for graphs
compiled *without* that pass (``enable(..., compiled_graphs=False)``,
``ATEN_OVERRIDE_COMPILED_GRAPHS=0``, or compiled before ``enable`` was entered):

- ``torch._inductor.config.cpp_wrapper = True`` and AOTInductor: the C shim calls
  ``at::compositeexplicitautograd::convolution_backward_symint`` (CPU) or ``at::cuda::…`` (CUDA)
  statically, skipping the dispatcher (torchgen/gen_aoti_c_shim.py).
- Inductor's Triton convolution-backward templates (``max_autotune`` with ``TRITON`` in
  ``max_autotune_conv_bwd_{input,weight}_backends``, CUDA/ROCm): no ATen call at all.

:func:`bypass_reasons` reports which of these settings are on while the pass is off, so a caller
can warn before compiling; nothing here changes any setting or touches the dispatcher.
"""

from __future__ import annotations

import sys

__all__ = ["bypass_reasons"]


def bypass_reasons() -> list[str]:
    """The current ``torch._inductor.config`` settings under which Inductor-compiled code would not
    call our kernel, as readable sentences (empty when compiled code goes through the dispatcher,
    as it always does while :mod:`aten_override.compiled_graphs` is active).

    Inductor's config is only read if ``torch._inductor`` is already imported: importing it here
    would cost seconds and nobody can have changed a setting of a module never imported.
    """
    from . import compiled_graphs

    if compiled_graphs.is_active():
        return []
    config = getattr(sys.modules.get("torch._inductor"), "config", None)
    if config is None:
        return []
    off = ", unless compiled under aten_override.enable(compiled_graphs=True) (the default)"
    reasons = []
    if getattr(config, "cpp_wrapper", False):
        reasons.append(
            "torch._inductor.config.cpp_wrapper is on: compiled code calls ATen's convolution_backward "
            "statically and bypasses the override" + off
        )
    if getattr(config, "aot_inductor", None) is not None and getattr(config.aot_inductor, "output_path", ""):
        reasons.append("AOTInductor output is configured: AOT-compiled code calls ATen statically" + off)
    triton = any(
        "TRITON" in str(getattr(config, name, "")).upper()
        for name in ("max_autotune_conv_bwd_input_backends", "max_autotune_conv_bwd_weight_backends")
    )
    if getattr(config, "max_autotune", False) and triton:
        reasons.append(
            "max_autotune with TRITON conv-backward backends: Inductor may generate its own convolution "
            "backward (GPU)" + off
        )
    return reasons
