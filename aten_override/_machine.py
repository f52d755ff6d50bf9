r"""What machine this is, and what it can do: the CPU model and its ISA flags (to validate measured
results against the machine they were measured on) and the measured FLOP peak and memory
bandwidth (the roofline of the benchmarks).

The peaks are *measured*, not assumed from the clock and the ISA: a CPU's sustained clock under
AVX-512 load, its FMA units and a VM's share of them are not in ``/proc/cpuinfo``. The FLOP peak of
a dtype is the best of a few large ``torch.mm`` GEMMs and 3x3 convolutions (the best this torch
reaches on the machine); the bandwidth is a large ``copy_`` (bytes read + written per second). Both run at
the caller's thread count (``torch.get_num_threads()``). The GEMM goes to MKL for float32 / float64,
which on AMD CPUs reaches ~60% of what oneDNN's JIT convolutions do, so a 3x3 convolution forward
is timed too and the faster of the two is the peak (:data:`FLOP_PROBES`).

Example::

    >>> from aten_override import _machine
    >>> _machine.cpu_model(), _machine.isa_flags()
    ('AMD EPYC', ('fma', 'avx2', 'avx512f', 'avx512_vnni', 'avx512_bf16'))
    >>> print(_machine.header(_machine.measure()))
"""

from __future__ import annotations

import dataclasses
import platform
import re
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark

__all__ = [
    "ISA_FLAGS",
    "Machine",
    "cpu_model",
    "isa_flags",
    "onednn_version",
    "FLOP_PROBES",
    "measure_flops",
    "measure_bandwidth",
    "measure",
    "header",
]

ISA_FLAGS = ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
"""The ``/proc/cpuinfo`` flags that change which kernels oneDNN, MKL and ``csrc/cpu`` can use."""

PEAK_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# Dtypes a kernel may compute in float32: their roof is never below float32's (Machine.peak).
REDUCED_DTYPES = (torch.bfloat16, torch.float16)

_CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name : value`` line of ``/proc/cpuinfo``, or ``None`` (no such line,
    or no ``/proc/cpuinfo``: not Linux)."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(name)}\s*:\s*(.*)$", text, re.MULTILINE)
    return m.group(1).strip() if m else None


def cpu_model() -> str:
    """The CPU's model name (``model name`` of ``/proc/cpuinfo``, e.g. ``"AMD EPYC"``;
    ``platform.processor()`` where there is no ``/proc/cpuinfo``; ``"unknown"`` if neither says)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def isa_flags() -> tuple[str, ...]:
    """The flags of :data:`ISA_FLAGS` this CPU has (``flags`` of ``/proc/cpuinfo``), in the order of
    :data:`ISA_FLAGS`; empty where there is no ``/proc/cpuinfo``. Two machines with the same
    :func:`cpu_model` and :func:`isa_flags` run the same kernels."""
    present = set((_cpuinfo_field("flags") or "").split())
    return tuple(f for f in ISA_FLAGS if f in present)


def onednn_version() -> str | None:
    """The oneDNN (MKL-DNN) version torch was built with (``"3.12.0"``), from
    ``torch.__config__.show()``; ``None`` when torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    m = re.search(r"MKL-DNN v([\w.]+)", torch.__config__.show())
    return m.group(1) if m else "unknown"


FLOP_PROBES = {
    # name: (statement, shapes of a and b, flops per call)
    "mm": ("torch.mm(a, b)", ((2048, 2048), (2048, 2048)), 2.0 * 2048**3),
    # A 3x3 convolution forward: oneDNN's JIT kernels where torch.mm goes to MKL, which on AMD CPUs
    # reaches ~60% of oneDNN's float32 rate. 8x256x28x28 input, 256 filters, padding 1.
    "conv3x3": ("F.conv2d(a, b, padding=1)", ((8, 256, 28, 28), (256, 256, 3, 3)), 2.0 * 8 * 256 * 28 * 28 * 256 * 9),
}
"""The compute-bound problems :func:`measure_flops` times: ``name: (statement, (a's shape, b's shape),
flops per call)``."""


