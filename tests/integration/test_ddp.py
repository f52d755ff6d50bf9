r"""DistributedDataParallel: 2 CPU ranks (gloo), the override enabled in every rank.

Each rank is its own interpreter (``RANK``/``WORLD_SIZE``/``MASTER_*`` as ``torchrun`` sets them)
running tests/integration/ddp_train.py; the final parameters must equal a native DDP run's, and
every rank must report that our backend served its convolution backward calls.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch


from ..backend_params import parametrize_backend, subprocess_env

SCRIPT = Path(__file__).with_name("ddp_train.py")
WORLD = 2
CONV_LAYERS, STEPS = 3, 3


def _launch(out: Path, argv_prefix: list[str], extra: list[str] = ()) -> list[dict]:
    """Start WORLD ranks of ``python *argv_prefix ddp_train.py --out out *extra``; return their
    saved results. Fails with every rank's output if any rank fails.

    The rendezvous store is this process's, as torchrun's agent hosts it
    (``TORCHELASTIC_USE_AGENT_STORE``: every rank connects as a client): it listens on a port the
    OS picked when it bound it. (A port probed free and closed again can be taken by any process
    before rank 0 binds it, seconds later: rank 0 then fails with "address already in use".)"""
    out.mkdir()
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=WORLD, is_master=True, wait_for_workers=False)
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    procs = [
        subprocess.Popen(
            [sys.executable, *argv_prefix, str(SCRIPT), "--out", str(out), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=subprocess_env(RANK=str(r), WORLD_SIZE=str(WORLD), **rendezvous),
        )
        for r in range(WORLD)
    ]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    failed = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    assert not failed, "\n".join(f"rank {r} exited {rc}:\n{o}" for r, rc, o in failed)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _check_native(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["active"] is None
        assert set(r["stats"]) == {"fallback_reasons"}, r["stats"]  # nothing went through us


def _check(ranks: list[dict], native: list[dict], backend: str) -> None:
    for rank, (r, n) in enumerate(zip(ranks, native)):
        assert r["active"] == backend, f"rank {rank}: active backend {r['active']!r}"
        # Every conv layer's backward in every step was ours, in every rank.
        assert r["stats"].get(backend, 0) == CONV_LAYERS * STEPS, f"rank {rank}: {r['stats']}"
        assert r["stats"].get("fallback", 0) == 0, f"rank {rank}: {r['stats']}"
        assert r["params"].keys() == n["params"].keys()
        for name, value in r["params"].items():
            torch.testing.assert_close(value, n["params"][name], msg=lambda m: f"rank {rank} {name}: {m}")
    # DDP kept the replicas in sync under the override too.
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, rtol=0, atol=0)


@parametrize_backend
def test_ddp_enable_in_every_rank(backend, tmp_path):
    """Each rank trains natively, then under ``enable(backend)``, in the same process group."""
    ranks = _launch(tmp_path / backend, [], ["--enable", backend, "--reference"])
    native = [r.pop("native") for r in ranks]
    _check_native(native)
    _check(ranks, native, backend)


def _cli_run_missing() -> str | None:
    try:
        from aten_override.cli import run  # noqa: F401
    except ImportError as e:
        return f"aten_override.cli.run is not importable ({e}); the `run` command lands with the CLI branch"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_cli_run_missing() is not None, reason=str(_cli_run_missing()))
@parametrize_backend
def test_ddp_command_line_runner(backend, tmp_path):
    """``python -m aten_override run --backend B ddp_train.py …`` in every rank, the script unchanged,
    against a native run of the same script."""
    native = _launch(tmp_path / "native", [])
    _check_native(native)
    ranks = _launch(tmp_path / backend, ["-m", "aten_override", "run", "--backend", backend])
    _check(ranks, native, backend)
