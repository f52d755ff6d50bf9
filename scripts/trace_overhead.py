"""Overhead of aten_override.trace() per aten::convolution_backward call, in microseconds.

Calls ``torch.ops.aten.convolution_backward`` directly on a tiny convolution (so the kernel itself
costs little) under each configuration, interleaved round by round in one process so machine noise
hits all of them alike, and prints the median time per call and the difference to the override
without a trace::

    python scripts/trace_overhead.py [--rounds 15] [--number 200] [--long N]

Configurations: ``native`` (nothing registered), ``enable(aten)`` (our kernel registered, no
observer: the cost of the override itself), and ``trace`` with its options: records in memory
(the default ring of 1,000), streamed to a JSON-lines file, sampled (``first=3``), and
``aggregate_only``. ``--long N`` then runs N calls under the streaming and the aggregate-only
tracer and prints the time per call, the process's resident memory before and after, and the
streamed file's size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time

import torch
from torch.utils.benchmark import Timer

import aten_override
from aten_override import _machine


def configurations(directory: str):
    stream = os.path.join(directory, "stream.jsonl")
    yield "native", contextlib.nullcontext
    yield "enable(aten)", lambda: aten_override.enable("aten")
    yield "trace(aggregate_only=True)", lambda: aten_override.trace(log=False, aggregate_only=True)
    yield "trace(first=3)", lambda: aten_override.trace(log=False, first=3)
    yield "trace(native=False, timing=False)", lambda: aten_override.trace(log=False, native=False, timing=False)
    yield "trace()", lambda: aten_override.trace(log=False)
    yield "trace(path) (streaming)", lambda: aten_override.trace(stream, log=False)
    yield "trace(verify=True)", lambda: aten_override.trace(log=False, verify=True)


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def long_run(op, aten_args, n: int, directory: str) -> None:
    """N calls under one tracer: per-call time, RSS, file size."""
    path = os.path.join(directory, "long.jsonl")
    print(f"\n{n} calls under one tracer (RSS: resident memory of this process)")
    print(f"{'configuration':<36} {'us/call':>9} {'RSS before':>11} {'RSS after':>10} {'file MiB':>9}")
    for name, make in (
        ("trace(path) streaming, keep=1000", lambda: aten_override.trace(path, log=False)),
        ("trace(aggregate_only=True)", lambda: aten_override.trace(log=False, aggregate_only=True)),
    ):
        before = rss_mib()
        with make() as t:
            start = time.perf_counter()
            for _ in range(n):
                op(*aten_args)
            elapsed = time.perf_counter() - start
        after = rss_mib()
        size = os.path.getsize(path) / 2**20 if t.path else 0.0
        print(f"{name:<36} {elapsed / n * 1e6:9.2f} {before:10.1f}M {after:9.1f}M {size:9.1f}")
        if t.path:
            os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=200, help="calls per measurement")
    parser.add_argument("--long", type=int, default=0, metavar="N", help="then N calls under one streaming / aggregate-only tracer")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="trace_overhead_")
    torch.set_num_threads(1)
    print(_machine.header(_machine.measure()), flush=True)
    grad_output, x, w = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3)
    aten_args = (grad_output, x, w, [1], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    op = torch.ops.aten.convolution_backward.default
    configs = list(configurations(directory))
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
    if args.long:
        long_run(op, aten_args, args.long, directory)


if __name__ == "__main__":
    main()
