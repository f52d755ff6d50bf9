#!/usr/bin/env python
r"""Per-sample gradients at large batch: ``vmap(grad(loss))`` over a conv model, each backend vs ATen.

This is Opacus' functorch mode: the batch rule calls ``aten::convolution_backward`` with
``groups = batch * groups`` and ``N = 1`` for every layer's ``grad_weight``. Each backend is timed
interleaved with the original kernel in one process (``torch.utils.benchmark``, blocked_autorange
per round, the order alternating from round to round), and the median over the rounds of each round's
ratio backend / aten is printed (> 1: slower), after the machine header (``aten_override._machine``).

Usage::

    python scripts/bench_vmap.py [--batch 64 256] [--rounds 3] [--csv out.csv] [--backend python]
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch
import torch.utils.benchmark as benchmark
from torch import nn
from torch.func import functional_call, grad, vmap

import aten_override
from aten_override import _machine
from interleave import interleaved  # scripts/interleave.py


def model(channels: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, groups=channels),  # depthwise
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, 10),
    )


def per_sample_fn(m: nn.Module):
    def loss(params, xi, yi):
        return nn.functional.cross_entropy(functional_call(m, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))


def main(argv: list[str] | None = None) -> int:
    available = [b for b, r in aten_override.availability().items() if r is None and b not in ("aten", "auto")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--size", type=int, default=16, help="spatial size (H = W)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per backend")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per blocked_autorange")
    p.add_argument("--backend", nargs="+", default=available, choices=available)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--csv", help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(_machine.header(_machine.measure()), flush=True)

    rows = []
    for batch in args.batch:
        m = model(args.channels)
        params = {k: v.detach() for k, v in m.named_parameters()}
        x = torch.randn(batch, 3, args.size, args.size)
        y = torch.randint(0, 10, (batch,))
        fn = per_sample_fn(m)
        expected = fn(params, x, y)
        for backend in args.backend:
            with aten_override.enable(backend):
                aten_override.reset_stats()
                got = fn(params, x, y)
                served = aten_override.stats().get(backend, 0)
            err = max((g - e).abs().max().item() for g, e in zip(got.values(), expected.values()))

            def measure(name: str) -> float:
                timer = benchmark.Timer(
                    stmt="fn(params, x, y)",
                    globals={"fn": fn, "params": params, "x": x, "y": y},
                    label="vmap(grad) per-sample", sub_label=f"batch={batch}", description=name,
                    num_threads=args.threads,
                )
                with aten_override.enable(name):
                    return timer.blocked_autorange(min_run_time=args.min_run_time).median

            times, ratios = interleaved(measure, ("aten", backend), args.rounds, reference="aten")
            aten_us, ours_us = times["aten"] * 1e6, times[backend] * 1e6
            rows.append({
                "batch": batch, "backend": backend, "aten_us": round(aten_us, 1), "backend_us": round(ours_us, 1),
                "ratio": round(ratios[backend], 3), "calls_served": served, "max_abs_err": f"{err:.2e}",
            })

    header = list(rows[0])
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in header}
    print("  ".join(h.rjust(widths[h]) for h in header))
    for r in rows:
        print("  ".join(str(r[h]).rjust(widths[h]) for h in header))
    print("times are medians in microseconds per vmap(grad) call; ratio = median of per-round backend / aten")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
