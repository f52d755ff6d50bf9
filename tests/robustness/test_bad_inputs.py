r"""Bad-input sweep: invalid arguments fed straight to ``torch.ops.aten.convolution_backward.default``.

The table is tests/robustness/bad_inputs.py (shapes, dtypes, devices, layouts, groups, strides,
padding, dilation, output_padding, grad_output sizes, output_mask lengths). The whole sweep, native
and every backend, runs in one child interpreter: exit status 0 proves nothing crashed. Per case:

- the backend raises the same family of exception as native (``RuntimeError``,
  ``NotImplementedError`` …), except where native accepts an invalid call (``UPSTREAM_ACCEPTS``);
- its message is clear: either it names the op and the backend (``convolution_backward[python]: …``)
  and carries ``_registration``'s note, or the call fell back and the message is native's verbatim;
- our kernel was reached exactly when the dispatcher routes the call to CPU (``NOT_REACHED``);
- afterwards the dispatcher is as before and a valid call is served correctly.

Where native itself kills the process (``UPSTREAM_CRASHES``: an empty batch or zero input channels
with ``bias_sizes=None`` and the bias gradient requested dereference an empty optional), native runs
in a child interpreter and is expected to abort; our backends return upstream's result for the same
call with ``bias_sizes`` given.
"""

from __future__ import annotations

import json
import signal
import textwrap

import pytest
import torch

import aten_override

from ..backend_params import BACKENDS, parametrize_backend, run_python, served
from . import bad_inputs
from .bad_inputs import CASES, NOT_REACHED, UPSTREAM_ACCEPTS, UPSTREAM_CRASHES


@pytest.fixture(scope="module")
def sweep() -> dict:
    proc = run_python([bad_inputs.__file__, *BACKENDS], timeout=300)
    assert proc.returncode == 0, f"the sweep crashed: exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out = {r["case"]: r for r in rows if "case" in r}
    out["_dispatcher"] = next(r["_dispatcher"] for r in rows if "_dispatcher" in r)
    return out


def test_table_size():
    assert len(CASES) + len(UPSTREAM_CRASHES) >= 30


@parametrize_backend
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(sweep, backend, case):
    row = sweep[case]
    native, ours = row["native"], row[backend]
    assert ours["reached"] == (case not in NOT_REACHED), row
    if case in UPSTREAM_ACCEPTS:
        assert native["ok"] and not ours["ok"] and ours["family"] == "RuntimeError", row
    elif native["ok"]:
        assert ours["ok"], row
        return
    else:
        assert not ours["ok"] and ours["family"] == native["family"], row
    note = f"aten_override: raised by backend {backend!r} serving aten::convolution_backward; the dispatcher is unchanged"
    if ours["message"].startswith(f"convolution_backward[{backend}]: "):
        assert ours["notes"] == [note], row
    else:  # not ours to judge: the original kernel (or the dispatcher) raised, unchanged
        assert ours["message"] == native["message"] and ours["notes"] == [], row


def test_dispatcher_intact_after_sweep(sweep):
    d = sweep["_dispatcher"]
    assert d["unchanged"] and not d["registered"], d
    assert d["valid_call_works"] == {b: True for b in BACKENDS}, d


_NATIVE_CRASH = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import bad_inputs
    torch.ops.aten.convolution_backward.default(*bad_inputs.UPSTREAM_CRASHES[sys.argv[2]]())
    print("survived")
""")


@parametrize_backend
@pytest.mark.parametrize("case", list(UPSTREAM_CRASHES))
def test_upstream_crash_fixed(backend, case):
    native = run_python(["-c", _NATIVE_CRASH, str(bad_inputs.__file__).rsplit("/", 1)[0], case], timeout=60)
    assert native.returncode == -signal.SIGABRT and "bad_optional_access" in native.stderr, (
        f"upstream no longer aborts on {case!r}? exit {native.returncode}: {native.stderr[-500:]}"
    )
    args = UPSTREAM_CRASHES[case]()
    # Upstream's answer to the same call when bias_sizes is given: zeros of the right shapes.
    c_out = args[0].size(1)
    expected = aten_override.original_kernel("cpu")(*args[:3], [c_out], *args[4:])
    with served(backend):
        got = torch.ops.aten.convolution_backward.default(*args)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype and g.stride() == e.stride()
        torch.testing.assert_close(g, e, rtol=0, atol=0)
