"""``info``: torch/build versions and a backend x dispatch-key availability table with reasons."""

from __future__ import annotations

import os
import platform
import textwrap

import torch

HELP = "print versions, which backend serves which dispatch key (and why not), and the compiled CUDA kernels' state"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--layer-classes", action="store_true",
        help="also print the compiled backend's layer classes: which kernel serves which layers, and why",
    )


def main(args) -> int:
    from .. import __version__
    from ..backends import availability

    print(f"aten_override {__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"CUDA available: {torch.cuda.is_available()}  (torch built with CUDA {torch.version.cuda})")
    rows = []
    for backend, reason in availability().items():
        for key in ("CPU", "CUDA"):
            r = reason
            if r is None and key == "CUDA" and not torch.cuda.is_available():
                r = "no CUDA device in this process"
            rows.append((backend, key, "yes" if r is None else "no", r or ""))
    width = max(len(r[0]) for r in rows)
    print(f"{'backend':<{width}}  key   available  reason")
    for backend, key, ok, reason in rows:
        print(f"{backend:<{width}}  {key:<4}  {ok:<9}  {reason}")
    from ..ops.convolution_backward import compiled

    cuda = compiled.cuda_kernels()
    note = "" if cuda == "enabled" else " (CUDA calls of the compiled backend run the original kernel)"
    print(f"compiled CUDA kernels (depthwise class): {cuda}{note}")
    _print_autotune(compiled)
    if compiled.extension() is not None:
        from .._machine import subnormal_line

        print(subnormal_line(compiled.extension().subnormal_cost()))
    _print_compiled_graphs()
    from ..tracing import current_flags

    # What upstream's backend choice depends on; read again at every backward call.
    print("flags: " + "  ".join(f"{k}={v}" for k, v in current_flags().items()))
    print("trace a program: python -m aten_override run --trace trace.json [--verify] script.py ARGS...")
    if getattr(args, "layer_classes", False):
        _print_layer_classes(compiled.LAYER_CLASSES)
    return 0


def _print_layer_classes(classes) -> None:
    """The compiled backend's layer-class table (``compiled.LAYER_CLASSES``), ``why`` wrapped."""
    if not classes:
        print("compiled layer classes: the extension is not built")
        return
    width = max(len(name) for name, _, _ in classes)
    kernel_width = max(len(kernel) for _, kernel, _ in classes)
    print(f"compiled layer classes:\n{'class':<{width}}  {'kernel':<{kernel_width}}  why")
    indent = " " * (width + kernel_width + 4)
    for name, kernel, why in classes:
        lines = textwrap.wrap(why, width=max(40, 100 - len(indent)))
        print(f"{name:<{width}}  {kernel:<{kernel_width}}  {lines[0]}")
        for line in lines[1:]:
            print(indent + line)


def _print_compiled_graphs() -> None:
    """Whether graphs compiled inside ``enable()`` call the dispatcher-visible op."""
    from .. import compiled_graphs

    on = compiled_graphs.setting(None)
    source = f"{compiled_graphs.ENV}={os.environ[compiled_graphs.ENV]!r}" if compiled_graphs.ENV in os.environ else "default"
    what = (
        f"graphs Inductor compiles inside enable() call {compiled_graphs.OP} (cpp_wrapper and AOTInductor reach the override)"
        if on
        else "compiled graphs call aten's op (cpp_wrapper and AOTInductor bypass the override)"
    )
    print(f"compiled graphs: {'on' if on else 'off'} ({source}): {what}")


def _print_autotune(compiled) -> None:
    """The compiled backend's kernel choice: measured or the table, and the results file, if any."""
    from .. import autotune

    if compiled.extension() is None:
        return
    setting = autotune.setting()
    source = f"{autotune.ENV}={os.environ[autotune.ENV]!r}" if autotune.ENV in os.environ else "default"
    mode = "measured per call signature" if setting.enabled else "the layer-class table"
    print(f"compiled kernel choice: {mode} ({source}; the table under torch.use_deterministic_algorithms)")
    if setting.path is not None:
        f = autotune.file_info(setting.path)
        state = "valid" if f["valid"] else f"ignored: {f['why']}"
        print(f"autotune results file: {f['path']}: {f['entries']} entries, {state}")
