"""``python -m aten_override test``: passes a correct backend, fails a wrong one, names both."""

import os
import subprocess
import sys

import pytest

from aten_override.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_cli(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "aten_override", "test", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def _summary_row(stdout, backend):
    lines = stdout[stdout.index("aten_override test summary"):].splitlines()
    row = next(line for line in lines if line.split()[:1] == [backend])
    passed, failed, skipped = map(int, row.split()[1:4])
    return passed, failed, skipped


def test_wrong_backend_fails_with_a_summary(tmp_path):
    wrong = "aten_override.testing.example_backends:wrong_grad_weight"
    result = _run_cli("--backend", wrong, "--backend", "python", "-k", "conv2d and (matches_native or errors)", cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    passed, failed, _ = _summary_row(result.stdout, "wrong_grad_weight")
    assert failed > 0
    assert "wrong_grad_weight: FAILED test_matches_native_wrong_grad_weight_convolution_backward_conv2d_cpu_float32" in result.stdout
    assert passed > 0  # its error tests pass: FunctionBackend validates arguments for it
    python_passed, python_failed, _ = _summary_row(result.stdout, "python")
    assert python_failed == 0 and python_passed == passed + failed


def test_wrong_strides_fail_the_fuzzer_with_a_reproduction(tmp_path):
    # Seeded: about 1 random example in 7 has an output whose native strides are not contiguous,
    # so an unseeded 50-example run misses the wrong strides now and then (CI once did).
    result = _run_cli("--backend", "aten_override.testing.example_backends:wrong_strides", "--fuzz", "50", "--seed", "0", cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Reproduction:" in result.stdout
    assert "torch.ops.aten.convolution_backward.default(*args)" in result.stdout
    assert ": strides (" in result.stdout


@pytest.mark.slow
def test_correct_user_backend_passes(tmp_path):
    result = _run_cli("--backend", "aten_override.testing.example_backends:delegating", "-k", "conv1d", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    passed, failed, _ = _summary_row(result.stdout, "delegating")
    assert passed > 0 and failed == 0


@pytest.mark.parametrize(
    "backend, message",
    [("nope", "unknown backend 'nope'"), ("aten_override.testing.example_backends:nope", "has no function 'nope'"),
     ("no_such_module_xyz:fn", "No module named 'no_such_module_xyz'")],
    ids=["unknown-name", "missing-function", "missing-module"],
)
def test_bad_backend_is_a_usage_error(backend, message, capsys):
    assert main(["test", "--backend", backend]) == 2
    assert message in capsys.readouterr().out
