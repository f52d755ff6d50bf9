"""``python -m aten_override info``: versions, the backend x dispatch-key table, the compiled CUDA kernels' state."""

import pytest
import torch

import aten_override
from aten_override.cli import info
from aten_override.ops.convolution_backward import compiled


def test_info_prints_the_table_and_the_cuda_kernels_state(capsys):
    assert info.main(None) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    for backend in aten_override.availability():
        assert any(line.split()[:2] == [backend, "CUDA"] for line in out.splitlines()), out
    state = compiled.cuda_kernels()
    expected = f"compiled CUDA kernels (depthwise class): {state}"
    if state != "enabled":
        expected += " (CUDA calls of the compiled backend run the original kernel)"
    assert expected in out.splitlines(), out


@pytest.mark.skipif(compiled.unavailable_reason() is not None, reason="the compiled backend is not built")
def test_info_says_whether_underflowing_calls_are_rescaled(capsys):
    from aten_override._machine import subnormal_line

    info.main(None)
    line = subnormal_line(compiled.extension().subnormal_cost())
    assert line.startswith("subnormal arithmetic: ") and line in capsys.readouterr().out.splitlines()


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA: the extension may have CUDA kernels")
def test_info_cpu_torch_says_not_built(capsys):
    info.main(None)
    assert "compiled CUDA kernels (depthwise class): not built" in capsys.readouterr().out


@pytest.mark.skipif(aten_override.availability()["compiled"] is not None, reason="the compiled backend is not built")
def test_info_layer_classes(capsys):
    from aten_override.__main__ import main

    assert main(["info", "--layer-classes"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("compiled layer classes:"):].splitlines()[2:]
    starts = [line.split()[:2] for line in table if not line.startswith(" ")]
    assert starts == [[name, kernel] for name, kernel, _ in compiled.LAYER_CLASSES]
    assert "dead-taps" in out and "uninitialised" in out
    assert main(["info"]) == 0 and "compiled layer classes" not in capsys.readouterr().out


@pytest.mark.parametrize(("env", "line"), [
    (None, "compiled graphs: on (default): graphs Inductor compiles inside enable() call aten_override::convolution_backward"),
    ("0", "compiled graphs: off (ATEN_OVERRIDE_COMPILED_GRAPHS='0'): compiled graphs call aten's op"),
])
def test_info_compiled_graphs(capsys, monkeypatch, env, line):
    if env is None:
        monkeypatch.delenv("ATEN_OVERRIDE_COMPILED_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("ATEN_OVERRIDE_COMPILED_GRAPHS", env)
    info.main(None)
    assert line in capsys.readouterr().out