def measure_flops(dtype: torch.dtype, min_run_time: float = 0.1, repeats: int = 3,
                  slow_call_s: float = 1.0) -> dict[str, float]:
    """FLOP/s of each :data:`FLOP_PROBES` problem in ``dtype`` on the CPU: the best of ``repeats``
    ``blocked_autorange(min_run_time)`` medians, at ``torch.get_num_threads()`` threads. About
    ``2 * repeats * min_run_time`` seconds. The FLOP peak of ``dtype`` is the largest.

    One call on an eighth of each problem (``a``'s first dim cut to an eighth) comes first. Where it
    shows a call of the whole would take over ``slow_call_s`` seconds, that eighth's rate is the
    problem's: bfloat16 ``torch.mm`` 2048x2048 on a CPU without bfloat16 instructions runs under
    1 GFLOP/s through ATen's generic GEMM (20-50 s a call on a Zen 3 VM), and autoranging it would
    repeat such calls about ``3 * repeats`` times to measure a rate far from any peak."""
    rates = {}
    for name, (stmt, shapes, flops) in FLOP_PROBES.items():
        a, b = (torch.randn(shape).to(dtype) for shape in shapes)

        def timer(lhs: torch.Tensor) -> benchmark.Timer:
            return benchmark.Timer(stmt, globals={"torch": torch, "F": torch.nn.functional, "a": lhs, "b": b},
                                   num_threads=torch.get_num_threads())

        eighth = a[: max(1, a.shape[0] // 8)]
        fraction = eighth.shape[0] / a.shape[0]
        first = timer(eighth).timeit(1).median
        if first / fraction > slow_call_s:
            rates[name] = flops * fraction / first
            continue
        rates[name] = flops / min(timer(a).blocked_autorange(min_run_time=min_run_time).median for _ in range(repeats))
    return rates


def measure_bandwidth(mib: int = 256, min_run_time: float = 0.2, repeats: int = 3) -> float:
    """Memory bandwidth in bytes/s: ``dst.copy_(src)`` of ``mib`` MiB (bytes read + written per
    second), the best of ``repeats`` ``blocked_autorange(min_run_time)`` medians, at
    ``torch.get_num_threads()`` threads."""
    src = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB of 4-byte floats
    dst = torch.empty_like(src)
    timer = benchmark.Timer("dst.copy_(src)", globals={"dst": dst, "src": src}, num_threads=torch.get_num_threads())
    best = min(timer.blocked_autorange(min_run_time=min_run_time).median for _ in range(repeats))
    return 2.0 * src.numel() * src.element_size() / best


@dataclasses.dataclass
class Machine:
    """The machine a benchmark ran on. Peaks in FLOP/s (per dtype name, ``"float32"``) and bytes/s."""

    cpu_model: str
    isa_flags: tuple[str, ...]
    cpu_capability: str
    torch_version: str
    onednn_version: str | None
    threads: int
    peak_flops: dict[str, float]
    bandwidth: float
    peak_flops_source: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per dtype name, the :data:`FLOP_PROBES` problem that reached ``peak_flops``, or ``"given"``."""
    bandwidth_source: str = "copy_ of 256 MiB, read + write"
    probe_flops: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Per dtype name, FLOP/s of every :data:`FLOP_PROBES` problem measured (empty where given): the
    header shows the slower ones too, e.g. MKL's float32 ``torch.mm`` at half the peak of an AMD CPU's
    AVX-512 (MKL runs its AVX2 code there), which caps every kernel that calls it."""

    vector_type: str | None = None
    """What the compiled kernels' vector code computes in (``_C.vector_type()``): ``"wide"`` (64-byte
    vectors, AVX-512 registers) or ``"pair"`` (two 32-byte AVX2 vectors); ``None`` without the extension."""

    bf16_dot: str | None = None
    """The bfloat16 dot products pointwise-bf16 runs (``_C.bf16_dot()``): ``"avx512_bf16"`` (the CPU's
    vdpbf16ps), ``"none"`` (no AVX512_BF16: the kernel declines) or ``"emulated"`` (forced, for tests);
    ``None`` without the extension."""

    streaming_stores: dict | None = None
    """``_C.streaming_stores()``: how the depthwise walks and grouped-lanes write a grad_input of 8 MiB or more
    (non-temporal stores through a staging buffer, or ordinary stores), measured once per process on the
    kernel, with both ways' times (microseconds); ``None`` without the extension."""

    subnormal_cost: dict | None = None
    """``_C.subnormal_cost()``: a float32 128x128 ``at::mm``'s time (microseconds) on operands whose products
    are subnormal and on normal ones, and whether the compiled backend rescales underflowing calls here;
    ``None`` without the extension."""

    def peak(self, dtype: torch.dtype) -> float:
        """The FLOP roof for ``dtype`` in FLOP/s: its measured peak; for bfloat16 / float16 the larger of
        theirs and float32's, since a kernel may compute them in float32 (the compiled backend's do).
        Without that, bfloat16's roof on a CPU with no bfloat16 instructions was torch's generic bfloat16
        GEMM (under 1 GFLOP/s on a Zen 3 VM) and the benchmarks printed rooflines of 500-5,000%. ``nan``
        where neither is measured."""
        own = self.peak_flops.get(_dtype_name(dtype), float("nan"))
        if dtype not in REDUCED_DTYPES:
            return own
        return max((r for r in (own, self.peak_flops.get("float32", float("nan"))) if r == r), default=float("nan"))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure(dtypes=PEAK_DTYPES, peak_gflops: float | None = None, bandwidth_gbs: float | None = None) -> Machine:
    """Describe this machine and measure its peaks at ``torch.get_num_threads()`` threads (a few
    seconds). ``peak_gflops`` (GFLOP/s, every dtype) and ``bandwidth_gbs`` (GB/s) replace the
    measurement when given."""
    peaks, sources, probes = {}, {}, {}
    for dtype in dtypes:
        rates = {"given": peak_gflops * 1e9} if peak_gflops else measure_flops(dtype)
        sources[_dtype_name(dtype)] = best = max(rates, key=rates.get)
        peaks[_dtype_name(dtype)] = rates[best]
        if not peak_gflops:
            probes[_dtype_name(dtype)] = rates
    return Machine(
        cpu_model=cpu_model(),
        isa_flags=isa_flags(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        torch_version=torch.__version__,
        onednn_version=onednn_version(),
        threads=torch.get_num_threads(),
        peak_flops=peaks,
        bandwidth=bandwidth_gbs * 1e9 if bandwidth_gbs else measure_bandwidth(),
        peak_flops_source=sources,
        bandwidth_source="given" if bandwidth_gbs else Machine.bandwidth_source,
        probe_flops=probes,
        vector_type=_extension_says("vector_type"),
        bf16_dot=_extension_says("bf16_dot"),
        subnormal_cost=_extension_says("subnormal_cost"),
        streaming_stores=_extension_says("streaming_stores"),
    )


def _extension_says(name: str) -> str | None:
    """``_C.<name>()``, or None without the extension."""
    from aten_override.ops.convolution_backward import compiled

    return None if compiled.unavailable_reason() is not None else getattr(compiled.extension(), name)()


_VECTOR_TYPES = {"wide": "wide (64-byte, AVX-512 registers)", "pair": "pair (2 x 32-byte, AVX2 registers)"}
_BF16_DOTS = {"avx512_bf16": "avx512_bf16 (vdpbf16ps)", "none": "none (no AVX512_BF16: pointwise-bf16 declines)",
              "emulated": "emulated (forced)"}


def header(machine: Machine) -> str:
    """The lines every benchmark prints first: CPU, ISA, versions, threads and the measured peaks."""
    def slower(name: str) -> str:
        source = machine.peak_flops_source.get(name, "?")
        others = [f"; {probe} {rate / 1e9:.0f}" for probe, rate in machine.probe_flops.get(name, {}).items() if probe != source]
        return source + "".join(others)

    peaks = ", ".join(f"{name} {flops / 1e9:.0f} ({slower(name)})" for name, flops in machine.peak_flops.items())
    return "\n".join(
        [
            f"cpu: {machine.cpu_model}; flags: {' '.join(machine.isa_flags) or '-'}; "
            f"torch cpu capability: {machine.cpu_capability}",
            f"torch {machine.torch_version}, oneDNN {machine.onednn_version or '-'}, {machine.threads} threads; "
            f"compiled kernels' vectors: {_VECTOR_TYPES.get(machine.vector_type, 'extension not built')}; "
            f"bfloat16 dot products: {_BF16_DOTS.get(machine.bf16_dot, 'extension not built')}; "
            f"{streaming_text(machine.streaming_stores)}",
            f"FLOP peak (GFLOP/s, the faster of torch.mm 2048^2 and a 3x3 conv): {peaks} "
            "(bfloat16 / float16 roofs: at least float32's, computed in float32); "
            f"bandwidth {machine.bandwidth / 1e9:.1f} GB/s ({machine.bandwidth_source})",
            subnormal_line(machine.subnormal_cost),
        ]
    )


def streaming_text(report: dict | None) -> str:
    """How large grad_input outputs are written here (``_C.streaming_stores()``), for the header."""
    if report is None:
        return "grad_input writes: extension not built"
    if report["direct_us"] == 0:
        return "grad_input writes: ordinary stores (no streaming stores on this CPU)"
    way = "streamed (non-temporal)" if report["streaming"] else "ordinary stores"
    forced = ", forced" if report["forced"] else ""
    return (f"grad_input over 8 MiB: {way}{forced} (measured: streamed {report['streamed_us']:.0f} us, "
            f"ordinary {report['direct_us']:.0f} us)")


def subnormal_line(cost: dict | None) -> str:
    """What subnormal arithmetic costs here (``_C.subnormal_cost()``) and what the compiled backend does
    about it, in one line (the benchmarks' header, ``python -m aten_override info``)."""
    if cost is None:
        return "subnormal arithmetic: extension not built"
    ratio = cost["subnormal_us"] / cost["normal_us"]
    verdict = "rescaled" if cost["rescale"] else "served as they are"
    forced = " (forced)" if cost["forced"] else ""
    return (
        f"subnormal arithmetic: a 128x128 float32 mm on subnormal products {cost['subnormal_us']:.0f} us, on normal "
        f"ones {cost['normal_us']:.0f} us ({ratio:.0f}x): float32 calls with gradients below 2^-32 {verdict}{forced}"
    )
