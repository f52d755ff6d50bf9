"""Sweep torch's original CPU kernel of ``aten::convolution_backward`` for crashes and wrong values.

Draws random calls (1-D / 2-D / 3-D, regular / transposed, groups incl. depthwise, C_in != C_out,
per-dim sizes, kernels, strides, paddings, dilations and output paddings, channels_last tensors,
batch 1-3, every output_mask, float64 / float32 / bfloat16 / float16) and runs each one in a forked
child, so a segfault does not end the sweep. Per call it records:

- native's backend (``torch._C._select_conv_backend``; 9 is MkldnnTranspose, unnamed in torch 2.13);
- a crash (the child died of a signal; a child that runs past ``--timeout`` dies of SIGALRM);
- nondeterminism: the three results (allocator scribbled with large values before each, so an
  uninitialised read shows up) differ bit for bit;
- error vs ``ref``, the float64 result of the original kernel on the same (rounded) values in
  contiguous layout (see :func:`measure`); ``tol`` is twice bfloat16's rounding (2**-7) for
  bfloat16 / float16, 1e-5 for float32, 1e-12 for float64 (so float64 checks layouts only);
- which condition our backends use to avoid native's oneDNN path holds: a dead tap
  (``args.dead_taps``), a transposed layer of input width 1 (``args.width_one_transposed``), a
  padded regular 3-D layer with a dim shorter than its kernel (``args.padded_3d``; these three make
  ``args.onednn_defect``, bfloat16 / float16 only), a 3-D bfloat16 layer asking for grad_weight on
  a CPU with AMX-BF16 (``args.amx_3d_weight``), a dilated 2-D depthwise bfloat16 layer with
  a channels-last input (``args.depthwise_dilated``), a 3-D layer with no row meeting the whole kernel
  in depth (``args.depth_without_full_row``, any dtype), or a strided 1x1 channels-last layer whose oneDNN
  source has under 8 channels where oneDNN runs its AVX2 kernels (``args.strided_1x1_avx2``, any dtype
  but float64).

Each defective call is then run on our backends (``--backends``; also in forked children): no
crash, bit-for-bit repeatable, within ``tol`` of float64, native's dtype, shape and strides where
native returned, and, for the compiled backend, the layer class it counted.

Not run by CI: a few thousand calls take minutes on one core. Example::

    PYTHONPATH=. python scripts/sweep_native_defects.py --calls 3000 --seed 0 --dtypes bfloat16,float16

``--channels`` draws 16-128 channels per group and ``--max-size`` larger planes: the defects that
show only on larger calls (``args.amx_3d_weight``: from about 1e5 input elements per depth slice)::

    PYTHONPATH=. python scripts/sweep_native_defects.py --calls 200 --dtypes bfloat16 --channels --max-size 64

``--strided-1x1`` draws only 2-D 1x1 layers around ``args.strided_1x1_avx2`` (mostly strided, unpadded,
ungrouped, channels-last, 1-24 source channels), and ``--threads 2`` runs each child at two threads,
where that defect shows as a wrong ``grad_weight`` or a hang (at one thread: a corrupted heap)::

    PYTHONPATH=. python scripts/sweep_native_defects.py --calls 300 --dtypes float32 --strided-1x1 --threads 2 --timeout 20
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import signal
import sys
import zlib

import torch

import aten_override
from aten_override.ops.convolution_backward.args import (
    ConvolutionBackwardArgs,
    amx_3d_weight,
    dead_taps,
    depth_without_full_row,
    padded_3d,
    depthwise_dilated,
    strided_1x1_avx2,
    width_one_transposed,
)

OP = torch.ops.aten.convolution_backward.default
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2.0**-7, "float16": 2.0**-7}
BACKEND_NAMES = {0: "CudaDepthwise2d", 1: "CudaDepthwise3d", 2: "Cudnn", 3: "CudnnTranspose", 4: "Empty",
                 5: "Miopen", 6: "MiopenDepthwise", 7: "MiopenTranspose", 8: "Mkldnn", 9: "MkldnnTranspose",
                 10: "MkldnnEmpty", 11: "NnpackSpatial", 12: "Overrideable", 13: "Slow2d", 14: "Slow3d",
                 15: "SlowDilated2d", 16: "SlowDilated3d", 17: "SlowTranspose2d", 18: "SlowTranspose3d",
                 19: "Winograd3x3Depthwise", 20: "Xnnpack2d", 21: "Mps", 22: "MpsTranspose"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One ``aten::convolution_backward`` call, as drawn; per-dim params are tuples of ``dims`` ints."""

    dtype: str
    transposed: bool
    batch: int
    c_in: int
    c_out: int
    groups: int
    size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    channels_last: str  # which of input / weight / grad_output are channels_last: subset of "iwg"
    output_mask: tuple[bool, bool, bool]

    @property
    def dims(self) -> int:
        return len(self.size)

    def output_size(self) -> list[int]:
        if self.transposed:
            return [(i - 1) * s - 2 * p + d * (k - 1) + op + 1 for i, k, s, p, d, op in
                    zip(self.size, self.kernel, self.stride, self.padding, self.dilation, self.output_padding)]
        return [(i + 2 * p - d * (k - 1) - 1) // s + 1
                for i, k, s, p, d in zip(self.size, self.kernel, self.stride, self.padding, self.dilation)]

    def has_dead_tap(self) -> bool:
        return any(dead_taps(transposed=self.transposed, input_size=self.size, grad_output_size=self.output_size(),
                             kernel=self.kernel, stride=self.stride, padding=self.padding, dilation=self.dilation))

    def condition(self) -> str:
        """Which condition our backends avoid native's oneDNN path on holds: ``dead-tap``,
        ``width-one``, ``padded-3d`` (``args.onednn_defect``, reduced precision), ``amx-3d-weight``,
        ``depthwise-dilated`` (bfloat16), ``depth`` (any dtype), ``strided-1x1`` (any dtype but float64)
        or ``none``."""
        if depth_without_full_row(transposed=self.transposed, input_size=self.size, kernel=self.kernel,
                                  grad_output_size=self.output_size(), stride=self.stride, padding=self.padding,
                                  dilation=self.dilation):
            return "depth"
        if self.has_dead_tap():
            return "dead-tap"
        if width_one_transposed(transposed=self.transposed, input_size=self.size, kernel=self.kernel):
            return "width-one"
        go, x, w, *rest = self.aten_args(meta=True)
        args = ConvolutionBackwardArgs(go, x, w, *rest)
        if padded_3d(args):
            return "padded-3d"
        if amx_3d_weight(args):
            return "amx-3d-weight"
        if depthwise_dilated(args):
            return "depthwise-dilated"
        if strided_1x1_avx2(args):
            return "strided-1x1"
        return "none"

    def covered(self, condition: str) -> bool:
        """Whether our backends avoid native's oneDNN path on this call (``condition()``)."""
        if condition in ("amx-3d-weight", "depthwise-dilated"):
            return self.dtype == "bfloat16"
        if condition == "strided-1x1":
            return self.dtype != "float64"
        return condition == "depth" or (condition != "none" and self.dtype in ("bfloat16", "float16"))

    def aten_args(self, dtype: torch.dtype | None = None, contiguous: bool = False, absolute: bool = False,
                  meta: bool = False) -> tuple:
        """The positional arguments, values seeded by the call; ``dtype`` overrides the values'
        dtype after rounding to the call's own (the float64 reference); ``absolute`` takes ``abs()``;
        ``meta``: meta tensors of the call's dtype (for the ``args`` predicates)."""
        g = torch.Generator().manual_seed(zlib.crc32(repr(self).encode()))
        own = DTYPES[self.dtype]
        w_shape = ((self.c_in, self.c_out // self.groups) if self.transposed else
                   (self.c_out, self.c_in // self.groups)) + self.kernel
        if meta:
            shapes = ((self.batch, self.c_out, *self.output_size()), (self.batch, self.c_in, *self.size), w_shape)
            go, x, w = (torch.empty(shape, dtype=own, device="meta") for shape in shapes)
            if self.dims > 1:
                fmt = torch.channels_last if self.dims == 2 else torch.channels_last_3d
                x, w = (t.contiguous(memory_format=fmt) if key in self.channels_last else t
                        for key, t in (("i", x), ("w", w)))
            return (go, x, w, [self.c_out], list(self.stride), list(self.padding), list(self.dilation),
                    self.transposed, list(self.output_padding), self.groups, list(self.output_mask))
        tensors = {
            "i": torch.randn(self.batch, self.c_in, *self.size, generator=g, dtype=torch.float64),
            "w": torch.randn(w_shape, generator=g, dtype=torch.float64),
            "g": torch.randn(self.batch, self.c_out, *self.output_size(), generator=g, dtype=torch.float64),
        }
        for key, t in tensors.items():
            t = t.to(own).to(dtype or own)
            t = t.abs() if absolute else t
            if key in self.channels_last and not contiguous:
                t = t.contiguous(memory_format=torch.channels_last if self.dims == 2 else torch.channels_last_3d)
            tensors[key] = t
        return (tensors["g"], tensors["i"], tensors["w"], [self.c_out], list(self.stride), list(self.padding),
                list(self.dilation), self.transposed, list(self.output_padding), self.groups, list(self.output_mask))

    def native_backend(self) -> int:
        go, x, w, bias_sizes, *conv, _ = self.aten_args()
        with torch.enable_grad():
            return int(torch._C._select_conv_backend(x, w, None, *conv, bias_sizes))

    def __str__(self) -> str:
        t = "transposed " if self.transposed else ""
        per_dim = " ".join(f"{n}={list(v)}" for n, v in [
            ("size", self.size), ("kernel", self.kernel), ("stride", self.stride), ("padding", self.padding),
            ("dilation", self.dilation)] + ([("output_padding", self.output_padding)] if self.transposed else []))
        mask = "".join("iwb"[i] for i in range(3) if self.output_mask[i])
        cl = f" channels_last={self.channels_last}" if self.channels_last else ""
        return (f"{self.dtype} {self.dims}-D {t}N={self.batch} C_in={self.c_in} C_out={self.c_out} "
                f"groups={self.groups} {per_dim}{cl} mask={mask}")


def draw(rng: random.Random, dtypes: list[str], max_size: int, channels: bool = False) -> Call:
    """A random valid call (output size >= 1 in every dim); ``channels``: 16-128 channels per group
    (depthwise: the multiplier stays 1-2), not 1-8."""
    dims = rng.choice([1, 1, 2, 2, 2, 3])
    transposed = rng.random() < 0.5
    kind = rng.choice(["dense", "dense", "grouped", "depthwise"])
    groups = 1 if kind == "dense" else rng.choice([2, 3, 4])
    widths = [16, 32, 64, 128] if channels else [1, 2, 3, 8]
    per_group_in = 1 if kind == "depthwise" else rng.choice(widths)
    per_group_out = rng.choice([1, 2]) if kind == "depthwise" else rng.choice(widths)
    biggest = max_size if dims < 3 else max(2, max_size // 2)
    while True:
        size, kernel, stride, padding, dilation, output_padding = [], [], [], [], [], []
        for _ in range(dims):
            k, s, d = rng.choice([1, 2, 3, 3, 4, 5]), rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 3])
            size.append(rng.choice([1, 1, 2, 3, 4, 5, rng.randint(2, biggest)]))
            kernel.append(k)
            stride.append(s)
            dilation.append(d)
            padding.append(rng.randint(0, d * (k - 1) + 2))  # > d(k-1): border outputs meet padding only
            output_padding.append(rng.randint(0, max(s, d) - 1) if transposed else 0)
        call = Call(
            dtype=rng.choice(dtypes), transposed=transposed, batch=rng.choice([1, 2, 3]),
            c_in=groups * per_group_in, c_out=groups * per_group_out, groups=groups, size=tuple(size),
            kernel=tuple(kernel), stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation),
            output_padding=tuple(output_padding),
            channels_last="" if dims == 1 else "".join(c for c in "iwg" if rng.random() < 0.3),
            output_mask=rng.choice([(True, True, True)] * 3 + [(True, False, False), (False, True, False),
                                   (False, False, True), (True, True, False), (False, True, True)]),
        )
        if min(call.output_size()) >= 1:
            return call


def draw_strided_1x1(rng: random.Random, dtypes: list[str], max_size: int) -> Call:
    """A random valid 2-D 1x1 call around ``args.strided_1x1_avx2``: mostly strided, unpadded, ungrouped
    and channels-last, its oneDNN source (a regular call's input, a transposed call's grad_output) of 1-24
    channels per group."""
    transposed = rng.random() < 0.5
    groups = rng.choice([1, 1, 1, 2])
    source, other = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24]), rng.choice([1, 3, 5, 8, 16, 32])
    c_in, c_out = ((other, source) if transposed else (source, other))
    while True:
        stride = tuple(rng.choice([1, 2, 2, 3]) for _ in range(2))
        dilation = tuple(rng.choice([1] * 6 + [2]) for _ in range(2))
        # the wrong calls found had a source of exactly stride x the other side in every dim: drawn often
        exact = rng.random() < 0.6
        size = tuple(s * rng.randint(1, max(1, max_size // s)) if exact and not transposed else
                     rng.randint(2, max_size) for s in stride)
        output_padding = tuple(
            (s - 1 if exact else rng.randint(0, max(s, d) - 1)) if transposed else 0 for s, d in zip(stride, dilation))
        call = Call(
            dtype=rng.choice(dtypes), transposed=transposed, batch=rng.choice([1, 2, 4, 10]), c_in=groups * c_in,
            c_out=groups * c_out, groups=groups, size=size, kernel=(1, 1), stride=stride,
            padding=tuple(rng.choice([0] * 6 + [1]) for _ in range(2)), dilation=dilation,
            output_padding=output_padding, channels_last=rng.choice(["i", "i", "ig", "iwg", "w", ""]),
            output_mask=rng.choice([(True, True, True)] * 3 + [(True, False, True), (False, True, False)]),
        )
        if min(call.output_size()) >= 1:
            return call


def scribble(numels) -> None:
    """Leave freed blocks of these sizes (and some more) full of large values."""
    junk = [torch.full((n,), 1e4, dtype=torch.float32) for n in list(numels) * 4 + [4096] * 16]
    del junk


def measure(call: Call, run, native_meta=None) -> dict:
    """In the child: three runs of ``run(args)``, compared bit for bit and against float64.

    An output is wrong where ``max|out - ref| > tol * max(ref_abs)`` (``ref_abs``: the float64
    result on ``abs()`` of the values, the sum of the terms' magnitudes, so cancellation does not
    shrink the bound), or where it is not exactly zero although every term is (``ref_abs == 0``:
    a dead tap, an input position no output reads).
    """
    args = call.aten_args()
    ref = OP(*call.aten_args(torch.float64, contiguous=True))
    ref_abs = OP(*call.aten_args(torch.float64, contiguous=True, absolute=True))
    results = []
    for _ in range(3):
        scribble(r.numel() for r in ref if r is not None)
        results.append(run(args))
    tol = TOLERANCE[call.dtype]
    report = {"nondeterministic": "", "wrong": "", "error": 0.0, "layout": "", "meta": []}
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    for i, name in enumerate("iwb"):
        if not call.output_mask[i]:
            report["meta"].append(None)
            continue
        out, expected, magnitude = results[0][i], ref[i], ref_abs[i]
        report["meta"].append([str(out.dtype), list(out.shape), list(out.stride())])
        if str(out.dtype) != f"torch.{call.dtype}" or out.shape != expected.shape:
            report["layout"] += name
            continue
        if native_meta is not None and native_meta[i] is not None and report["meta"][i] != native_meta[i]:
            report["layout"] += name
        view = bits[out.element_size()]
        if any(not torch.equal(out.view(view), r[i].view(view)) for r in results[1:]):
            report["nondeterministic"] += name
        if not expected.numel():
            continue
        scale = magnitude.max().item()
        error = (out.double() - expected).abs().max().item()
        relative = error / scale if scale > 0 else error
        report["error"] = max(report["error"], relative) if relative == relative else float("nan")
        if not relative <= tol or out.double()[magnitude == 0].ne(0).any():  # NaN: not <= tol
            report["wrong"] += name
    return report


def in_child(function, timeout: int, threads: int = 1) -> dict:
    """``function()``'s JSON-able result, run in a forked child at ``threads`` threads; ``{"signal": n}`` if
    the child died."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        signal.alarm(timeout)
        torch.set_num_threads(threads)
        try:
            out = function()
        except Exception as e:  # noqa: BLE001 (reported, not swallowed)
            out = {"exception": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": signal.Signals(os.WTERMSIG(status)).name}
    if os.WEXITSTATUS(status) != 0 or not text:
        return {"exception": f"child exit status {os.WEXITSTATUS(status)}"}
    return json.loads(text)


def native_run(args):
    return aten_override.original_kernel("cpu")(*args)


def backend_run(backend: str):
    def run(args):
        with aten_override.enable(backend):
            return OP(*args)
    return run


def check_backend(call: Call, backend: str, native_meta, timeout: int, threads: int = 1) -> dict:
    def child():
        aten_override.reset_stats()
        report = measure(call, backend_run(backend), native_meta)
        stats = aten_override.stats()
        report["served"] = stats.get(backend, 0)
        report["classes"] = stats.get("compiled_layer_classes", {})
        report["fallback_reasons"] = stats["fallback_reasons"]
        return report
    return in_child(child, timeout, threads)


def defects(report: dict) -> list[str]:
    if "signal" in report:
        return [f"crash ({report['signal']})"]
    if "exception" in report:
        return [f"exception ({report['exception']})"]
    found = []
    if report["nondeterministic"]:
        found.append(f"nondeterministic {report['nondeterministic']}")
    if report["wrong"]:
        found.append(f"wrong {report['wrong']} (error {report['error']:.3g})")
    if report["layout"]:
        found.append(f"dtype/shape/strides {report['layout']}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="random calls to draw (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws (a call's values are seeded by the call)")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32,float64",
                        help="comma-separated dtypes to draw from (default: all four)")
    parser.add_argument("--max-size", type=int, default=12, help="largest spatial size per dim (3-D: half)")
    parser.add_argument("--channels", action="store_true",
                        help="16-128 channels per group instead of 1-8 (with a larger --max-size: larger calls)")
    parser.add_argument("--strided-1x1", action="store_true",
                        help="draw only 2-D 1x1 layers around args.strided_1x1_avx2 (see the module's docstring)")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of each child (the parent forks before starting a thread pool)")
    parser.add_argument("--backends", default="compiled,python",
                        help="our backends to check on each defective call ('' for none)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per child before SIGALRM")
    parser.add_argument("--jsonl", help="write one JSON line per call here")
    parser.add_argument("--verbose", action="store_true", help="print every defective call as found")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # before forking: a child must not inherit a started thread pool
    dtypes = args.dtypes.split(",")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        reason = aten_override.availability()[b]
        if reason is not None:
            parser.error(f"backend {b!r} unavailable: {reason}")
    rng = random.Random(args.seed)
    log = open(args.jsonl, "w") if args.jsonl else None
    totals = collections.Counter()
    drawn = collections.Counter()  # (dtype, backend, condition)
    table = collections.Counter()  # (dtype, backend, condition, defect kind)
    uncovered, ours_failed, classes = [], [], collections.Counter()
    for n in range(args.calls):
        call = (draw_strided_1x1(rng, dtypes, args.max_size) if args.strided_1x1 else
                draw(rng, dtypes, args.max_size, args.channels))
        backend = BACKEND_NAMES.get(call.native_backend(), "?")
        condition = call.condition()
        native = in_child(lambda: measure(call, native_run), args.timeout, args.threads)
        found = defects(native)
        totals["calls"] += 1
        totals[condition] += 1
        drawn[(call.dtype, backend, condition)] += 1
        record = {"call": dataclasses.asdict(call), "backend": backend, "condition": condition, "native": native}
        if found:
            totals["defective"] += 1
            kinds = ",".join(sorted({f.split(" ")[0] for f in found}))
            table[(call.dtype, backend, condition, kinds)] += 1
            if not call.covered(condition):
                uncovered.append((call, backend, found))
            if args.verbose:
                print(f"[{n}] {call} backend={backend} condition={condition}: {'; '.join(found)}", flush=True)
            record["ours"] = {}
            for b in backends:
                ours = check_backend(call, b, native.get("meta"), args.timeout, args.threads)
                record["ours"][b] = ours
                bad = defects(ours)
                if "signal" not in ours and "exception" not in ours:
                    if ours["served"] == 0:
                        bad.append(f"not served by {b} (fallback: {ours['fallback_reasons']})")
                    classes[(b, tuple(sorted(ours["classes"].items())))] += 1
                if bad:
                    ours_failed.append((call, b, bad))
                    if args.verbose:
                        print(f"    {b}: {'; '.join(bad)}", flush=True)
        elif "error" in native:
            totals[f"clean {call.dtype}"] += 1
            totals[f"max error {call.dtype}"] = max(totals[f"max error {call.dtype}"], native["error"])
        if log:
            log.write(json.dumps(record) + "\n")
    if log:
        log.close()

    print(f"{totals['calls']} calls (seed {args.seed}): {totals['depth']} 3-D transposed without a full row in "
          f"depth, {totals['dead-tap']} more with a dead tap, {totals['width-one']} more transposed of width 1; "
          f"{totals['defective']} defective on the original kernel")
    for dtype in dtypes:
        if totals[f"clean {dtype}"]:
            print(f"  {dtype}: {totals[f'clean {dtype}']} clean calls, largest relative error "
                  f"{totals[f'max error {dtype}']:.3g} (tolerance {TOLERANCE[dtype]:.3g})")
    print("calls by dtype, native backend, condition (Call.condition):")
    for (dtype, backend, condition), count in sorted(drawn.items()):
        print(f"  {count:5d}  {dtype:9s} {backend:16s} {condition}")
    print("defective calls by dtype, native backend, condition, defect:")
    for (dtype, backend, condition, kinds), count in sorted(table.items()):
        print(f"  {count:5d}  {dtype:9s} {backend:16s} {condition:9s} {kinds}")
    print(f"defective calls not covered (no condition, or a reduced-precision one on float32/64): {len(uncovered)}")
    for call, backend, found in uncovered[:20]:
        print(f"  {call} backend={backend}: {'; '.join(found)}")
    if backends:
        print("our backends on the defective calls, by layer classes counted:")
        for (b, cls), count in sorted(classes.items()):
            print(f"  {count:5d}  {b}: {dict(cls)}")
        print(f"failures of our backends: {len(ours_failed)}")
        for call, b, bad in ours_failed[:20]:
            print(f"  {b}: {call}: {'; '.join(bad)}")
    return 1 if uncovered or ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
