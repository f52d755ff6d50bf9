r"""Benchmark ``aten::convolution_backward``: native (the original ATen kernel), python and compiled.

Reads the layer suite from ``scripts/shapes.json`` (the project's benchmark data; ``--quick`` takes
the cases marked ``"quick"``), checks every backend's result against native, then times them
*interleaved* in one process with ``torch.utils.benchmark`` at a fixed thread count and prints a
table (and ``--csv FILE``): per layer the median ms, the ratio to native, achieved GFLOP/s, % of the
roofline and the peak memory each call allocates. The ratio is the median over the rounds of each
round's ratio (a backend's time over native's in the same round), so that the machine speeding up
or slowing down between rounds (a shared VM) cancels out.

Roofline: ``time >= max(flops / peak_flops, bytes / bandwidth)`` with ``flops`` = 4 x the forward
multiply-adds (grad_input and grad_weight) and ``bytes`` = one pass over grad_output, input, weight
and the two gradients. Both peaks are measured at startup at the benchmark's thread count
(``aten_override._machine``: the faster of a 2048x2048 ``torch.mm`` and a 3x3 convolution per dtype,
a 256 MiB copy), and printed first with the CPU model, its ISA flags and the torch / oneDNN versions;
``--peak-gflops`` / ``--bandwidth-gbs`` override them. The peak is the best this torch reaches, not
the silicon's, so a kernel can exceed 100%; so can kernels that skip multiplications, ``winograd`` (2.25x
fewer) and ``kn2row-lanes`` (none for taps that meet only padding), credited with the direct
convolution's FLOPs (the table's header says so).

The compiled backend chooses its kernel as ``ATEN_OVERRIDE_AUTOTUNE`` says (unset: measured per call
signature, tuned at the result check, before any timing; ``0``: the layer-class table); the
``compiled class/kernel`` column shows the layer class and the kernel that ran.

Peak memory: the most bytes held by CPU allocations during one call, above what was held before it
(the profiler's allocation events, ``profile_memory=True``); outputs included.

Usage::

    python scripts/bench_convolution_backward.py --quick
    python scripts/bench_convolution_backward.py --threads 2 --csv bench.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import aten_override
from aten_override import _machine
from interleave import interleaved  # scripts/interleave.py

SHAPES = Path(__file__).with_name("shapes.json")
BACKENDS = ("native", "python", "compiled")


@dataclass
class Case:
    name: str
    cls: str
    dtype: torch.dtype
    args: tuple  # the aten arguments
    flops: float
    bytes: float


def load_cases(path: Path, quick: bool, only: str | None, dtypes: set[str]) -> list[dict]:
    cases = json.loads(path.read_text())["cases"]
    if quick:
        cases = [c for c in cases if c.get("quick")]
    if only:
        cases = [c for c in cases if re.search(only, c["name"]) or re.search(only, c["cls"])]
    return cases


def make_case(spec: dict, dtype: torch.dtype, device: str) -> Case:
    g = torch.Generator().manual_seed(0)
    n, c_in, c_out, groups = spec["N"], spec["Cin"], spec["Cout"], spec["g"]
    transposed = spec.get("transposed", False)
    k, s, p, d = spec["k"], spec["s"], spec["p"], spec["d"]
    op = spec.get("op", [0] * len(k))
    spatial_in = spec["in"]
    if transposed:
        out = [(i - 1) * ss - 2 * pp + dd * (kk - 1) + o + 1 for i, kk, ss, pp, dd, o in zip(spatial_in, k, s, p, d, op)]
        w_shape = [c_in, c_out // groups, *k]
        macs = n * c_in * math.prod(spatial_in) * (c_out // groups) * math.prod(k)
    else:
        out = [(i + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for i, kk, ss, pp, dd in zip(spatial_in, k, s, p, d)]
        w_shape = [c_out, c_in // groups, *k]
        macs = n * c_out * math.prod(out) * (c_in // groups) * math.prod(k)

    def rand(shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    go, x, w = rand([n, c_out, *out]), rand([n, c_in, *spatial_in]), rand(w_shape)
    args = (go, x, w, [c_out], s, p, d, transposed, op, groups, [True, True, True])
    elements = 2 * (x.numel() + w.numel()) + go.numel()
    return Case(spec["name"], spec["cls"], dtype, args, 4.0 * macs, elements * x.element_size())


def call(backend: str, args: tuple):
    if backend == "native":
        return NATIVE(*args)
    with aten_override.enable(backend):
        return torch.ops.aten.convolution_backward.default(*args)


def check(case: Case, backend: str, ours, ref) -> str | None:
    """None if ``ours`` matches native's result (values, dtypes, strides), else what differs."""
    reduced = case.dtype in (torch.bfloat16, torch.float16)
    for name, a, b in zip(("grad_input", "grad_weight", "grad_bias"), ours, ref):
        if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
            return f"{name}: {a.shape}/{a.dtype}/{a.stride()} vs native {b.shape}/{b.dtype}/{b.stride()}"
        scale = b.abs().max().item() or 1.0
        err = (a.float() - b.float()).abs().max().item() / scale
        if err > (3e-2 if reduced else 1e-4):
            return f"{name}: max error {err:.2e} of native's max"
    return None


def peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    # A running sum of the sizes (frees are negative), not the events' totals: c10's CPU allocator and
    # the compiled kernels' kept temporaries (csrc/cpu/workspace.h) each report their own total.
    peak = held = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def time_interleaved(backends, args, rounds: int, min_run_time: float) -> tuple[dict[str, float], dict[str, float]]:
    """(median seconds per call of each backend, median over the rounds of its time / native's time
    in the same round): :func:`interleave.interleaved` of ``blocked_autorange`` medians."""

    def measure(b: str) -> float:
        # Timer runs at num_threads=1 unless told: time at the thread count main() set.
        t = benchmark.Timer("call(b, args)", globals={"call": call, "b": b, "args": args}, num_threads=torch.get_num_threads())
        return t.blocked_autorange(min_run_time=min_run_time).median

    return interleaved(measure, backends, rounds, reference="native")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help='only the cases marked "quick" (under 2 minutes)')
    parser.add_argument("--shapes", type=Path, default=SHAPES)
    parser.add_argument("--only", help="regex on case name or class")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list of native,python,compiled")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="float32 for every case; bfloat16 for cases marked bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per blocked_autorange")
    parser.add_argument("--peak-gflops", type=float, help="override the assumed FLOP peak (GFLOP/s)")
    parser.add_argument("--bandwidth-gbs", type=float, help="override the measured bandwidth (GB/s)")
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    parser.add_argument(
        "--overhead", action="store_true", help="only measure the per-call cost over native on a tiny convolution"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    global NATIVE
    NATIVE = aten_override.original_kernel(args.device)
    if args.overhead:
        return measure_overhead(args.device, [b for b in args.backends.split(",") if b and b != "native"])
    backends = [b for b in args.backends.split(",") if b]
    unavailable = {b: r for b, r in aten_override.availability().items() if r and b in backends}
    for b, reason in unavailable.items():
        print(f"skipping backend {b}: {reason}", file=sys.stderr)
        backends.remove(b)
    dtypes = set(args.dtypes.split(","))
    # The peaks are the CPU's: off the CPU roof% is nan unless --peak-gflops / --bandwidth-gbs give them.
    nan = float("nan") if args.device != "cpu" else None
    machine = _machine.measure(peak_gflops=args.peak_gflops or nan, bandwidth_gbs=args.bandwidth_gbs or nan)
    print(_machine.header(machine))
    print(f"device {args.device}")

    rows = []
    for spec in load_cases(args.shapes, args.quick, args.only, dtypes):
        case_dtypes = [torch.float32] if "float32" in dtypes else []
        if spec.get("bf16") and "bfloat16" in dtypes:
            case_dtypes.append(torch.bfloat16)
        for dtype in case_dtypes:
            case = make_case(spec, dtype, args.device)
            ref = NATIVE(*case.args)
            for b in backends:
                if b != "native":
                    problem = check(case, b, call(b, case.args), ref)
                    if problem:
                        raise SystemExit(f"{case.name} {dtype} {b}: result differs from native: {problem}")
            times, ratios = time_interleaved(backends, case.args, args.rounds, args.min_run_time)
            roof = max(case.flops / machine.peak(dtype), case.bytes / machine.bandwidth)
            aten_override.reset_stats()
            call("compiled", case.args) if "compiled" in backends else None
            stats = aten_override.stats()
            # the layer class and the kernel that ran (after tuning, with autotune on: the measured choice)
            layer_class = ",".join(stats.get("compiled_layer_classes", {})) or "-"
            layer_class += "/" + (",".join(stats.get("compiled_kernels", {})) or "-")
            for b in backends:
                mem = peak_bytes(lambda: call(b, case.args))
                rows.append(
                    {
                        "case": case.name, "class": case.cls, "dtype": str(dtype).replace("torch.", ""),
                        "backend": b, "compiled_class": layer_class, "ms": times[b] * 1e3,
                        "ratio": ratios[b],
                        "gflops": case.flops / times[b] / 1e9, "roofline_pct": 100 * roof / times[b],
                        "peak_mb": mem / 2**20,
                    }
                )
            line = "  ".join(f"{b} {times[b] * 1e3:8.2f} ms" for b in backends)
            print(f"{case.name:45s} {str(dtype)[6:]:8s} {line}", file=sys.stderr, flush=True)

    print_table(rows, backends)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def measure_overhead(device: str, backends: list[str], rounds: int = 15) -> int:
    """Per-call cost of each backend over native, in microseconds, on a tiny dense convolution
    (served natively by every backend's class choice): median of interleaved rounds, each the
    median of a blocked_autorange, all through the dispatcher."""
    go, x, w = (torch.randn(s, device=device) for s in ([1, 2, 4, 4], [1, 2, 4, 4], [2, 2, 1, 1]))
    aten_args = (go, x, w, [2], [1], [0], [1], False, [0], 1, [True, True, True])
    stmt = "op(*aten_args)"
    env = {"op": torch.ops.aten.convolution_backward.default, "aten_args": aten_args}
    samples: dict[str, list[float]] = {"native": [], **{b: [] for b in backends}}
    for _ in range(rounds):
        for b in samples:
            ctx = aten_override.enable(b) if b != "native" else None
            if ctx:
                ctx.__enter__()
            try:
                timer = benchmark.Timer(stmt, globals=env, num_threads=torch.get_num_threads())
                samples[b].append(timer.blocked_autorange(min_run_time=0.05).median)
            finally:
                if ctx:
                    ctx.__exit__(None, None, None)
    native = statistics.median(samples["native"]) * 1e6
    print(f"tiny convolution_backward {list(x.shape)} x {list(w.shape)} on {device}: native {native:.2f} us/call")
    for b in backends:
        diffs = [(ours - nat) * 1e6 for ours, nat in zip(samples[b], samples["native"])]
        print(f"  {b}: {statistics.median(samples[b]) * 1e6:.2f} us/call, over native {statistics.median(diffs):+.2f} us (median of {rounds} interleaved rounds)")
    return 0


def print_table(rows: list[dict], backends: list[str]) -> None:
    print("GFLOP/s and roof% count a direct convolution's FLOPs (winograd and kn2row-lanes, which skip "
          "multiplications, can read above 100%) and one pass over each tensor's bytes:")
    header = f"{'case':44s} {'class':15s} {'dtype':8s} {'compiled class/kernel':26s}"
    for b in backends:
        header += f" | {b:>8s} ms  ratio GFLOP/s roof% peakMB"
    print(header)
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["case"], r["class"], r["dtype"], r["compiled_class"]), {})[r["backend"]] = r
    for (name, cls, dtype, compiled_class), per in by_case.items():
        line = f"{name[:44]:44s} {cls[:15]:15s} {dtype:8s} {compiled_class[:26]:26s}"
        for b in backends:
            r = per[b]
            line += f" | {r['ms']:11.2f} {r['ratio']:6.2f} {r['gflops']:8.1f} {r['roofline_pct']:5.1f} {r['peak_mb']:6.1f}"
        print(line)
    for b in backends:
        if b == "native":
            continue
        ratios = [per[b]["ratio"] for per in by_case.values()]
        mem = [per[b]["peak_mb"] / max(per["native"]["peak_mb"], 1e-9) for per in by_case.values() if per["native"]["peak_mb"] > 0]
        print(
            f"{b}/native: geomean {math.exp(statistics.fmean(math.log(r) for r in ratios)):.2f}, worst {max(ratios):.2f} "
            f"({len(ratios)} rows); peak memory ratio worst {max(mem) if mem else float('nan'):.2f}"
        )


NATIVE = None

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
