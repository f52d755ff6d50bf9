"""The pytest plugin: ``--aten-override=BACKEND`` serves a whole session's convolution backward."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_TEST = textwrap.dedent(
    """
    import torch
    import aten_override

    def test_model_trains():
        model = torch.nn.Conv2d(3, 4, 3)
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        assert model.weight.grad is not None
    """
)


def _pytest(tmp_path, *args):
    (tmp_path / "test_user_model.py").write_text(USER_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "aten_override.pytest_plugin", "-p", "no:cacheprovider",
         "-q", "-rN", *args, str(tmp_path / "test_user_model.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_backend_serves_the_session_and_is_reported(tmp_path):
    result = _pytest(tmp_path, "--aten-override=python")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "convolution_backward calls under 'python': python: 1" in result.stdout


@pytest.mark.slow
def test_user_backend_by_module_function(tmp_path):
    result = _pytest(tmp_path, "--aten-override=aten_override.testing.example_backends:wrong_grad_weight")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "under 'wrong_grad_weight': wrong_grad_weight: 1" in result.stdout


@pytest.mark.slow
def test_without_the_option_nothing_changes(tmp_path):
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "aten_override" not in result.stdout


def test_unknown_backend_is_a_usage_error(tmp_path):
    result = _pytest(tmp_path, "--aten-override=nope")
    assert result.returncode == 4  # pytest's usage error
    assert "--aten-override=nope: aten_override: unknown backend 'nope'" in result.stderr
