"""aten_override._machine: the CPU description and the header every benchmark prints."""

import types

import pytest
import torch

from aten_override import _machine


def test_cpu_model_and_isa_flags():
    assert isinstance(_machine.cpu_model(), str) and _machine.cpu_model()
    flags = _machine.isa_flags()
    assert set(flags) <= set(_machine.ISA_FLAGS)
    assert list(flags) == [f for f in _machine.ISA_FLAGS if f in flags]  # the order of ISA_FLAGS


def test_header_with_given_peaks_measures_nothing():
    m = _machine.measure(peak_gflops=100, bandwidth_gbs=20)
    assert m.peak(torch.float32) == 100e9 and m.peak(torch.bfloat16) == 100e9
    assert m.peak(torch.float16) == 100e9  # not measured: float32's (a kernel may compute it in float32)
    text = _machine.header(m)
    assert m.cpu_model in text and f"{torch.get_num_threads()} threads" in text
    assert "float32 100 (given)" in text and "bandwidth 20.0 GB/s (given)" in text


def _machine_with(peak_flops: dict) -> "_machine.Machine":
    return _machine.Machine(cpu_model="m", isa_flags=(), cpu_capability="AVX2", torch_version="t", onednn_version=None,
                            threads=1, peak_flops=peak_flops, bandwidth=20e9)


def test_reduced_precision_roofs_are_never_below_float32s():
    """On a CPU without bfloat16 instructions torch's bfloat16 GEMM runs under 1 GFLOP/s, while the
    compiled backend computes bfloat16 in float32: the roof of a bfloat16 call is float32's peak (the
    benchmarks printed rooflines of 500-5,000% against the bfloat16 GEMM's rate)."""
    slow_bf16 = _machine_with({"float32": 94e9, "float64": 47e9, "bfloat16": 0.6e9})
    assert slow_bf16.peak(torch.bfloat16) == 94e9 and slow_bf16.peak(torch.float16) == 94e9
    assert slow_bf16.peak(torch.float32) == 94e9 and slow_bf16.peak(torch.float64) == 47e9
    amx = _machine_with({"float32": 94e9, "bfloat16": 900e9})
    assert amx.peak(torch.bfloat16) == 900e9  # a faster bfloat16 GEMM stays the roof
    nothing = _machine_with({})
    assert all(nothing.peak(d) != nothing.peak(d) for d in (torch.float32, torch.bfloat16))  # not measured: nan
    assert _machine_with({"bfloat16": 5e9}).peak(torch.bfloat16) == 5e9


def test_measure_flops_is_positive():
    rates = _machine.measure_flops(torch.float32, min_run_time=0.01, repeats=1)
    assert set(rates) == set(_machine.FLOP_PROBES) and all(r > 0 for r in rates.values())


@pytest.mark.parametrize("eighth_s, autoranged", [(0.5, False), (0.001, True)])
def test_a_probe_slower_than_slow_call_s_is_timed_by_one_call_on_an_eighth(monkeypatch, eighth_s, autoranged):
    """bfloat16 torch.mm 2048x2048 on a CPU without bfloat16 instructions takes 20-50 s a call: where one
    call on an eighth of the problem shows the whole would take over slow_call_s, that eighth's rate is
    the probe's; else the whole problem is autoranged ``repeats`` times."""
    calls = []

    class Timer:
        def __init__(self, stmt, globals, num_threads):
            self.rows = globals["a"].shape[0]

        def timeit(self, number):
            calls.append(("timeit", self.rows, number))
            return types.SimpleNamespace(median=eighth_s)

        def blocked_autorange(self, min_run_time):
            calls.append(("autorange", self.rows, min_run_time))
            return types.SimpleNamespace(median=eighth_s * 4)

    monkeypatch.setattr(_machine.benchmark, "Timer", Timer)
    monkeypatch.setattr(_machine, "FLOP_PROBES", {"mm": ("torch.mm(a, b)", ((64, 2), (2, 2)), 64.0)})
    rates = _machine.measure_flops(torch.bfloat16, min_run_time=0.1, repeats=3, slow_call_s=1.0)
    if autoranged:  # 0.001 s an eighth: the whole ~0.008 s
        assert calls == [("timeit", 8, 1)] + [("autorange", 64, 0.1)] * 3 and rates == {"mm": 64.0 / (eighth_s * 4)}
    else:  # 0.5 s an eighth: the whole ~4 s
        assert calls == [("timeit", 8, 1)] and rates == {"mm": 64.0 / 8 / eighth_s}


