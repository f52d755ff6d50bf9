r"""The compiled backend's measured kernel choice (``enable("compiled", autotune=...)``).

What is asserted is the choice and its bookkeeping, never a wall time: native wins when every
candidate is slower (a fake slow candidate); a wrong candidate never wins, however fast (a fake one
returning zeros); the winner's results are native's; a signature is tuned once, also from two
threads at once; deterministic mode and ``autotune=False`` never time; a results file makes a second
process skip tuning, and a stale or corrupt one is ignored with a message; the tracer and
``stats()`` name the kernel that ran.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

import aten_override
from torch.testing._internal.common_utils import DeterministicGuard
from aten_override import autotune
from aten_override.ops.convolution_backward import compiled
from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs
from aten_override.testing.comparison import call_native, check_against_native

from ...backend_params import run_python

pytestmark = pytest.mark.skipif(compiled.unavailable_reason() is not None, reason=str(compiled.unavailable_reason()))

_OP = torch.ops.aten.convolution_backward.default


def depthwise_call(channels: int = 32, size: int = 20, mask=(True, True, True)) -> tuple:
    """A depthwise 3x3 layer: candidates native and the depthwise kernel (and the GEMM one)."""
    g = torch.Generator().manual_seed(channels * 1000 + size)
    x = torch.randn(2, channels, size, size, generator=g)
    w = torch.randn(channels, 1, 3, 3, generator=g)
    go = torch.randn(2, channels, size, size, generator=g)
    return (go, x, w, [channels], [1, 1], [1, 1], [1, 1], False, [0, 0], channels, list(mask))


@pytest.fixture(autouse=True)
def fresh_table():
    """Every test starts from an empty results table and no test candidate, and leaves it so. Calls are
    never served rescaled here (test_subnormal_rescale.py): the tuning of underflowing calls is tested
    on their own values."""
    ext = compiled.extension()
    autotune.clear()
    aten_override.reset_stats()
    ext.set_subnormal_rescale(False)
    yield
    ext.set_subnormal_rescale(None)
    ext.set_test_candidate("off")
    autotune.clear()


def assert_parts_timed(times_us: dict) -> None:
    """A call asking for both gradients: when two or more candidates survive the cutoff (timing
    decides which), each of them is timed on each gradient alone; else no part is timed."""
    alive = [name for name in times_us if ":" not in name]
    parts = {name for name in times_us if ":" in name}
    if len(alive) >= 2:
        assert parts == {f"{part}:{name}" for part in ("grad_input", "grad_weight") for name in alive}, times_us
    else:
        assert not parts, times_us


def tuned_entry(args: tuple) -> dict:
    (entry,) = [e for e in autotune.entries() if e["tune_us"] > 0]
    return entry


def test_tunes_once_and_reuses_the_winner():
    args = depthwise_call()
    with aten_override.enable("compiled", autotune=True):
        first = _OP(*args)
        second = _OP(*args)
    stats = aten_override.stats()
    assert stats["compiled_tuning"]["signatures"] == 1 and stats["compiled_tuning"]["us"] > 0, stats
    assert sum(stats["compiled_kernels"].values()) == 2, stats
    entry = tuned_entry(args)
    assert set(entry["times_us"]) >= {"native"} or "native" in entry["rejected"], entry
    assert {"native", "depthwise-plane"} <= set(entry["times_us"]) | set(entry["rejected"]), entry
    native = call_native(args)
    for ours in (first, second):
        check_against_native(ours, native, output_mask=args[-1])


def test_native_wins_when_every_candidate_is_slower():
    """A float16 dense dilated layer: no kernel of ours applies (winograd: undilated only; the GEMM
    kernels: float16 not), so the candidates are native and the fake slow one (native's result, then
    as long again busy): native wins."""
    compiled.extension().set_test_candidate("slow")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 8, 10, 10, generator=g).half(), torch.randn(8, 8, 3, 3, generator=g).half()
    args = (torch.randn(2, 8, 10, 10, generator=g).half(), x, w, [8], [1, 1], [2, 2], [2, 2], False, [0, 0], 1,
            [True, True, True])
    with aten_override.enable("compiled", autotune=True):
        _OP(*args)
    entry = tuned_entry(args)
    assert entry["kernel"] == "native", entry
    whole = {name for name in set(entry["times_us"]) | set(entry["rejected"]) if ":" not in name}
    assert whole == {"native", "test"}, entry
    assert_parts_timed(entry["times_us"])


@pytest.fixture
def flush_denormal():
    """``torch.set_flush_denormal(True)`` (FTZ/DAZ) for the test, restored after. MXCSR is per thread
    and the test runs at one thread (a pool's worker threads keep their own)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no FTZ/DAZ")
    yield
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "scale,flush", [(1.0, False), (1e-6, False), (1e-36, True), (1e-41, False)],
    ids=["unit", "tiny", "underflow under FTZ", "subnormal"],
)
def test_a_wrong_candidate_never_wins(scale, flush, request):
    """The fake 'wrong' candidate returns zeros at once: the fastest, and rejected as wrong, also on
    the tiny gradients of a mean-reduced loss (the check is relative to the result's own scale) and on
    gradients at the bottom of float32's range, where results within underflow's error of native's
    are rechecked on the call rescaled to unit magnitude (zeros fail there); subnormal values need FTZ
    off (under it, they are zeros)."""
    if flush:
        request.getfixturevalue("flush_denormal")
    compiled.extension().set_test_candidate("wrong")
    go, *rest = depthwise_call(16, 12)
    args = (go * scale, *rest)
    with aten_override.enable("compiled", autotune=True):
        ours = _OP(*args)
    entry = tuned_entry(args)
    assert "test" not in entry["kernel"].split("+") and entry["rejected"]["test"].startswith("wrong:"), entry
    # the rescaled call's factor (2^133 at 1e-41) is out of float32's range: computed in float64, no NaN
    assert "nan" not in entry["rejected"]["test"], entry
    # its zeros are wrong for each gradient alone too: never part of a split
    assert not any(name.endswith(":test") for name in entry["times_us"]), entry
    check_against_native(ours, call_native(args), output_mask=args[-1])


