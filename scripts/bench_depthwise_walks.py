r"""Times the depthwise walks of the compiled backend (``depthwise-plane``, ``depthwise-lanes``,
``depthwise-bands``) against native on the large-plane depthwise layers, one call at a time through
``_C.run_kernel``, interleaved, and prints ms, the ratios to native and to lanes, and the achieved
bandwidth (grad_output + 2 x input + 2 x weight bytes per call) against a measured ``copy_``.

Run pinned, one thread (the walks are compared per core)::

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/bench_depthwise_walks.py --runs 5
    python scripts/bench_depthwise_walks.py --vectors wide,pair   # both vector types, on any CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from aten_override import _machine
from aten_override.ops.convolution_backward import compiled

KERNELS = ("native", "depthwise-plane", "depthwise-lanes", "depthwise-bands")
SHAPES = Path(__file__).with_name("shapes.json")


def _cases(path: Path) -> list[dict]:
    """Depthwise cases of ``path`` with planes of at least 28x28 (the large planes bands are for),
    plus two MobileNetV2 layers the file does not list."""
    cases = [c for c in json.loads(path.read_text())["cases"]
             if c["g"] > 1 and c["g"] == c["Cin"] and len(c["in"]) >= 2 and min(c["in"]) >= 28]
    cases.append({"name": "mobilenet_v2.features.1.conv.0.0 (N=8)", "N": 8, "Cin": 32, "Cout": 32, "in": [112, 112],
                  "k": [3, 3], "s": [1, 1], "p": [1, 1], "d": [1, 1], "g": 32})
    cases.append({"name": "mobilenet_v2 dw 144ch 56x56 (N=8)", "N": 8, "Cin": 144, "Cout": 144, "in": [56, 56],
                  "k": [3, 3], "s": [1, 1], "p": [1, 1], "d": [1, 1], "g": 144})
    return cases


def _args(c: dict, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(c["N"], c["Cin"], *c["in"], generator=g).to(dtype)
    w = torch.randn(c["Cout"], c["Cin"] // c["g"], *c["k"], generator=g).to(dtype)
    y = torch.nn.functional.conv2d(x.float(), w.float(), stride=c["s"], padding=c["p"], dilation=c["d"], groups=c["g"])
    go = torch.randn(y.shape, generator=g).to(dtype)
    return (go, x, w, [c["Cout"]], c["s"], c["p"], c["d"], False, [0, 0], c["g"], [True, True, True])


def copy_bandwidth() -> float:
    """Bytes read + written per second by ``copy_`` of 256 MiB (best of 5)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--shapes", type=Path, default=SHAPES)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--vectors", default=None,
                        help="vector types the walks compute in, each timed as its own column: wide (AVX-512 "
                             "registers), pair (AVX2), or both, e.g. wide,pair (default: the CPU's)")
    opts = parser.parse_args()
    ext = compiled.extension()
    vectors = opts.vectors.split(",") if opts.vectors else [ext.vector_type()]
    # (kernel, vector type) columns; native's own kernel has no vector type.
    columns = [(k, None) if k == "native" else (k, v) for k in opts.kernels.split(",")
               for v in (vectors if k != "native" else [None])]
    dtypes = [getattr(torch, d) for d in opts.dtypes.split(",")]
    print(_machine.header(_machine.measure(dtypes=dtypes)))  # peaks of the dtypes timed only
    bw = copy_bandwidth()
    print(f"threads {torch.get_num_threads()}, copy_ {bw / 1e9:.1f} GB/s (read + write)")

    def label(column):
        k, v = column
        name = k.replace("depthwise-", "")
        return name if v is None or len(vectors) == 1 else f"{name}/{v}"

    def run(column, args):
        if column[1] is not None:
            ext.set_vector_type(column[1])
        try:
            ext.run_kernel(column[0], *args)
        finally:
            ext.set_vector_type(None)

    print(f"{'case':46s} {'dtype':5s} " + " ".join(f"{label(c):>11s}" for c in columns)
          + "  bands/native bands/lanes  GB/s(bands) %copy")
    for c in _cases(opts.shapes):
        for dtype in dtypes:
            args = _args(c, dtype)
            best = {}
            for col in columns:
                try:
                    run(col, args)  # warm-up (and: does it claim the call?)
                    best[col] = float("inf")
                except ValueError:
                    best[col] = None
            for _ in range(opts.runs):
                for col in columns:
                    if best[col] is None:
                        continue
                    t0 = time.perf_counter()
                    run(col, args)
                    best[col] = min(best[col], time.perf_counter() - t0)
            go, x, w = args[:3]
            nbytes = (go.numel() + 2 * x.numel() + 2 * w.numel()) * go.element_size()
            cells = " ".join(f"{best[col] * 1e3:11.2f}" if best[col] else f"{'-':>11s}" for col in columns)
            # The ratios and bandwidths of the first vector type given.
            b, lanes = (best.get((k, vectors[0])) for k in ("depthwise-bands", "depthwise-lanes"))
            native = best.get(("native", None))
            ratio = lambda t: f"{b / t:.2f}" if b and t else "-"  # noqa: E731
            extra = f"  {ratio(native):>12s} {ratio(lanes):>11s}"
            if b:
                extra += f"  {nbytes / b / 1e9:11.1f} {100 * nbytes / b / bw:5.0f}"
            extra += f"  (lanes {nbytes / lanes / 1e9:.1f} GB/s)" if lanes else ""
            print(f"{c['name'][:46]:46s} {str(dtype)[6:11]:5s} {cells}{extra}", flush=True)


if __name__ == "__main__":
    main()
