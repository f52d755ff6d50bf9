r"""Compiled graphs call ``aten::convolution_backward`` through the dispatcher, in every Inductor mode.

Inductor's default Python wrapper calls ``torch.ops.aten.convolution_backward`` at run time, which
reaches the override. Its C++ wrapper (``cpp_wrapper``) and AOTInductor instead call ATen's C shim,
``aoti_torch_cpu_convolution_backward`` → ``at::compositeexplicitautograd::convolution_backward_symint``,
statically (``torch/_inductor/ir.py`` ``FallbackKernel.codegen``: ``aten`` ops found in
``torchgen/aoti/fallback_ops.py`` get a direct C-shim call), so no dispatcher key is consulted.

Custom (non-``aten``) ops always go through the dispatcher: the C++ wrapper emits a boxed
``c10::Dispatcher::singleton().findSchemaOrThrow(...)`` call (``aoti_torch_call_dispatcher`` for
schemas StableIValue can carry) and AOTInductor calls its proxy executor
(``torch/_inductor/codegen/cpp_wrapper_cpu.py`` ``generate_fallback_kernel_with_runtime_lookup``).
So this module defines:

- ``aten_override::convolution_backward``: aten's schema, one ``CompositeExplicitAutograd`` kernel
  that calls ``torch.ops.aten.convolution_backward.default`` through the dispatcher (whichever
  override is active serves it; native when none), and a fake kernel that runs aten's own meta
  function, so Inductor predicts, and asserts, exactly the strides it would for aten's op. Tagged
  ``flexible_layout``: Inductor hands it its tensors as they are laid out (channels_last or odd
  strides under its CPU layout optimisation, a stride-0 ``grad_output`` from ``.sum()``) without
  the copies a stride constraint would add, where its lowering of aten's op would first have made
  2-D operands channels_last; every backend serves any strides, and its output strides are meta's.
- :data:`PASS`, an Inductor post-grad custom pass (``torch._inductor.config.post_grad_custom_post_pass``,
  a public hook with a cache key, ``torch/_inductor/custom_graph_pass.py``) that retargets every
  ``aten.convolution_backward.default`` node to that op in the graphs whose generated code would
  otherwise skip the dispatcher (:func:`bypassing_wrapper`: ``cpp_wrapper``, AOTInductor, Triton
  conv-backward templates). The default Python wrapper keeps aten's op, which it calls through the
  dispatcher: no Python hop per call there. Nothing inside Inductor is patched.

:func:`activate` / :func:`deactivate` (counted; called by :class:`aten_override.enable`) add and
remove the pass. A graph compiled while it is active keeps calling the custom op after
``enable`` exits: that call reaches native ATen then, so it is never served by a stale backend.
A graph compiled *before* ``enable`` calls aten's op: the Python wrapper still reaches the
override, the C++ wrapper and AOTInductor do not (:func:`aten_override.compile_bypass.bypass_reasons`).

``torch._inductor.config`` costs seconds to import, so it is not imported here: when it is not
yet imported, :func:`activate` waits for its import (an import hook on ``sys.meta_path``, removed
with the last :func:`deactivate`) and adds the pass then.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading

import torch
from torch.library import Library

__all__ = ["OP", "PASS", "activate", "deactivate", "bypassing_wrapper", "is_active", "decomposition_table",
           "op_calls", "reset_op_calls", "setting"]

OP = "aten_override::convolution_backward"
_CONFIG_MODULE = "torch._inductor.config"
ENV = "ATEN_OVERRIDE_COMPILED_GRAPHS"

_lib = Library("aten_override", "FRAGMENT")
_lib.define(
    "convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, "
    "SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, "
    "SymInt groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.flexible_layout,),
)


_calls_lock = threading.Lock()
_calls = 0


def _through_the_dispatcher(*aten_args):
    """Serve the call with whatever ``aten::convolution_backward`` kernel the dispatcher holds now."""
    global _calls
    with _calls_lock:
        _calls += 1
    return torch.ops.aten.convolution_backward.default(*aten_args)


def op_calls() -> int:
    """Calls of ``aten_override::convolution_backward`` since :func:`reset_op_calls` (each then
    served by whatever kernel ``aten::convolution_backward`` has: see :func:`aten_override.stats`)."""
    return _calls


def reset_op_calls() -> None:
    global _calls
    with _calls_lock:
        _calls = 0


_lib.impl("convolution_backward", _through_the_dispatcher, "CompositeExplicitAutograd")


@torch.library.register_fake(OP, lib=_lib)
def _fake(*aten_args):
    # The args are fake tensors: this runs aten's meta function (torch/_meta_registrations.py),
    # the one Inductor uses to predict aten.convolution_backward's output strides.
    return torch.ops.aten.convolution_backward.default(*aten_args)


def _op() -> torch._ops.OpOverload:
    return torch.ops.aten_override.convolution_backward.default


def decomposition_table() -> dict:
    """``{aten.convolution_backward.default: fn}`` mapping aten's op to ours, for
    ``ExportedProgram.run_decompositions`` or an ``aot_autograd(decompositions=...)`` backend (the
    way ``torch._native.registry.native_decomp_table()`` reaches compiled code)."""

    def convolution_backward(*args, **kwargs):
        return _op()(*args, **kwargs)

    return {torch.ops.aten.convolution_backward.default: convolution_backward}


# --- the Inductor pass ---------------------------------------------------------------------


def _retarget(graph: torch.fx.Graph) -> int:
    """Point every ``aten.convolution_backward.default`` node of ``graph`` at our op; returns how many."""
    aten_op, ours = torch.ops.aten.convolution_backward.default, _op()
    n = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten_op:
            node.target = ours
            n += 1
    return n


def bypassing_wrapper() -> str | None:
    """Why the graph Inductor is compiling now would skip the dispatcher for aten's op, or ``None``.

    Read inside the post-grad pass, where ``torch._inductor.config`` holds the compile's own
    settings (``torch.compile(options=...)`` are patched in; AOTInductor sets ``cpp_wrapper``):

    - ``cpp_wrapper`` (and so AOTInductor): aten ops with a C-shim entry are called statically;
    - max-autotune with ``TRITON`` among the conv-backward backends: Inductor's lowering may pick a
      Triton template (GPU) and call no ATen at all.

    Otherwise (the default Python wrapper, compiled autograd's graphs, CPU max-autotune) the graph
    keeps aten's op: its fallback calls ``torch.ops.aten.convolution_backward`` through the
    dispatcher anyway, with no Python hop and with Inductor's own input layouts.
    """
    from torch._inductor import config

    if config.cpp_wrapper:
        return "cpp_wrapper"
    backends = (config.max_autotune_conv_bwd_input_backends, config.max_autotune_conv_bwd_weight_backends)
    if config.max_autotune and any("TRITON" in b.upper() for b in backends):
        return "triton conv-backward templates"
    return None


def _make_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class ConvolutionBackwardThroughDispatcher(CustomGraphPass):
        """Inductor post-grad pass: ``aten.convolution_backward`` → ``aten_override.convolution_backward``."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            if bypassing_wrapper() is not None:
                _retarget(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

        def __repr__(self) -> str:
            return "aten_override.compiled_graphs.PASS"

    return ConvolutionBackwardThroughDispatcher()


_pass = None


def _get_pass():
    global _pass
    if _pass is None:
        _pass = _make_pass()
    return _pass


def __getattr__(name):
    if name == "PASS":  # built on first use: it subclasses an Inductor class
        return _get_pass()
    raise AttributeError(name)


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.hook: _ImportHook | None = None


_state = _State()


def setting(compiled_graphs: bool | None) -> bool:
    """The effective switch: ``compiled_graphs`` if given, else ``ATEN_OVERRIDE_COMPILED_GRAPHS``
    (``0`` turns it off), else on."""
    if compiled_graphs is not None:
        return bool(compiled_graphs)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _install_pass(config) -> None:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    ours = _get_pass()
    current = get_custom_graph_passes(config.post_grad_custom_post_pass)
    if ours not in current:
        config.post_grad_custom_post_pass = (*current, ours)


def _remove_pass(config) -> None:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    if _pass is None:
        return
    current = get_custom_graph_passes(config.post_grad_custom_post_pass)
    if _pass in current:
        rest = tuple(p for p in current if p is not _pass)
        config.post_grad_custom_post_pass = rest or None


class _ImportHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Adds the pass right after ``torch._inductor.config`` is imported."""

    def __init__(self) -> None:
        self._loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != _CONFIG_MODULE or self._loader is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _state.lock:
            if _state.depth:
                _install_pass(module)
            _drop_hook()


def _drop_hook() -> None:
    hook, _state.hook = _state.hook, None
    if hook is not None and hook in sys.meta_path:
        sys.meta_path.remove(hook)


def activate() -> None:
    """Add :data:`PASS` to Inductor's post-grad passes (now, or when Inductor's config is imported).
    Counted: n calls need n :func:`deactivate`."""
    with _state.lock:
        _state.depth += 1
        if _state.depth > 1:
            return
        config = sys.modules.get(_CONFIG_MODULE)
        if config is not None:
            _install_pass(config)
        elif _state.hook is None:
            _state.hook = _ImportHook()
            sys.meta_path.insert(0, _state.hook)


def deactivate() -> None:
    """Undo one :func:`activate`; with the last one the pass leaves Inductor's config."""
    with _state.lock:
        if _state.depth == 0:
            raise RuntimeError("aten_override.compiled_graphs: deactivate() without activate()")
        _state.depth -= 1
        if _state.depth:
            return
        _drop_hook()
        config = sys.modules.get(_CONFIG_MODULE)
        if config is not None:
            _remove_pass(config)


def is_active() -> bool:
    """Whether graphs Inductor compiles now call ``aten_override::convolution_backward``."""
    return _state.depth > 0
