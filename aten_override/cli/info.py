"""``info``: torch/build versions and a backend x dispatch-key availability table with reasons."""

from __future__ import annotations

import platform

import torch

HELP = "print versions, which backend serves which dispatch key (and why not), and the compiled CUDA kernels' state"


def add_arguments(parser) -> None:
    pass


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
    from ..tracing import current_flags

    # What upstream's backend choice depends on; read again at every backward call.
    print("flags: " + "  ".join(f"{k}={v}" for k, v in current_flags().items()))
    print("trace a program: python -m aten_override run --trace trace.json [--verify] script.py ARGS...")
    return 0
