"""scripts/mutation_check.py: the shipped suite catches every mutant of the reference backend, and
passes the reference itself (slow: the suite runs on 22 backends, 4-11 minutes on 2 cores)."""

import json
import os
import subprocess
import sys

import pytest

from aten_override.testing.mutants import MUTANTS
from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "mutation_check.py")


@pytest.mark.slow
def test_every_mutant_is_caught_and_the_control_passes(tmp_path):
    out = tmp_path / "mutants.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, SCRIPT, "--json", str(out), "--keep", str(tmp_path / "runs")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert result.stdout.startswith("CPU: ")
    assert "MISSED" not in result.stdout and "control passed" in result.stdout
    caught = json.loads(out.read_text())
    assert caught["from_forward_convolutions"]["caught_by"] == []
    assert set(MUTANTS) <= set(caught) and all(caught[name]["caught_by"] for name in MUTANTS)
