"""Overhead of aten_override.trace() per aten::convolution_backward call, in microseconds.

Calls ``torch.ops.aten.convolution_backward`` directly on a tiny convolution (so the kernel itself
costs little) under each configuration, interleaved round by round in one process so machine noise
hits all of them alike, and prints the median time per call and the difference to the override
without a trace::

    python scripts/trace_overhead.py [--rounds 15] [--number 200]

Configurations: ``native`` (nothing registered), ``enable(aten)`` (our kernel registered, no
observer: the cost of the override itself), and ``trace`` with its options.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from torch.utils.benchmark import Timer

import aten_override
from aten_override import _machine


def configurations():
    yield "native", contextlib.nullcontext
    yield "enable(aten)", lambda: aten_override.enable("aten")
    yield "trace(native=False, timing=False)", lambda: aten_override.trace(log=False, native=False, timing=False)
    yield "trace()", lambda: aten_override.trace(log=False)
    yield "trace(verify=True)", lambda: aten_override.trace(log=False, verify=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=200, help="calls per measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(_machine.header(_machine.measure()), flush=True)
    grad_output, x, w = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3)
    aten_args = (grad_output, x, w, [1], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    op = torch.ops.aten.convolution_backward.default
    configs = list(configurations())
    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    for _ in range(args.rounds):
        for name, make in configs:
            with make():
                timer = Timer("op(*aten_args)", globals={"op": op, "aten_args": aten_args})
                times[name].append(timer.timeit(args.number).median * 1e6)
    base = statistics.median(times["enable(aten)"])
    print(f"aten::convolution_backward, grad_output {list(grad_output.shape)}, weight {list(w.shape)}, "
          f"{args.rounds} interleaved rounds x {args.number} calls, torch {torch.__version__}")
    print(f"{'configuration':<36} {'us/call':>9} {'vs enable(aten)':>16}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<36} {median:9.2f} {median - base:+16.2f}")


if __name__ == "__main__":
    main()