def test_a_wrong_candidate_never_wins_where_the_call_cannot_be_rescaled_exactly(flush_denormal):
    """A tensor whose values span more than float32's range (1e21 and 1e-19 in one grad_output, an
    input of zeros and 4e-19) cannot be rescaled to unit magnitude without rounding its small values
    to zero, and native's result on such a copy is zeros too: the fake zeros candidate must stay
    rejected (it won, and then served zeros for ordinary calls of the signature, when the copy was
    taken as exact)."""
    compiled.extension().set_test_candidate("wrong")
    c, size = 16, 12
    g = torch.Generator().manual_seed(0)
    go = torch.zeros(2, c, size, size)
    go[0, :, 6, 6] = 1e21
    go[1] = torch.randn(c, size, size, generator=g) * 1e-19
    x = torch.zeros(2, c, size, size)
    x[1] = torch.randn(c, size, size, generator=g) * 4e-19
    w = torch.randn(c, 1, 3, 3, generator=g)
    conv = ([1, 1], [1, 1], [1, 1], False, [0, 0], c, [False, True, False])
    args = (go, x, w, None, *conv)
    ordinary = (torch.randn(2, c, size, size, generator=g), torch.randn(2, c, size, size, generator=g), w, None, *conv)
    with aten_override.enable("compiled", autotune=True):
        _OP(*args)
        ours = _OP(*ordinary)
    entry = tuned_entry(args)
    assert "test" not in entry["kernel"].split("+"), entry
    assert "cannot be rescaled exactly" in entry["rejected"]["test"], entry
    check_against_native(ours, call_native(ordinary), output_mask=conv[-1])


def test_an_all_zero_result_does_not_pin_the_signature():
    """An all-zero grad_output (below a zero-initialised head, on the first step) makes every result
    zeros: the fake zeros candidate cannot be told from a right kernel, so the call is served but its
    signature is tuned again on the next call, where the zeros candidate is rejected."""
    compiled.extension().set_test_candidate("wrong")
    go, *rest = depthwise_call(16, 12)
    zero = (torch.zeros_like(go), *rest)
    with aten_override.enable("compiled", autotune=True):
        served = _OP(*zero)
        assert not [e for e in autotune.entries() if e["tune_us"] > 0], autotune.entries()
        ours = _OP(go, *rest)
    check_against_native(served, call_native(zero), output_mask=rest[-1])
    entry = tuned_entry((go, *rest))
    assert "test" not in entry["kernel"].split("+") and entry["rejected"]["test"].startswith("wrong:"), entry
    check_against_native(ours, call_native((go, *rest)), output_mask=rest[-1])