def test_header_shows_every_probe_of_a_measured_peak():
    """The slower probe is printed beside the peak (MKL's float32 torch.mm runs at half an AMD CPU's
    AVX-512 peak: the cap of every kernel that calls it)."""
    m = _machine.Machine(cpu_model="cpu", isa_flags=(), cpu_capability="AVX512", torch_version="t", onednn_version=None,
                         threads=1, peak_flops={"float32": 199e9}, bandwidth=37e9,
                         peak_flops_source={"float32": "conv3x3"},
                         probe_flops={"float32": {"mm": 96e9, "conv3x3": 199e9}})
    assert "float32 199 (conv3x3; mm 96)" in _machine.header(m)


def test_header_says_what_the_compiled_kernels_vectors_are():
    """Which register blocks the compiled kernels ran with (AVX-512's or AVX2's) is part of the machine
    a benchmark ran on; the measured header gives the extension's own answer."""
    from aten_override.ops.convolution_backward import compiled

    m = _machine.measure(peak_gflops=100, bandwidth_gbs=20)
    if compiled.unavailable_reason() is None:
        assert m.vector_type == compiled.extension().vector_type()
    else:
        assert m.vector_type is None
    text = _machine.header(m)
    expected = {"wide": "wide (64-byte, AVX-512 registers)", "pair": "pair (2 x 32-byte, AVX2 registers)",
                None: "extension not built"}[m.vector_type]
    assert f"compiled kernels' vectors: {expected}" in text


def test_header_says_which_bfloat16_dot_products_the_compiled_kernels_run():
    """Whether pointwise-bf16 ran on the CPU's AVX512_BF16 instruction (or declined for want of it) is
    part of the machine a bfloat16 benchmark ran on."""
    from aten_override.ops.convolution_backward import compiled

    m = _machine.measure(peak_gflops=100, bandwidth_gbs=20)
    assert m.bf16_dot == (None if compiled.unavailable_reason() else compiled.extension().bf16_dot())
    expected = {"avx512_bf16": "avx512_bf16 (vdpbf16ps)", "none": "none (no AVX512_BF16: pointwise-bf16 declines)",
                None: "extension not built"}[m.bf16_dot]
    assert f"bfloat16 dot products: {expected}" in _machine.header(m)


def test_header_says_how_large_grad_input_outputs_are_written():
    """Whether large grad_input outputs were streamed past the caches (measured per machine: the slower
    way on a Zen 3 VM, where a constant had chosen it) is part of the machine a benchmark ran on."""
    report = {"streaming": False, "direct_us": 5210.0, "streamed_us": 6120.0, "forced": False}
    m = _machine.Machine(cpu_model="cpu", isa_flags=(), cpu_capability="AVX2", torch_version="t", onednn_version=None,
                         threads=1, peak_flops={"float32": 94e9}, bandwidth=17e9, streaming_stores=report)
    assert "grad_input over 8 MiB: ordinary stores (measured: streamed 6120 us, ordinary 5210 us)" in _machine.header(m)
    m.streaming_stores = {**report, "streaming": True, "forced": True}
    assert "grad_input over 8 MiB: streamed (non-temporal), forced (measured: streamed 6120 us" in _machine.header(m)
    m.streaming_stores = {"streaming": False, "direct_us": 0.0, "streamed_us": 0.0, "forced": False}
    assert "grad_input writes: ordinary stores (no streaming stores on this CPU)" in _machine.header(m)
    m.streaming_stores = None
    assert "grad_input writes: extension not built" in _machine.header(m)
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is None:
        assert _machine.measure(peak_gflops=100, bandwidth_gbs=20).streaming_stores == compiled.extension().streaming_stores()


def test_header_says_what_subnormal_arithmetic_costs_and_whether_calls_are_rescaled():
    """Whether underflowing float32 calls were rescaled (the machine pays ~100x for subnormal arithmetic
    on Intel CPUs: random-init EfficientNet-B0's step) is part of the machine a benchmark ran on."""
    cost = {"normal_us": 28.0, "subnormal_us": 4684.0, "rescale": True, "forced": False}
    m = _machine.Machine(cpu_model="cpu", isa_flags=(), cpu_capability="AVX512", torch_version="t", onednn_version=None,
                         threads=1, peak_flops={"float32": 199e9}, bandwidth=37e9, subnormal_cost=cost)
    assert "subnormal products 4684 us, on normal ones 28 us (167x): float32 calls with gradients below 2^-32 rescaled" \
        in _machine.header(m)
    m.subnormal_cost = {"normal_us": 28.0, "subnormal_us": 30.0, "rescale": False, "forced": False}
    assert "(1x): float32 calls with gradients below 2^-32 served as they are" in _machine.header(m)
    m.subnormal_cost = None
    assert "subnormal arithmetic: extension not built" in _machine.header(m)
    from aten_override.ops.convolution_backward import compiled

    if compiled.unavailable_reason() is None:
        assert _machine.measure(peak_gflops=100, bandwidth_gbs=20).subnormal_cost == compiled.extension().subnormal_cost()
