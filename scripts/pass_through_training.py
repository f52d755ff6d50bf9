"""The backend users write first, training a model with frozen weights: per-step time and RSS.

``def pass_through(*args): return torch.ops.aten.convolution_backward.default(*args)`` delegates to
the op itself (the inner call runs the original kernel inside the outer one). With frozen
convolution weights, the original kernel's oneDNN path returns a ``grad_weight`` that
``output_mask`` leaves out; ``enable()`` drops it (one warning). This script trains a small CNN whose
first two convolutions are frozen, natively and under ``enable(pass_through)`` entered every step,
interleaved, and prints the step times, ``stats()`` and the process's resident memory::

    python scripts/pass_through_training.py [--steps 2000] [--batch 8]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings

import torch
from torch import nn

import aten_override


def pass_through(*aten_args):
    return torch.ops.aten.convolution_backward.default(*aten_args)


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    for conv in (model[0], model[2]):
        conv.weight.requires_grad_(False)  # frozen: output_mask[1] is False for these two
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(args.batch, 3, 16, 16), torch.randint(0, 10, (args.batch,))

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def step_with_backend():
        with aten_override.enable(pass_through):
            step()

    times: dict[str, list[float]] = {"native": [], "enable(pass_through) per step": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f in (step, step_with_backend):
            for _ in range(50):
                f()
        aten_override.reset_stats()
        rss0 = rss_mib()
        for _ in range(args.steps):
            for name, f in (("native", step), ("enable(pass_through) per step", step_with_backend)):
                start = time.perf_counter()
                f()
                times[name].append((time.perf_counter() - start) * 1e6)
        rss1 = rss_mib()
    masked = [w for w in caught if "output_mask" in str(w.message)]
    print(f"{args.steps} SGD steps each, batch {args.batch}, 3 convolutions (2 frozen), torch {torch.__version__}, 1 thread")
    for name, values in times.items():
        print(f"  {name:<32} median {statistics.median(values):8.1f} us/step")
    print(f"  stats(): {aten_override.stats()}")
    print(f"  RSS {rss0:.1f} -> {rss1:.1f} MiB ({rss1 - rss0:+.2f}) over {2 * args.steps} steps")
    print(f"  masked-output warnings: {len(masked)}" + (f" ({masked[0].message})" if masked else ""))


if __name__ == "__main__":
    main()