@pytest.mark.parametrize("layer", ["depthwise 5x5", "pointwise"])
def test_underflowing_gradients_do_not_reject_right_candidates(layer, flush_denormal):
    """Gradients at the bottom of float32's range under FTZ/DAZ (random-init EfficientNet-B0's
    squeeze-excite gradients are ~1e-37): each kernel sums in its own order and flushes different
    partial sums, so its grad_weight differs from native's by far more than 1e-4 of its magnitude
    (up to ~4%). Every candidate was rejected as wrong and native served these layers at 5-16x our
    kernels' time. Differences that underflow explains pass when the kernel matches native on the call
    rescaled out of the underflow range; the served results are still checked against native here."""
    g = torch.Generator().manual_seed(5)
    if layer == "pointwise":
        x, w = torch.randn(4, 24, 14, 14, generator=g), torch.randn(48, 24, 1, 1, generator=g)
        go = torch.randn(4, 48, 14, 14, generator=g) * 1e-37
        args = (go, x, w, [48], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    else:
        x, w = torch.randn(4, 40, 14, 14, generator=g), torch.randn(40, 1, 5, 5, generator=g)
        go = torch.randn(4, 40, 14, 14, generator=g) * 1e-37
        args = (go, x, w, [40], [1, 1], [2, 2], [1, 1], False, [0, 0], 40, [True, True, True])
    unit = (go * 1e37, *args[1:])  # the same signature: served by the tuned choice
    with aten_override.enable("compiled", autotune=True):
        ours = _OP(*args)
        ours_unit = _OP(*unit)
    check_against_native(ours_unit, call_native(unit), output_mask=args[-1])
    entry = tuned_entry(args)
    wrong = {name: why for name, why in entry["rejected"].items() if why.startswith("wrong")}
    assert not wrong, entry
    assert {name for name in entry["times_us"] if ":" not in name} - {"native"}, entry  # ours competed
    native = call_native(args)
    for i, (o, n) in enumerate(zip(ours, native)):
        # within underflow's error: at most grad_output.numel() flushed terms of < finfo.tiny each
        torch.testing.assert_close(o, n, rtol=1e-4, atol=go.numel() * 2 * torch.finfo(torch.float32).tiny)
        assert o.stride() == n.stride(), i


def test_concurrent_first_calls_tune_once():
    args = depthwise_call(24, 16)
    results, errors = [None, None], []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            barrier.wait()
            results[i] = _OP(*args)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with aten_override.enable("compiled", autotune=True):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert aten_override.stats()["compiled_tuning"]["signatures"] == 1
    native = call_native(args)
    for r in results:
        check_against_native(r, native, output_mask=args[-1])


@pytest.mark.parametrize("how", ["deterministic", "autotune=False"])
def test_static_table_never_times(how):
    args = depthwise_call(8, 10)
    if how == "deterministic":
        with DeterministicGuard(True), aten_override.enable("compiled", autotune=True):
            _OP(*args)
    else:
        with aten_override.enable("compiled", autotune=False):
            _OP(*args)
    stats = aten_override.stats()
    assert "compiled_tuning" not in stats and autotune.entries() == [], stats
    assert stats["compiled_kernels"] == {"depthwise-lanes": 1}, stats  # the table's choice (a 10x10 plane: channels in lanes)


def test_signature_includes_layout_and_threads():
    args = depthwise_call(8, 10)
    cl = tuple(t.contiguous(memory_format=torch.channels_last) if i < 3 else t for i, t in enumerate(args))
    threads = torch.get_num_threads()
    with aten_override.enable("compiled", autotune=True):
        _OP(*args)
        _OP(*cl)
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            _OP(*args)
        finally:
            torch.set_num_threads(threads)
    assert aten_override.stats()["compiled_tuning"]["signatures"] == 3


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif("clflushopt" not in _cpu_flags(), reason="no clflushopt (x86 Linux): tuning flushes the caches with a buffer")
def test_tuning_a_small_call_evicts_its_tensors_instead_of_writing_a_cache_sized_buffer(tmp_path):
    """Each timed run of a tuning starts with the call's tensors out of the caches. That used to be a
    buffer of twice the last-level cache (32-128 MiB) written before every run: ~10 ms a run however
    small the call (EfficientNet-B0's first bfloat16 step took 22 s against native's 1.9, and its
    squeeze-excite layers, tuned again while their gradients underflow to zero, made steps 2 and 3
    1.8-2.8x native's). Now only the call's own lines are evicted: tuning a small call touches no
    such buffer (the child's peak resident memory grows by far less than 32 MiB), still tunes, and
    evicts the call's tensors before each of its timed runs (``compiled_tuning["evicted_bytes"]``)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import json, resource, torch, aten_override\n"
        "from tests.ops.convolution_backward.test_autotune import depthwise_call\n"
        "args = depthwise_call()\n"
        "torch.ops.aten.convolution_backward.default(*args)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "with aten_override.enable('compiled', autotune=True):\n"
        "    torch.ops.aten.convolution_backward.default(*args)\n"
        "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(json.dumps({'grown_kib': grown, 'entries': aten_override.autotune.entries(),\n"
        "                  'tuning': aten_override.stats()['compiled_tuning'], 'call_bytes': sum(t.nbytes for t in args[:3])}))\n"
    )
    child = run_python([str(script)], ATEN_OVERRIDE_AUTOTUNE="1")
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.splitlines()[-1])
    assert len(out["entries"]) == 1 and len(out["entries"][0]["times_us"]) >= 2, out["entries"]
    assert out["grown_kib"] < 16 * 1024, out
    runs = 3  # at least: native's first timed run and each candidate's, in the first round
    assert out["tuning"]["evicted_bytes"] >= runs * out["call_bytes"], out


def test_results_file_makes_a_second_process_skip_tuning(tmp_path):
    """The second process takes the first one's choice from the file and tunes nothing; writing the
    file back on leaving, it keeps the measurements the first one recorded (a new user found every
    reused file's times_us, rejected and tune_us emptied: the C++ table keeps only the kernel)."""
    path = tmp_path / "tune.json"
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys, torch, aten_override\n"
        "from tests.ops.convolution_backward.test_autotune import depthwise_call\n"
        "with aten_override.enable('compiled', autotune=sys.argv[1]):\n"
        "    torch.ops.aten.convolution_backward.default(*depthwise_call())\n"
        "print(json.dumps(aten_override.stats()))\n"
    )
    first = run_python([str(script), str(path)], ATEN_OVERRIDE_AUTOTUNE="1")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1])["compiled_tuning"]["signatures"] == 1
    data = json.loads(path.read_text())
    assert data["header"] == autotune.header() and len(data["entries"]) == 1
    second = run_python([str(script), str(path)], ATEN_OVERRIDE_AUTOTUNE="1")
    assert second.returncode == 0, second.stderr
    stats = json.loads(second.stdout.splitlines()[-1])
    assert "compiled_tuning" not in stats, stats
    assert stats["compiled_kernels"] == {data["entries"][0]["kernel"]: 1}, stats
    assert data["entries"][0]["times_us"] and data["entries"][0]["tune_us"] > 0, data
    assert json.loads(path.read_text())["entries"] == data["entries"]


