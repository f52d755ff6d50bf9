"""`python -m aten_override tune`: a program run once fills a results file a second run takes whole."""

from __future__ import annotations

import json
import textwrap

import pytest

from aten_override import autotune
from aten_override.ops.convolution_backward import compiled

from ..backend_params import run_python

pytestmark = pytest.mark.skipif(compiled.unavailable_reason() is not None, reason=str(compiled.unavailable_reason()))

PROGRAM = textwrap.dedent(
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 4, 1))
    for _ in range(2):
        net(torch.randn(2, 3, 12, 12)).sum().backward()
    """
)


def test_tune_fills_the_file_and_a_second_run_takes_it(tmp_path):
    script, results = tmp_path / "train.py", tmp_path / "tune.json"
    script.write_text(PROGRAM)
    first = run_python(["-m", "aten_override", "tune", "--file", str(results), str(script)])
    assert first.returncode == 0, first.stderr
    assert f"3 signatures in {results} (3 tuned now" in first.stderr, first.stderr
    data = json.loads(results.read_text())
    assert data["header"] == autotune.header()
    # A kernel, or a split "a+b" of two (which one wins is the machine's measurement).
    parts = {part for e in data["entries"] for part in e["kernel"].split("+")}
    assert parts <= set(compiled.extension().kernel_names()), data["entries"]
    assert all(e["kernel"].count("+") <= 1 for e in data["entries"]), data["entries"]
    assert all(e["times_us"] for e in data["entries"])  # every tuned entry says what was timed
    second = run_python(["-m", "aten_override", "tune", "--file", str(results), str(script)])
    assert second.returncode == 0, second.stderr
    assert f"3 signatures in {results} (0 tuned now, 0 ms)" in second.stderr, second.stderr
    info = run_python(["-m", "aten_override", "info"], ATEN_OVERRIDE_AUTOTUNE=str(results))
    assert f"autotune results file: {results}: 3 entries, valid" in info.stdout, info.stdout


@pytest.mark.parametrize("options", [["--backend", "python"], ["--autotune", "off"]])
def test_tune_rejects_options_it_cannot_honour(tmp_path, options):
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    proc = run_python(["-m", "aten_override", "tune", "--file", str(tmp_path / "t.json"), *options, str(script)])
    assert proc.returncode == 2 and options[0] in proc.stderr, proc.stderr
    assert not (tmp_path / "t.json").exists()


def test_tune_help_lists_only_options_it_honours():
    """tune sets the backend and the autotune setting itself: its help must not offer --backend or
    --autotune (a new user found them listed, with run's choices, then refused)."""
    proc = run_python(["-m", "aten_override", "tune", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--file" in proc.stdout and "--trace-every" in proc.stdout, proc.stdout
    assert "--backend" not in proc.stdout and "--autotune" not in proc.stdout, proc.stdout
