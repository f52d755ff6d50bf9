r"""``demo``: train a small real CNN natively and with a backend enabled, and compare.

The data is scikit-learn's bundled handwritten digits (1,797 8x8 images, offline). The network
uses a regular, a strided, a depthwise, a dilated, a grouped 1-D and a transposed convolution, so
every class of ``aten::convolution_backward`` call reaches the backend. Two things are compared:

1. gradients, on identical parameters, at every step of the native run: the backend's and the
   original kernel's (max relative difference per parameter);
2. two whole training runs from the same initialisation and data order: per-epoch loss and final
   accuracy.

Exits 1 when the gradients disagree beyond the dtype's tolerance.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from torch import nn

from . import positive_int

HELP = "train a small CNN on scikit-learn's digits natively and with a backend, and compare"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", default="python", help="backend to compare with native (default: python)")
    parser.add_argument("--epochs", type=positive_int, default=10, help="training epochs (default: 10)")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--dtype", choices=["float64", "float32", "bfloat16"], default="float64",
        help="training dtype (default: float64, where two whole training runs agree to ~1e-10; in float32 "
        "the ~1e-7 per-step differences of any two summation orders grow through training)",
    )
    parser.add_argument("--rtol", type=float, default=None,
                        help="max relative gradient difference accepted (default: 1e-9 / 1e-4 / 5e-2 by dtype)")


class DigitsNet(nn.Module):
    """``(N, 1, 8, 8) -> (N, 10)`` with one convolution of each class."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)  # regular
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)  # strided: 8x8 -> 4x4
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)  # depthwise
        self.dilated = nn.Conv2d(32, 32, 3, padding=2, dilation=2)  # dilated
        self.rows = nn.Conv1d(32 * 4, 32 * 4, 3, padding=1, groups=4)  # grouped 1-D over image rows
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)  # transposed: 4x4 -> 8x8
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.down(x))
        x = torch.relu(self.depthwise(x))
        x = torch.relu(self.dilated(x))
        n, c, h, w = x.shape
        x = torch.relu(self.rows(x.reshape(n, c * h, w))).reshape(n, c, h, w)
        x = torch.relu(self.up(x))
        return self.head(x.mean((2, 3)))


def load_digits():
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError as e:
        raise SystemExit(
            "aten_override demo: scikit-learn is needed for its bundled digits dataset "
            "(pip install scikit-learn, or run scripts/run.sh demo, which installs it)"
        ) from e
    digits = _load()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def _gradients(model, x, y):
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _train(model, data, epochs, batch_size, seed, backend, grad_check=None):
    """Returns per-epoch mean losses; ``grad_check(model, xb, yb)`` runs before every step."""
    import aten_override

    (x, y), _ = data
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=g)
        total, count = 0.0, 0
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            xb, yb = x[idx], y[idx]
            if grad_check is not None:
                grad_check(model, xb, yb)
            opt.zero_grad()
            if backend is None:
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
            else:
                with aten_override.enable(backend):
                    loss = nn.functional.cross_entropy(model(xb), yb)
                    loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            count += len(idx)
        losses.append(total / count)
    return losses


def main(args) -> int:
    import aten_override

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        backend = aten_override.enable(args.backend).impl.name  # validates early, clear error
    except (ValueError, RuntimeError) as e:
        print(f"python -m aten_override demo: error: {e}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    rtol = args.rtol if args.rtol is not None else {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}[args.dtype]
    (xtr, ytr), (xte, yte) = load_digits()
    data = ((xtr.to(dtype), ytr), (xte.to(dtype), yte))
    torch.manual_seed(args.seed)
    initial = DigitsNet().to(dtype)
    print(f"aten_override demo: DigitsNet on scikit-learn digits ({len(data[0][1])} train / {len(data[1][1])} test), "
          f"{args.epochs} epochs, batch {args.batch_size}, {args.dtype}, backend {backend!r} vs native ATen")

    max_rel: dict[str, float] = {}
    comparison_s = [0.0]

    def compare_gradients(model, xb, yb):
        start = time.perf_counter()
        _, native = _gradients(model, xb, yb)
        with aten_override.enable(args.backend):
            _, ours = _gradients(model, xb, yb)
        for k in native:
            scale = native[k].abs().max().item() or 1.0
            rel = (ours[k] - native[k]).abs().max().item() / scale
            max_rel[k] = max(max_rel.get(k, 0.0), rel)
        comparison_s[0] += time.perf_counter() - start

    aten_override.reset_stats()
    t0 = time.perf_counter()
    native_model = copy.deepcopy(initial)
    native_losses = _train(native_model, data, args.epochs, args.batch_size, args.seed, None, compare_gradients)
    t1 = time.perf_counter()
    ours_model = copy.deepcopy(initial)
    ours_losses = _train(ours_model, data, args.epochs, args.batch_size, args.seed, args.backend)
    t2 = time.perf_counter()
    stats = aten_override.stats()

    print("\nepoch  loss(native)  loss(" + backend + ")  rel.diff")
    for e, (a, b) in enumerate(zip(native_losses, ours_losses), 1):
        print(f"{e:5d}  {a:12.6f}  {b:{len(backend) + 6}.6f}  {abs(a - b) / max(abs(a), 1e-12):.2e}")
    print("\nmax relative gradient difference per parameter (same parameters, every step):")
    for k, v in max_rel.items():
        print(f"  {k:<18} {v:.2e}")
    (xt, yt) = data[1]
    acc_native, acc_ours = _accuracy(native_model, xt, yt), _accuracy(ours_model, xt, yt)
    print(f"\ntest accuracy: native {acc_native:.4f}, {backend} {acc_ours:.4f}")
    print(f"wall time of the training runs: native {t1 - t0 - comparison_s[0]:.1f} s, {backend} {t2 - t1:.1f} s "
          f"(plus {comparison_s[0]:.1f} s comparing gradients)")
    served = {k: v for k, v in stats.items() if k != "fallback_reasons"}
    print(f"aten::convolution_backward calls served: {served}")
    for reason, n in stats.get("fallback_reasons", {}).items():
        print(f"  fallback x{n}: {reason}")
    worst = max(max_rel.values())
    loss_diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(native_losses, ours_losses))
    ok = worst <= rtol and served.get(backend, 0) > 0
    print(f"\n{'OK' if ok else 'MISMATCH'}: worst gradient difference {worst:.2e} (tolerance {rtol:.0e}); "
          f"losses of the two runs differ by at most {loss_diff:.2e} (relative)")
    return 0 if ok else 1