def test_re_entering_with_the_same_results_file_takes_its_entries_without_a_warning(tmp_path, caplog):
    """enable(autotune=path) reads the file on every entry, so a process's second block finds the
    signatures it tuned (or read) already in the table. They count as taken, with the table's choice
    kept: no warning that they were "not usable" (a loop entering the block per step warned at every
    step), and nothing is tuned again. An entry the file names differently (edited by hand) keeps the
    choice this process measured."""
    args = depthwise_call(8, 10)
    path = tmp_path / "tune.json"
    with caplog.at_level(logging.WARNING, logger="aten_override"):
        for _ in range(3):
            with aten_override.enable("compiled", autotune=path):
                ours = _OP(*args)
        (entry,) = autotune.entries()
        data = json.loads(path.read_text())
        other = "depthwise-plane" if entry["kernel"] != "depthwise-plane" else "depthwise-lanes"
        data["entries"][0]["kernel"] = other
        path.write_text(json.dumps(data))
        assert autotune.load(path) == 1
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert [e["kernel"] for e in autotune.entries()] == [entry["kernel"]]
    assert aten_override.stats()["compiled_tuning"]["signatures"] == 1
    check_against_native(ours, call_native(args), output_mask=args[-1])


@pytest.mark.parametrize("damage", ["stale cpu_model", "stale build_id", "corrupt"])
def test_stale_or_corrupt_results_file_is_ignored_with_a_message(tmp_path, caplog, damage):
    args = depthwise_call(8, 10)
    path = tmp_path / "tune.json"
    with aten_override.enable("compiled", autotune=path):
        _OP(*args)
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 1
    if damage == "corrupt":
        path.write_text(path.read_text()[:40])
    else:
        data["header"][damage.split()[1]] = "elsewhere"
        path.write_text(json.dumps(data))
    autotune.clear()
    with caplog.at_level(logging.WARNING, logger="aten_override.autotune"):
        assert autotune.load(path) == 0
    assert autotune.entries() == []
    expected = "unreadable" if damage == "corrupt" else f"measured elsewhere ({damage.split()[1]}"
    assert any(expected in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    info = autotune.file_info(path)
    assert not info["valid"] and info["why"]


def test_setting_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.ENV, "0")
    assert autotune.setting() == autotune.Setting(False)
    monkeypatch.setenv(autotune.ENV, str(tmp_path / "t.json"))
    assert autotune.setting() == autotune.Setting(True, tmp_path / "t.json")
    monkeypatch.delenv(autotune.ENV)
    assert autotune.setting() == autotune.Setting(True)
    with pytest.raises(TypeError, match="autotune must be"):
        autotune.setting(3)


def test_enable_restores_the_previous_setting():
    ext = compiled.extension()
    ext.set_autotune(False)
    with aten_override.enable("compiled", autotune=True):
        assert ext.autotune()
        with aten_override.enable("compiled", autotune=False):
            assert not ext.autotune()
        assert ext.autotune()
    assert not ext.autotune()


def test_tracer_names_the_kernel_and_the_tuning():
    args = depthwise_call(16, 8)
    with aten_override.enable("compiled", autotune=True), aten_override.trace() as t:
        _OP(*args)
        _OP(*args)
    first, second = t.calls
    assert first.kernel.startswith("compiled/") and first.tuning is not None
    assert "native" in first.tuning["times_us"] or "native" in first.tuning["rejected"]
    assert second.kernel == first.kernel and second.tuning is None
    assert f"backend={first.kernel}" in t.format() and "tuned: " in t.format()


def test_tuning_never_serves_a_masked_output():
    for mask in ([True, False, False], [False, True, True]):
        args = depthwise_call(16, 9, mask)
        with aten_override.enable("compiled", autotune=True):
            ours = _OP(*args)
        check_against_native(ours, call_native(args), output_mask=mask)


