"""The pytest plugin: ``--aten-override=BACKEND`` serves a whole session's convolution backward."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_TEST = textwrap.dedent(
    """
    import os

    import torch
    import aten_override

    def test_model_trains():
        assert aten_override.active_backend() == (os.environ["EXPECTED_BACKEND"] or None)
        model = torch.nn.Conv2d(3, 4, 3)
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        assert model.weight.grad is not None
    """
)


# Installed (e.g. `pip install -e .`), the pytest11 entry point loads the plugin; `-p` again would
# register it twice.
_LOAD_PLUGIN = (
    []
    if any(ep.value == "aten_override.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    else ["-p", "aten_override.pytest_plugin"]
)


def _pytest(tmp_path, *args, expected_backend=""):
    (tmp_path / "test_user_model.py").write_text(USER_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env["EXPECTED_BACKEND"] = expected_backend
    return subprocess.run(
        [sys.executable, "-m", "pytest", *_LOAD_PLUGIN, "-p", "no:cacheprovider",
         "-rN", *args, str(tmp_path / "test_user_model.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_backend_serves_the_session_and_is_reported(tmp_path):
    result = _pytest(tmp_path, "--aten-override=python", expected_backend="python")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "aten_override: aten::convolution_backward served by backend 'python' (--aten-override)" in result.stdout
    assert "convolution_backward calls under 'python': python: 1" in result.stdout


@pytest.mark.slow
def test_user_backend_by_module_function(tmp_path):
    result = _pytest(
        tmp_path, "--aten-override=aten_override.testing.example_backends:wrong_grad_weight",
        expected_backend="wrong_grad_weight",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "under 'wrong_grad_weight': wrong_grad_weight: 1" in result.stdout


@pytest.mark.slow
def test_without_the_option_nothing_changes(tmp_path):
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "convolution_backward calls under" not in result.stdout


def test_unknown_backend_is_a_usage_error(tmp_path):
    result = _pytest(tmp_path, "--aten-override=nope")
    assert result.returncode == 4  # pytest's usage error
    assert "--aten-override=nope: aten_override: unknown backend 'nope'" in result.stderr


FROZEN_TEST = textwrap.dedent(
    """
    import torch

    def test_frozen_weights():
        model = torch.nn.Conv2d(3, 4, 3)
        model.weight.requires_grad_(False)  # output_mask [False, False, True]: oneDNN returns a grad_weight anyway
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    """
)


def test_pass_through_backend_fails_the_plugin_saying_why(tmp_path):
    """Under enable(fn) the masked grad_weight is dropped with a warning; the plugin, a test bed,
    keeps failing the backend that returns it, with the reason."""
    (tmp_path / "test_frozen.py").write_text(FROZEN_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *_LOAD_PLUGIN, "-p", "no:cacheprovider",
         "--aten-override=aten_override.testing.example_backends:pass_through", str(tmp_path / "test_frozen.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "grad_weight must be None when output_mask[1] is False" in result.stdout
    assert "the test bed fails it" in result.stdout
