"""scripts/bench_training.py: the training benchmark runs end to end (not timed) and its models build."""

from __future__ import annotations

import copy
import importlib.util
import re
import sys

import pytest
import torch

from ..backend_params import REPO, run_python

NO_COMPILED = "compiled kernels not built"


def _load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # its `from interleave import ...`
    spec = importlib.util.spec_from_file_location("bench_training", REPO / "scripts" / "bench_training.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_r2plus1d_18_trains_on_a_tiny_clip(monkeypatch):
    """The plain-torch video model (no transformers needed): a backward on two 2x16x16 clips."""
    model = _load_script(monkeypatch).R2Plus1D18(num_classes=5)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 2, 16, 16)), torch.tensor([3, 1]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert sum(isinstance(m, torch.nn.Conv3d) for m in model.modules()) == 2 + 16 * 2 + 3  # stem, blocks, downsamples


def test_bench_training_prints_a_ratio_row():
    """``--models resnet50`` at batch 1 on 64x64 images (batch norm needs 2 values
    per channel: 2x2 at the last stage), one round: the summary has a ratio row and
    the top-layers table names the compiled layer class of each layer."""
    pytest.importorskip("transformers", reason="transformers not installed (pip install -e '.[bench]')")
    import aten_override

    if aten_override.availability()["compiled"]:
        pytest.skip(NO_COMPILED)
    proc = run_python(
        ["scripts/bench_training.py", "--models", "resnet50", "--batch", "1", "--image-size", "64",
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--threads", "1"],
        timeout=900,  # a loaded 2-core Zen 3 VM took over 300 s
        ATEN_OVERRIDE_AUTOTUNE="1",  # (the tests' default is off) the warmup tunes every signature
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("cpu: ") and "FLOP peak" in out, out  # the machine header comes first
    row = next(line.split() for line in out.splitlines() if line.startswith("resnet50 "))
    assert row[:3] == ["resnet50", "1x3x64x64", "1"], row
    assert float(row[5]) > 0, row  # compiled / native
    assert float(row[-1]) > 0, row  # conv backward time, compiled / native
    assert "top 8 conv layers" in out and ("dense" in out or "pointwise" in out), out
    assert "GFLOP/s" in out and "geomean at 1 threads over 1 models: step ratio" in out, out
    # the warmup tuned every signature before the timed steps, and says what that cost
    warm = re.search(r"warmup \(untimed\): first step native \d+ ms, compiled \d+ ms; the compiled side tuned "
                     r"(\d+) signatures in [\d.]+ s over its (\d+) warmup steps", out)
    assert warm and int(warm[1]) > 0 and int(warm[2]) >= 2, out


def test_subnormal_census_counts_each_conv_layers_grad_output(monkeypatch):
    """The census counts exactly the subnormal values of each conv layer's ``grad_output``: the
    second layer's output is scaled by 1e-39 in the loss (its ``grad_output`` is all subnormal in
    float32), the first layer's ``grad_output`` is the second's ``grad_input`` (1e-39 times weights of
    ~0.1 to 1: subnormal or zero, never normal), and a float64 layer (1e-39 is normal there) counts
    none."""
    bt = _load_script(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Conv2d(3, 4, 1))
    x = torch.randn(2, 2, 6, 6)
    w = bt.Workload("tiny", model, lambda: (model(x) * 1e-39).sum(), "2x2x6x6")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    census = bt.subnormal_census(w, opt)
    assert census.values == 2 * 4 * 4 * 4 + 2 * 3 * 4 * 4, census
    assert census.worst == "1" and census.worst_share == 1.0, census
    assert 2 * 4 * 4 * 4 < census.subnormal <= census.near <= census.values, census
    assert not any(m._forward_hooks for m in model), "the census leaves no hook behind"

    model64 = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3)).double()
    x64 = x.double()
    w64 = bt.Workload("tiny64", model64, lambda: (model64(x64) * 1e-39).sum(), "2x2x6x6")
    census64 = bt.subnormal_census(w64, torch.optim.SGD(model64.parameters(), lr=0.0))
    assert (census64.values, census64.subnormal, census64.worst) == (2 * 3 * 4 * 4, 0, "-"), census64
    # 1e-39 is far above float64's 2^24 x tiny (~4e-301): not near either
    assert census64.near == 0, census64

    # float32 values of 1e-35 are normal but within 2^24 x tiny (~2e-31) of the subnormal range
    w35 = bt.Workload("near", model, lambda: (model(x) * 1e-35).sum(), "2x2x6x6")
    census35 = bt.subnormal_census(w35, opt)
    assert census35.near >= 2 * 4 * 4 * 4 and census35.subnormal < census35.near, census35


def test_a_step_that_leaves_a_weight_non_finite_is_counted_and_undone(monkeypatch):
    """Both sides train one model: a side whose gradients are wrong (torch 2.13's bfloat16 R(2+1)D-18
    step on AMX-BF16 left its weights NaN after two native steps) must not leave the other timing steps
    on NaN. The step is counted against its side and the model and optimizer go back to their state
    before the first step; a finite step changes nothing."""
    bt = _load_script(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3))
    x = torch.randn(2, 2, 6, 6)
    w = bt.Workload("tiny", model, lambda: model(x).square().mean(), "2x2x6x6")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    w.initial = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    bt.step(w, opt)
    bt.restore_if_not_finite(w, opt, "compiled")
    assert not any(w.not_finite.values()), w.not_finite
    trained = copy.deepcopy(model.state_dict())
    assert not torch.equal(trained["0.weight"], w.initial[0]["0.weight"])
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] = float("nan")
    bt.restore_if_not_finite(w, opt, "native")
    assert w.not_finite["native"] == 1 and w.not_finite["compiled"] == 0, w.not_finite
    for key, value in model.state_dict().items():
        assert torch.equal(value, w.initial[0][key]), key
    assert opt.state_dict()["state"] == {}, "the momentum buffers are the initial (none)"