def test_candidates_follow_the_layer():
    """Grouped with few channel pairs: the direct kernel competes; depthwise: the depthwise kernel."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 32, 12, 12, generator=g), torch.randn(32, 4, 3, 3, generator=g)
    go = torch.randn(2, 32, 12, 12, generator=g)
    args = (go, x, w, [32], [1, 1], [1, 1], [1, 1], False, [0, 0], 8, [True, True, True])
    assert compiled.layer_class(ConvolutionBackwardArgs(*args)) == "grouped"
    with aten_override.enable("compiled", autotune=True):
        _OP(*args)
    entry = tuned_entry(args)
    assert "direct" in set(entry["times_us"]) | set(entry["rejected"]), entry


def test_profiler_range_names_the_kernel():
    """While tracing, each call is an ``aten_override::convolution_backward[compiled/<kernel>]`` range:
    ``compiled/tuning`` on the call that tunes its signature, then the kernel it chose."""
    args = depthwise_call(16, 8)
    with aten_override.enable("compiled", autotune=True), aten_override.trace() as t:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _OP(*args)
            _OP(*args)
        planned = compiled.planned_kernel(ConvolutionBackwardArgs(*args))  # the tuned choice (autotune on here)
    names = [e.name for e in prof.events() if e.name.startswith("aten_override::")]
    kernel = t.calls[1].kernel
    assert names == ["aten_override::convolution_backward[compiled/tuning]", f"aten_override::convolution_backward[{kernel}]"]
    assert planned == kernel.removeprefix("compiled/")


def _dense_call(mask=(True, True, True)) -> tuple:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 6, 9, 9, generator=g), torch.randn(6, 6, 3, 3, generator=g)
    return (torch.randn(2, 6, 9, 9, generator=g), x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, list(mask))


def _write_entries(path, args, choice):
    """A results file (valid header) whose entry for the signature of ``args`` names ``choice``."""
    with aten_override.enable("compiled", autotune=path):
        _OP(*args)
    data = json.loads(path.read_text())
    for entry in data["entries"]:
        entry["kernel"] = choice
    path.write_text(json.dumps(data))
    autotune.clear()
    aten_override.reset_stats()


@pytest.mark.parametrize("field,value", [(None, None), ("times_us", [1.0]), ("times_us", {"native": "fast"}),
                                         ("rejected", {"native": 3}), ("tune_us", "slow")])
def test_a_results_file_entry_keeps_its_measurements_or_is_taken_without_malformed_ones(tmp_path, field, value):
    """An entry loaded from a file is written back with the measurements the file recorded; where those
    are not of the form the file is written in, the entry's kernel is still taken (no tuning) and it is
    written back with empty ones."""
    args = _dense_call()
    path = tmp_path / "tune.json"
    _write_entries(path, args, "winograd")
    data = json.loads(path.read_text())
    (recorded,) = data["entries"]
    assert recorded["times_us"] and recorded["tune_us"] > 0, recorded
    if field is not None:
        recorded[field] = value
        path.write_text(json.dumps(data))
    with aten_override.enable("compiled", autotune=path):
        _OP(*args)
    stats = aten_override.stats()
    assert "compiled_tuning" not in stats and stats["compiled_kernels"] == {"winograd": 1}, stats
    (written,) = json.loads(path.read_text())["entries"]
    if field is None:
        assert written == recorded
    else:
        assert written == {**recorded, "times_us": {}, "rejected": {}, "tune_us": 0.0}


@pytest.mark.parametrize(
    "claimed",
    ["depthwise-lanes", "gemm-kn2row", "grouped-lanes", "zeros", "sum", "upcast", "test", "gemm-kn2row+native",
     "native+depthwise-lanes"],
)
def test_a_tampered_results_file_never_runs_a_kernel_that_cannot_serve_the_call(tmp_path, claimed):
    """A results file (valid header) naming, for a dense 3x3 layer, a kernel that cannot compute it
    (gemm-kn2row and grouped-lanes assert, zeros returns zeros), alone or in a split: the table decides."""
    args = _dense_call()
    path = tmp_path / "tune.json"
    _write_entries(path, args, claimed)
    with aten_override.enable("compiled", autotune=path):
        assert compiled.planned_kernel(ConvolutionBackwardArgs(*args)) == "native"
        ours = _OP(*args)
    stats = aten_override.stats()
    assert "compiled_tuning" not in stats and stats["compiled_kernels"] == {"native": 1}, stats
    check_against_native(ours, call_native(args), output_mask=args[-1])


@pytest.mark.parametrize("choice", ["gemm-im2col+native", "native+gemm-im2col", "winograd", "winograd+native",
                                    "native+winograd"])
def test_a_split_from_a_results_file_serves_each_gradient_from_its_kernel(tmp_path, choice):
    """A split (grad_input and grad_bias from one kernel, grad_weight from the other) is a choice like
    any other: named in the file, in stats() and the tracer, and its results are native's. Also winograd
    (whole or in a split) through enable(): the registered kernel serves the dense 3x3 call with it."""
    args = _dense_call()
    path = tmp_path / "tune.json"
    _write_entries(path, args, choice)
    with aten_override.enable("compiled", autotune=path), aten_override.trace(log=False) as t:
        assert compiled.planned_kernel(ConvolutionBackwardArgs(*args)) == choice
        ours = _OP(*args)
    stats = aten_override.stats()
    assert "compiled_tuning" not in stats and stats["compiled_kernels"] == {choice: 1}, stats
    assert t.calls[0].kernel == f"compiled/{choice}"
    check_against_native(ours, call_native(args), output_mask=args[-1])


@pytest.mark.parametrize("choice", ["pointwise-fused", "pointwise-fused+native", "gemm-im2col+pointwise-fused"])
def test_pointwise_fused_from_a_results_file_serves_a_1x1_call(tmp_path, choice):
    """pointwise-fused, whole or in a split, through enable(): the registered kernel serves a 1x1
    call with it (stats and tracer say so) and its results are native's."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 24, 11, 13, generator=g), torch.randn(40, 24, 1, 1, generator=g)
    args = (torch.randn(3, 40, 11, 13, generator=g), x, w, [40], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
            [True, True, True])
    path = tmp_path / "tune.json"
    _write_entries(path, args, choice)
    with aten_override.enable("compiled", autotune=path), aten_override.trace(log=False) as t:
        ours = _OP(*args)
    assert aten_override.stats()["compiled_kernels"] == {choice: 1}
    assert t.calls[0].kernel == f"compiled/{choice}"
    check_against_native(ours, call_native(args), output_mask=args[-1])


@pytest.mark.parametrize("choice", ["native+nonsense", "native+native", "+native", "gemm-im2col+"])
def test_a_malformed_split_entry_is_skipped_with_a_message(tmp_path, caplog, choice):
    """Not a choice at all: the entry is not loaded (a warning says so) and the call tunes afresh."""
    args = _dense_call()
    path = tmp_path / "tune.json"
    _write_entries(path, args, choice)
    with caplog.at_level(logging.WARNING, logger="aten_override"):
        with aten_override.enable("compiled", autotune=path):
            ours = _OP(*args)
    assert "were not usable" in caplog.text, caplog.text
    assert aten_override.stats()["compiled_tuning"]["signatures"] == 1
    check_against_native(ours, call_native(args), output_mask=args[-1])


def test_tuning_a_call_asking_for_both_gradients_times_each_part():
    """The tuning call's record has every candidate's time on each gradient alone; the choice is a
    whole kernel or a split of two different ones, and its results are native's."""
    args = _dense_call()
    with aten_override.enable("compiled", autotune=True), aten_override.trace(log=False) as t:
        ours = _OP(*args)
    assert_parts_timed(t.calls[0].tuning["times_us"])
    chosen = t.calls[0].kernel.removeprefix("compiled/")
    parts = chosen.split("+")
    # the candidates of a dense 3x3 stride-1 layer; a split names two different ones
    assert set(parts) <= {"native", "gemm-im2col", "winograd"} and len(set(parts)) == len(parts) <= 2, chosen
    check_against_native(ours, call_native(args), output_mask=args[-1])


@pytest.mark.parametrize("layer", ["dense 3x3", "depthwise", "one-channel 1-D", "3x1x1"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_after_tuning_get_natives_results(layer, bad):
    """Tuned on finite values, then the same signature with an inf / NaN in grad_output: whichever
    kernel won (our kernels multiply padding zeros that native skips), the result is native's,
    NaN and inf where native has them."""
    g = torch.Generator().manual_seed(3)
    shapes = {
        "dense 3x3": ((2, 8, 10, 10), (8, 8, 3, 3), 1, [1, 1]),
        "depthwise": ((2, 8, 10, 10), (8, 1, 3, 3), 8, [1, 1]),
        "one-channel 1-D": ((2, 1, 40), (8, 1, 5), 1, [2]),
        "3x1x1": ((2, 8, 6, 5, 5), (8, 8, 3, 1, 1), 1, [1, 0, 0]),
    }
    xs, ws, groups, padding = shapes[layer]
    x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g)
    d = len(xs) - 2
    go = torch.randn(xs[0], ws[0], *xs[2:], generator=g)
    if layer == "one-channel 1-D":
        go = torch.randn(2, 8, 40, generator=g)

    def call(grad_output):
        return (grad_output, x, w, [ws[0]], [1] * d, padding, [1] * d, False, [0] * d, groups, [True, True, True])

    with aten_override.enable("compiled", autotune=True):
        _OP(*call(go))
        bad_go = go.clone()
        bad_go.view(-1)[0] = bad
        ours = _OP(*call(bad_go))
    native = call_native(call(bad_go))
    for o, n in zip(ours, native):
        torch.testing.assert_close(o, n, equal_nan=True, rtol=1e-4, atol=1e-4)


_NON_FINITE_LAYERS = {
    # name: (input, weight, groups, stride, padding, dtype, the kernel of ours that serves it)
    "depthwise": ((2, 8, 12, 12), (8, 1, 3, 3), 8, [1, 1], [1, 1], torch.float32, "depthwise-plane"),
    "depthwise bfloat16": ((2, 16, 12, 12), (16, 1, 3, 3), 16, [2, 2], [1, 1], torch.bfloat16, "depthwise-lanes"),
    "grouped": ((2, 8, 17, 17), (8, 4, 3, 3), 2, [2, 2], [1, 1], torch.float32, "direct"),
    "one-channel 1-D": ((2, 1, 400), (8, 1, 10), 1, [5], [0], torch.float32, "direct"),
    "dense 3x3": ((2, 8, 10, 10), (8, 8, 3, 3), 1, [1, 1], [1, 1], torch.float32, "winograd"),
    "dense 3x3 im2col": ((2, 8, 10, 10), (8, 8, 3, 3), 1, [2, 2], [1, 1], torch.float32, "gemm-im2col"),
    "pointwise": ((2, 16, 10, 10), (32, 16, 1, 1), 1, [1, 1], [0, 0], torch.float32, "pointwise-fused"),
    "3x1x1": ((2, 8, 6, 5, 5), (8, 8, 3, 1, 1), 1, [1, 1, 1], [1, 0, 0], torch.float32, "kn2row-planes"),
    "3x1x1 bfloat16": ((2, 8, 6, 5, 5), (8, 8, 3, 1, 1), 1, [2, 1, 1], [1, 0, 0], torch.bfloat16, "gemm-kn2row"),
    "1-D": ((2, 8, 40), (8, 8, 3), 1, [2], [1], torch.float32, "kn2row-lanes"),
}


def _non_finite_call(layer: str, where: str | None, bad: float) -> tuple:
    """A call of `layer` (_NON_FINITE_LAYERS) with `bad` in `where` (an operand's name) or finite."""
    xs, ws, groups, stride, padding, dtype, _ = _NON_FINITE_LAYERS[layer]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(xs, generator=g).to(dtype)
    w = torch.randn(ws, generator=g).to(dtype)
    d = len(xs) - 2
    out = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(xs[2:], ws[2:], stride, padding)]
    go = torch.randn(xs[0], ws[0], *out, generator=g).to(dtype)
    operands = {"grad_output": go, "input": x}
    if where is not None:
        operands[where].view(-1)[operands[where].numel() // 2] = bad
    return (go, x, w, [ws[0]], stride, padding, [1] * d, False, [0] * d, groups, [True, True, True])


@pytest.mark.parametrize("where", ["grad_output", "input"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("layer", list(_NON_FINITE_LAYERS))
def test_a_signature_whose_call_was_declined_sends_non_finite_calls_to_native_unoffered(tmp_path, layer, bad, where):
    """An inf / NaN in grad_output or input makes grad_weight non-finite, and each kernel of ours
    declines such a call (before computing it, or after, where native then computes the call again:
    twice its time). The next calls of that signature with an inf / NaN go to native without running our kernel
    (``skipped``); a finite call runs our kernel again and clears the mark, so the non-finite call
    after it is offered again. The kernel is named by a results file (the table's kernel for the
    first layer, run without one too); every result is native's, NaN and inf where native has them."""
    kernel = _NON_FINITE_LAYERS[layer][-1]
    calls = {"bad": _non_finite_call(layer, where, bad), "finite": _non_finite_call(layer, None, bad)}
    natives = {name: call_native(args) for name, args in calls.items()}
    assert natives["bad"][1].isfinite().logical_not().any()  # a case that matters: grad_weight is not finite
    modes = {"file": tmp_path / "tune.json"}
    if layer == "depthwise":
        modes["table"] = False
    _write_entries(modes["file"], calls["finite"], kernel)

    def run(name: str, declined: int, skipped: int) -> None:
        before = dict(aten_override.stats().get("compiled_kernels", {}))
        result = _OP(*calls[name])
        stats = aten_override.stats()
        assert stats.get("compiled_non_finite", {"declined": 0, "skipped": 0}) == {
            "declined": declined, "skipped": skipped}, (name, stats)
        ran = {k: n - before.get(k, 0) for k, n in stats["compiled_kernels"].items() if n != before.get(k, 0)}
        assert ran == {kernel if name == "finite" else "native": 1}, ran
        if name == "finite":
            check_against_native(result, natives[name], output_mask=calls[name][-1])
            return
        for o, n in zip(result, natives[name]):
            assert o.dtype == n.dtype and o.shape == n.shape and o.stride() == n.stride()
            torch.testing.assert_close(o, n, equal_nan=True, rtol=0, atol=0)

    for mode, autotune_setting in modes.items():
        aten_override.reset_stats()
        with aten_override.enable("compiled", autotune=autotune_setting):
            run("finite", 0, 0)
            run("bad", 1, 0)  # our kernel declined the call: native computed it
            run("bad", 1, 1)  # not offered to our kernel
            run("bad", 1, 2)
            run("finite", 1, 2)  # offered again: our kernel serves it, and the mark is gone
            run("bad", 2, 2)
            run("bad", 2, 3)
            run("finite", 2, 3)  # clears the mark the block would otherwise leave for the next mode
        autotune.clear()


def test_deterministic_mode_gives_the_same_bits_whatever_was_declined_before():
    """Under torch.use_deterministic_algorithms(True) a call's bits must not depend on what ran before.
    A NaN no tap reads (stride 2 leaves the input's last row and column unread) makes no kernel of ours
    decline, so the table's kernel serves the call; a mark left by a declined call of the same
    signature must not send it to native instead (a reviewer found grad_weight 2.9e-6 off that way).
    Outside deterministic mode the mark does send it to native: native's result."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 16, 12, 12, generator=g)
    w = torch.randn(16, 1, 3, 3, generator=g)
    go = torch.randn(2, 16, 5, 5, generator=g)
    unread = x.clone()
    unread[0, 0, 11, 11] = float("nan")
    bad_go = go.clone()
    bad_go[0, 0, 2, 2] = float("inf")

    def call(grad_output, input):
        return (grad_output, input, w, [16], [2, 2], [0, 0], [1, 1], False, [0, 0], 16, [True, True, True])

    with aten_override.enable("compiled", autotune=False):
        with DeterministicGuard(True):
            first = _OP(*call(go, unread))
            assert compiled.extension().last_call()["kernel"] != "native"
            _OP(*call(bad_go, x))  # declined (and counted)
            again = _OP(*call(go, unread))
            assert aten_override.stats()["compiled_non_finite"] == {"declined": 1, "skipped": 0}
        for a, b in zip(first, again):
            assert torch.equal(a, b)
        _OP(*call(bad_go, x))  # declined, and marked outside deterministic mode
        native = _OP(*call(go, unread))
        assert aten_override.stats()["compiled_non_finite"]["skipped"] == 1
    for a, b in zip(native, call_native(call(go, unread))):
        assert torch.equal(a, b)


def test_calls_with_non_finite_operands_are_not_tuned_and_do_not_pin_their_signature():
    """A signature first called with an inf (a bad batch, a float16 GradScaler's overflowing first
    steps): our kernels would decline it, so it is not tuned at all; native serves it and nothing is
    stored, however many such calls come (until session 35 the third was stored as native, for good
    and in the results file: a new user's GradScaler run left every layer on native). The first finite
    call tunes, and its winner is kept."""
    args = depthwise_call()
    bad = list(args)
    bad[0] = args[0].clone()
    bad[0][0, 0, 0, 0] = float("inf")
    with aten_override.enable("compiled", autotune=True):
        for _ in range(5):
            ours = _OP(*bad)
            assert compiled.extension().last_call()["kernel"] == "native"
            assert not compiled.extension().last_call()["tuned"]
        assert autotune.entries() == []
        assert "compiled_tuning" not in aten_override.stats()
        _OP(*args)
    (entry,) = autotune.entries()
    assert not any("declined" in why for why in entry["rejected"].values()), entry
    assert aten_override.stats()["compiled_tuning"]["signatures"] == 1
    for o, n in zip(ours, call_native(bad)):
        assert o.stride() == n.stride()
        torch.testing.assert_close(o, n, equal_nan=True, rtol=0, atol=0)


def test_saving_keeps_the_entries_another_process_wrote_meanwhile(tmp_path):
    """Two processes on one results file (two DDP ranks, two scripts with ATEN_OVERRIDE_AUTOTUNE): each
    writes its table back on leaving, and the last writer used to drop the other's entries (a new
    user's two runs kept 3 of 6). save() reads the file again under a lock and keeps the entries this
    process lacks; its own win where both hold a signature."""
    path = tmp_path / "tune.json"
    first, second = depthwise_call(8, 10), _dense_call()
    with aten_override.enable("compiled", autotune=path):  # "another process": the file gets its entry
        _OP(*first)
    (theirs,) = json.loads(path.read_text())["entries"]
    autotune.clear()
    with aten_override.enable("compiled", autotune=True):  # this process, which never read the file
        _OP(*second)
    (mine,) = autotune.entries()
    assert autotune.save(path) == 2
    saved = {e["signature"]: e for e in json.loads(path.read_text())["entries"]}
    assert saved == {theirs["signature"]: theirs, mine["signature"]: mine}
    edited = dict(mine, kernel="native" if mine["kernel"] != "native" else "winograd")
    path.write_text(json.dumps({"header": autotune.header(), "entries": [edited]}))
    autotune.save(path)
    assert {e["signature"]: e["kernel"] for e in json.loads(path.read_text())["entries"]} == {
        mine["signature"]: mine["kernel"]}


def test_relative_results_path_is_the_one_entered_with(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    with aten_override.enable("compiled", autotune="rel.json"):
        _OP(*depthwise_call(8, 10))
        monkeypatch.chdir(tmp_path / "elsewhere")
    assert (tmp_path / "rel.json").exists() and not (tmp_path / "elsewhere" / "rel.json").exists()


@pytest.mark.parametrize("content", ['{"header": null, "entries": []}', '{"header": [], "entries": []}', "[" * 100000])
def test_malformed_results_file_is_ignored(tmp_path, caplog, content):
    path = tmp_path / "tune.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="aten_override.autotune"):
        with aten_override.enable("compiled", autotune=path):
            _OP(*depthwise_call(8, 10))
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert not autotune.file_info(path)["valid"] or json.loads(path.read_text())["header"] == autotune.header()


def test_failed_save_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "dir.json"
    target.mkdir()
    with pytest.raises(OSError):
        autotune.save(target)
    assert [p.name for p in tmp_path.iterdir()] == ["dir.json"]
